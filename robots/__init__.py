"""edgespec.robots: robot interface, action-chunk queue and fixed-rate control loop (the ROS 2 node is not built yet)."""

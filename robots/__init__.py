"""edgespec.robots: robot interface (+ mock, + the MuJoCo three-target reacher), action-chunk queue,
fixed-rate control loop with hold-then-stop and a watchdog, its latency profile, a ROS 2-compatible DDS
node (cyclonedds, no rclpy) and the `edgespec robot run|node` commands. It imports the runtime; the
runtime never imports it."""

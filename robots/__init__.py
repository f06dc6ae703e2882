"""edgespec.robots: robot interface (+ mock, + the MuJoCo three-target reacher), action-chunk queue,
fixed-rate control loop with hold-then-stop and a watchdog, its latency profile, a ROS 2-compatible DDS
node (cyclonedds, no rclpy), the `edgespec robot run|node` commands, and the reacher's training data and
closed-loop evaluation (demos.py).

Imports: the runtime (edgespec), numpy, gymnasium, mujoco, cyclonedds, matplotlib (the `robots` extra);
never edgespec.export (no torch). The runtime never imports this package.
"""

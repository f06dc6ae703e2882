"""edgespec.robots: control-loop adapter and ROS 2-compatible node (see DESIGN.md; not built yet)."""

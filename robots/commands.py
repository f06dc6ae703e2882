"""`edgespec robot`: registered on the runtime's command line through the "edgespec.commands" entry point
(pyproject.toml), so the runtime never imports the robots package.
"""
from __future__ import annotations

import argparse


def cmd_robot(args) -> int:
    """`edgespec robot ARGS`: robots/cli.py's own parser takes ARGS (its dependencies load only now)."""
    try:
        from edgespec.robots import cli as robots_cli
    except ImportError as e:
        raise SystemExit(f"`edgespec robot` needs the robots extra ({e.name} is missing): "
                         f"pip install 'edgespec[robots]'")
    return robots_cli.main(args.robot_args)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `robot` to `edgespec`'s parser."""
    p = sub.add_parser("robot", help="run a VLA policy on the control loop (run) or as a ROS 2 DDS node (node)",
                       add_help=False)
    p.add_argument("robot_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_robot)

"""`edgespec robot run` and `edgespec robot node`: a VLA policy on the control loop or behind a DDS node.

    edgespec robot run --env reacher --policy engines/vla-reacher --draft head --hz 20 \\
        --instruction "reach the red target" --seconds 3 --profile loop.json
    edgespec robot node --policy engines/vla-reacher --draft head --hz 20 --loopback --seconds 10

`run` drives the MuJoCo reacher (lockstep: one physics period per tick) and prints the loop's latency
profile and the episode's result; --profile writes the profile JSON, a Chrome trace (.trace.json) and a
timeline PNG beside it. `node` serves the policy over ROS 2 topics (see robots/node.py).

SIGINT / SIGTERM during `run` end the loop at its next tick with the robot safe-stopped once; the summary
is printed as usual and the exit status is 128 + the signal number (130, 143). Every failure is one
`error:` line on stderr, never a traceback: before the robot moves (bad flags, a policy folder that does not
load, an ONNX Runtime error) with exit status 2; while running (the robot or simulator failing, a
robot.safe_stop() that raised) with exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from .policy_args import cpu_set, make_policy, one_line, policy_flags, positive_seconds
from .reacher import COLORS, SUCCESS_RADIUS


def color_of(instruction: str) -> str:
    named = [c for c in COLORS if c in instruction.lower().split()]
    if len(named) != 1:
        raise ValueError(f"the reacher's instruction must name one of {list(COLORS)}, got {instruction!r}")
    return named[0]


class _Interrupted(BaseException):
    """A signal before the loop exists: abandon the start-up (nothing has moved yet)."""


class SignalStop:
    """For a `with` block: SIGINT / SIGTERM call loop.stop(<signal name>) once a loop is attached (the loop
    then safe-stops the robot once and returns), and abandon the start-up before that. The previous
    handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.loop, self.signum = None, None

    def attach(self, loop) -> None:
        self.loop = loop
        if self.signum is not None:  # arrived while attaching
            loop.stop(signal.Signals(self.signum).name)

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        if self.loop is None:
            raise _Interrupted(signum)
        self.loop.stop(signal.Signals(signum).name)

    def __enter__(self):
        self.saved = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(prof: dict, hz: float) -> str:
    """The loop profile in one line (n/a where a run of 0 ticks has nothing to show)."""
    j, s = prof["jitter_ms"], prof["sections_ms"]
    return (f"{prof['ticks']} ticks at {hz:g} Hz: jitter p50 {_fmt(j['p50'])} / p99 {_fmt(j['p99'])} ms, "
            f"deadline misses {prof['deadline_misses']}, starved {prof['starved_ticks']}, "
            f"infer p50 {_fmt(prof['inference_ms'].get('p50'), '.1f')} ms; "
            f"observe p99 {_fmt(s['observe']['p99'], '.1f')} ms, act p99 {_fmt(s['act']['p99'], '.1f')} ms")


def check_cpus(p: argparse.ArgumentParser, args) -> None:
    """--loop-cpus / --policy-cpus must be CPUs this process may run on (argparse error otherwise)."""
    have = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    for flag, cpus in (("--loop-cpus", args.loop_cpus), ("--policy-cpus", args.policy_cpus)):
        if cpus is not None and not cpus <= have:
            p.error(f"{flag} {','.join(map(str, sorted(cpus)))}: expected a non-empty subset of this process's "
                    f"CPUs {sorted(have)}")


def cmd_run(argv) -> int:
    from .loop import LoopConfig

    p = argparse.ArgumentParser(prog="edgespec robot run", description="a policy on the fixed-rate control loop")
    p.add_argument("--env", choices=["reacher"], default="reacher")
    policy_flags(p)
    p.add_argument("--hz", type=float, default=20.0)
    p.add_argument("--instruction", default="reach the red target")
    p.add_argument("--seconds", type=positive_seconds, default=2.0,
                   help="loop duration (the reacher episode is 2 s)")
    p.add_argument("--seed", type=int, default=0, help="scene seed (target positions, start pose)")
    p.add_argument("--request-threshold", type=int, default=4, help="ask for a chunk below this many actions")
    p.add_argument("--profile", type=Path, default=None, help="write the loop profile JSON (+ trace, PNG)")
    p.add_argument("--rt-priority", type=int, default=None,
                   help="run the loop thread SCHED_FIFO at this priority (needs CAP_SYS_NICE); with "
                        "--inference process the worker thread one below")
    p.add_argument("--spin-ms", type=float, default=0.0, help="busy-wait the last ms before each tick")
    p.add_argument("--loop-cpus", type=cpu_set, default=None,
                   help="CPUs for the loop thread, e.g. 0 (a core of its own; put --policy-cpus elsewhere)")
    args = p.parse_args(argv)
    check_cpus(p, args)
    try:
        color = color_of(args.instruction)
        cfg = LoopConfig(hz=args.hz, request_threshold=args.request_threshold, rt_priority=args.rt_priority,
                         rt_worker=args.inference == "process", spin_s=args.spin_ms / 1e3, cpus=args.loop_cpus)
    except ValueError as e:
        p.error(str(e))
    stop = SignalStop()
    try:
        with stop:
            return _run(p, args, color, cfg, stop)
    except _Interrupted as e:
        print(f"interrupted by {signal.Signals(e.args[0]).name} before the loop started; the robot never moved",
              file=sys.stderr)
        return 128 + e.args[0]
    except Exception as e:  # noqa: BLE001  (a failure is one line, not a traceback)
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1


def _run(p, args, color: str, cfg, stop: SignalStop) -> int:
    from .loop import ControlLoop
    from .profile import chrome_trace, loop_profile, plot_timeline
    from .reacher import ReacherRobot

    try:
        policy, pol = make_policy(args, args.instruction)
    except Exception as e:  # noqa: BLE001  (bad folder, ORT error, an instruction the policy refuses)
        p.exit(2, f"{p.prog}: error: {one_line(e)}\n")  # one line: no usage, the flags were fine
    try:
        with ReacherRobot(seed=args.seed, color=color) as robot:
            loop = ControlLoop(robot, policy, cfg)
            stop.attach(loop)
            print(f"running {args.seconds:g} s at {args.hz:g} Hz (SIGINT / SIGTERM: safe stop and summary)",
                  file=sys.stderr, flush=True)
            rep = loop.run(args.seconds)
            dist = robot.distances[-1] if robot.distances else float("nan")
            stops = robot.stops
    finally:
        policy.close()
    prof = loop_profile(rep, cfg.dt)
    result = {"instruction": args.instruction, "final_distance": dist, "success": bool(dist <= SUCCESS_RADIUS),
              "speculative": pol.draft is not None or pol.head is not None, "mode": args.mode,
              "inference": args.inference, "policy_last_info": policy.last_info,
              "stop_requested": rep.stop_requested, "safe_stops": stops,
              "safe_stop_failures": rep.safe_stop_failures}
    print(summary(prof, args.hz))
    if prof["faults"]:
        print("faults:", *prof["faults"], sep="\n  ")
    if getattr(args, "remote", None):
        r = prof["remote"]
        print(f"remote target {args.remote}: {r['fallbacks']} verifies ran on the local target, "
              f"{r['unavailable']} policy calls found it unavailable (the loop held)")
    if rep.stop_requested:
        print(f"stopped by {rep.stop_requested} after {rep.ticks} ticks")
    print(f"robot.safe_stop() calls: {stops}" + (f", {rep.safe_stop_failures} raised" if rep.safe_stop_failures
                                                 else ""))
    print(f"final distance {dist:.4f} -> {'success' if result['success'] else 'miss'} "
          f"(radius {SUCCESS_RADIUS})")
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(json.dumps({"loop": prof, "episode": result}, indent=2, default=float) + "\n")
        chrome_trace(rep, args.profile.with_suffix(".trace.json"))
        plot_timeline(rep, args.profile.with_suffix(".png"))
        print(f"wrote {args.profile}, {args.profile.with_suffix('.trace.json')}, {args.profile.with_suffix('.png')}")
    if rep.safe_stop_failures:  # the robot may not be holding: say so where a supervisor looks
        stop_faults = [f for f in rep.faults if "robot.safe_stop() raised" in f]
        print(f"error: the robot's safe stop failed {rep.safe_stop_failures} time(s): {stop_faults[-1]}",
              file=sys.stderr)
        return 1
    return 128 + stop.signum if stop.signum else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "node"):
        print("usage: edgespec robot {run,node} ...  (run: control loop on the MuJoCo reacher; node: DDS node)",
              file=sys.stderr)
        return 2
    if argv[0] == "run":
        return cmd_run(argv[1:])
    from .node import cmd_node  # the node owns its command line (and needs no MuJoCo)
    return cmd_node(argv[1:])

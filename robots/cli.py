"""`edgespec robot run` and `edgespec robot node`: a VLA policy on the control loop or behind a DDS node.

    edgespec robot run --env reacher --policy engines/vla-reacher --draft head --hz 20 \\
        --instruction "reach the red target" --seconds 3 --profile loop.json
    edgespec robot node --policy engines/vla-reacher --draft head --hz 20 --loopback --seconds 10

`run` drives the MuJoCo reacher (lockstep: one physics period per tick) and prints the loop's latency
profile and the episode's result; --profile writes the profile JSON, a Chrome trace (.trace.json) and a
timeline PNG beside it. `node` serves the policy over ROS 2 topics (see robots/node.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

from edgespec.policy import load_policy

from .inference import InferenceProcess
from .reacher import COLORS, SUCCESS_RADIUS


def policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", type=Path, required=True, help="exported policy folder (edgespec export-policy)")
    p.add_argument("--draft", nargs="?", const=True, default=False,
                   help="decode speculatively: with the policy's draft/ decoder (no value), its numpy draft "
                        "head ('head', the fastest), or a draft engine DIR")
    p.add_argument("--mode", choices=["greedy", "relaxed"], default="greedy")
    p.add_argument("--radius", type=int, default=5, help="relaxed: bins a draft token may be off")
    p.add_argument("--gamma", type=int, default=None, help="the most draft tokens per round (default: per draft "
                   "kind, edgespec.policy.DRAFT_DEFAULTS)")
    p.add_argument("--stop-below", type=float, default=None,
                   help="dynamic draft length: stop a round's drafting after a proposal the draft gives a "
                        "probability below this (0 = always --gamma; default: per draft kind)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per engine")
    p.add_argument("--inference", choices=["process", "thread"], default="process",
                   help="run the policy in a child process (default: its Python never holds the loop's GIL) "
                        "or in the loop's worker thread")
    p.add_argument("--policy-cpus", type=cpu_set, default=None,
                   help="CPUs for the policy process, e.g. 1 (with --inference process; default: any)")


def cpu_set(text: str) -> frozenset:
    """'0,2' -> frozenset({0, 2}) (argparse type)."""
    try:
        out = frozenset(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPU numbers separated by commas, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected CPU numbers >= 0, got {text!r}")
    return out


class FixedInstruction:
    """A policy callable that always acts on one instruction (the command line's), whatever obs says."""

    def __init__(self, policy, instruction: str):
        self.policy, self.instruction = policy, instruction

    @property
    def last_info(self) -> dict:
        return self.policy.last_info

    def __call__(self, obs: dict) -> np.ndarray:
        return self.policy.act(obs["image"], obs["state"], self.instruction)


def build_policy(instruction: str | None = None, **kw):
    """load_policy(**kw), wrapped to a fixed instruction when one is given (module level: picklable)."""
    pol = load_policy(**kw)
    return FixedInstruction(pol, instruction) if instruction else pol


def make_policy(args, instruction: str | None = None):
    """-> (callable obs -> (H, D) chunk with .last_info and .close(), the Policy). The policy is loaded here
    first, so a bad folder or flag fails before anything starts; with --inference process the callable runs
    its own copy in a child process."""
    kw = dict(policy_dir=args.policy, draft=args.draft, mode=args.mode, radius=args.radius, gamma=args.gamma,
              stop_below=args.stop_below, threads=args.threads)
    pol = load_policy(**kw)
    if instruction:
        pol.instruction_ids(instruction)  # unknown words: fail now
    if getattr(args, "inference", "thread") == "process":
        return InferenceProcess(partial(build_policy, instruction, **kw), cpus=args.policy_cpus), pol
    if args.policy_cpus is not None:
        raise ValueError("--policy-cpus needs --inference process (a thread runs on the loop's CPUs)")
    return InThread(FixedInstruction(pol, instruction) if instruction else pol), pol


class InThread:
    """The policy called directly by the loop's worker thread (--inference thread)."""

    def __init__(self, policy):
        self.policy = policy

    @property
    def last_info(self) -> dict:
        return self.policy.last_info

    def __call__(self, obs: dict) -> np.ndarray:
        return self.policy(obs)

    def close(self) -> None:
        pass


def color_of(instruction: str) -> str:
    named = [c for c in COLORS if c in instruction.lower().split()]
    if len(named) != 1:
        raise ValueError(f"the reacher's instruction must name one of {list(COLORS)}, got {instruction!r}")
    return named[0]


def cmd_run(argv) -> int:
    from .loop import ControlLoop, LoopConfig
    from .profile import chrome_trace, loop_profile, plot_timeline
    from .reacher import ReacherRobot

    p = argparse.ArgumentParser(prog="edgespec robot run", description="a policy on the fixed-rate control loop")
    p.add_argument("--env", choices=["reacher"], default="reacher")
    policy_flags(p)
    p.add_argument("--hz", type=float, default=20.0)
    p.add_argument("--instruction", default="reach the red target")
    p.add_argument("--seconds", type=float, default=2.0, help="loop duration (the reacher episode is 2 s)")
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
    try:
        color = color_of(args.instruction)
        cfg = LoopConfig(hz=args.hz, request_threshold=args.request_threshold, rt_priority=args.rt_priority,
                         rt_worker=args.inference == "process", spin_s=args.spin_ms / 1e3, cpus=args.loop_cpus)
        policy, pol = make_policy(args, args.instruction)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    try:
        with ReacherRobot(seed=args.seed, color=color) as robot:
            rep = ControlLoop(robot, policy, cfg).run(args.seconds)
            dist = robot.distances[-1] if robot.distances else float("nan")
    finally:
        policy.close()
    prof = loop_profile(rep, cfg.dt)
    result = {"instruction": args.instruction, "final_distance": dist, "success": bool(dist <= SUCCESS_RADIUS),
              "speculative": pol.draft is not None or pol.head is not None, "mode": args.mode,
              "inference": args.inference, "policy_last_info": policy.last_info}
    j, s = prof["jitter_ms"], prof["sections_ms"]
    print(f"{prof['ticks']} ticks at {args.hz:g} Hz: jitter p50 {j['p50']:.2f} / p99 {j['p99']:.2f} ms, "
          f"deadline misses {prof['deadline_misses']}, starved {prof['starved_ticks']}, "
          f"infer p50 {prof['inference_ms'].get('p50', float('nan')):.1f} ms; "
          f"observe p99 {s['observe']['p99']:.1f} ms, act p99 {s['act']['p99']:.1f} ms")
    if prof["faults"]:
        print("faults:", *prof["faults"], sep="\n  ")
    print(f"final distance {dist:.4f} -> {'success' if result['success'] else 'miss'} "
          f"(radius {SUCCESS_RADIUS})")
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(json.dumps({"loop": prof, "episode": result}, indent=2, default=float) + "\n")
        chrome_trace(rep, args.profile.with_suffix(".trace.json"))
        plot_timeline(rep, args.profile.with_suffix(".png"))
        print(f"wrote {args.profile}, {args.profile.with_suffix('.trace.json')}, {args.profile.with_suffix('.png')}")
    return 0


def cmd_node(argv) -> int:
    from .node import cmd_node as run_node  # the node owns its command line
    return run_node(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "node"):
        print("usage: edgespec robot {run,node} ...  (run: control loop on the MuJoCo reacher; node: DDS node)",
              file=sys.stderr)
        return 2
    return cmd_run(argv[1:]) if argv[0] == "run" else cmd_node(argv[1:])

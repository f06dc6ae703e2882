"""The policy flags of `edgespec robot run` and `edgespec robot node`, and the policy they load: one place for
both commands (robots/cli.py and robots/node.py import it; neither imports the other).
"""
from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path

import numpy as np

from edgespec.policy import load_policy
from edgespec.remote import RemoteConfig
from edgespec.speculation import from_args, speculation_flags

from .inference import InferenceProcess


def policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", type=Path, required=True, help="exported policy folder (edgespec export-policy)")
    p.add_argument("--draft", nargs="?", const=True, default=False,
                   help="decode speculatively: with the policy's draft/ decoder (no value), its numpy draft "
                        "head ('head', the fastest), its feature head ('feature-head'), or a draft engine DIR")
    speculation_flags(p, kind="policy")  # --mode, --radius, --gamma, --stop-below
    p.add_argument("--threads", type=positive_int, default=1, help="ONNX Runtime threads per engine")
    p.add_argument("--inference", choices=["process", "thread"], default="process",
                   help="run the policy in a child process (default: its Python never holds the loop's GIL) "
                        "or in the loop's worker thread")
    p.add_argument("--policy-cpus", type=cpu_set, default=None,
                   help="CPUs for the policy process, e.g. 1 (with --inference process; default: any)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="verify on a vLLM server serving the policy's target checkpoint (edgespec serve-target "
                        "models/vla-reacher/target); drafts stay here")
    p.add_argument("--remote-fallback", choices=["local", "hold"], default="local",
                   help="when a verify fails: run it on the policy's own target (local, exact) or raise, so the "
                        "loop holds the last action, then stops (hold)")
    p.add_argument("--remote-deadline", type=positive_seconds, default=2.0,
                   help="seconds a verify may take before it counts as failed")


def positive_int(text: str) -> int:
    """'2' -> 2; refuses 0, negatives and non-integers (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def positive_seconds(text: str) -> float:
    """'2.5' -> 2.5; refuses 0, negatives, nan and inf (argparse type)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return x


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
        return self.policy({**obs, "instruction": self.instruction})  # Policy.__call__: the state only if it reads one


def build_policy(instruction: str | None = None, **kw):
    """load_policy(**kw), wrapped to a fixed instruction when one is given (module level: picklable)."""
    pol = load_policy(**kw)
    return FixedInstruction(pol, instruction) if instruction else pol


def make_policy(args, instruction: str | None = None):
    """-> (callable obs -> (H, D) chunk with .last_info and .close(), the Policy). The policy is loaded here
    first, so a bad folder or flag fails before anything starts; with --inference process the callable runs
    its own copy in a child process."""
    kw = dict(policy_dir=args.policy, draft=args.draft, spec=from_args(args, "policy"), threads=args.threads)
    if getattr(args, "remote", None):
        kw["remote"] = RemoteConfig(args.remote, deadline_s=args.remote_deadline,
                                    on_failure="raise" if args.remote_fallback == "hold" else "local")
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


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())  # ONNX Runtime messages span lines

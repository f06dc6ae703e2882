"""How to speculate, in one place: `SpeculationConfig` (draft length, lookup, dynamic stop, acceptance), checked
once when it is made. `load`, `load_policy`, the CLIs (cli.speculation_flags) and the TensorRT profile builder
take it.

    SpeculationConfig(gamma="auto", gamma_max=8)                        # text: γ chosen per round
    SpeculationConfig(gamma=4, lookup=3, lookup_gamma=12)                # text: prompt lookup, then the draft model
    SpeculationConfig(gamma=15, stop_below=0.7, acceptance="relaxed", radius=5)   # a policy's draft head
    SpeculationConfig(gamma=15, stop_below=0.7, last_chunk=True, kind="policy")   # + the last chunk as a draft
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import numpy as np

DEFAULT_GAMMA_MAX = 8  # the longest draft `auto` considers unless gamma_max says otherwise
GAMMA_MAX_LIMIT = 16  # text: the longest draft gamma_max may allow (auto measures a verify call per length)
POLICY_GAMMA_LIMIT = 32  # policies: the longest fixed γ (an action chunk's draft head drafts long runs cheaply)
KINDS = ("text", "policy")
LOOKUP_GAMMA_LIMIT = 16  # the most proposals a round drafted by prompt lookup may make
NGRAM_MAX = 4  # the n-gram draft's longest lookup, unless max_ngram says otherwise
ACCEPTANCE = ("greedy", "relaxed")  # by ids: exact, or (policies) within `radius` bins; sampling is per call


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_gamma_max(gamma_max) -> int:
    if not (_is_int(gamma_max) and 1 <= gamma_max <= GAMMA_MAX_LIMIT):
        raise ValueError(f"gamma_max (the longest draft) must be an integer in [1, {GAMMA_MAX_LIMIT}], "
                         f"got {gamma_max!r}")
    return int(gamma_max)


def check_gamma(gamma, gamma_max: int):
    """γ: 'auto' or an integer in 0..gamma_max."""
    if not (gamma == "auto" or (_is_int(gamma) and 0 <= gamma <= gamma_max)):
        raise ValueError(f"gamma must be 'auto' or an integer in [0, {gamma_max}] (gamma_max {gamma_max}: raise it "
                         f"with gamma_max= / --gamma-max, up to {GAMMA_MAX_LIMIT}), got {gamma!r}")
    return gamma if gamma == "auto" else int(gamma)


def check_lookup_gamma(lookup_gamma, lookup: int) -> int:
    """lookup_gamma: the most proposals a round drafted by prompt lookup makes (0: the round's γ). It is not
    bounded by gamma_max (the model's longest draft): lookup proposals cost no draft call."""
    if not (_is_int(lookup_gamma) and 0 <= lookup_gamma <= LOOKUP_GAMMA_LIMIT):
        raise ValueError(f"lookup_gamma must be an int in 0..{LOOKUP_GAMMA_LIMIT}: the most proposals a round "
                         f"drafted by lookup makes (0: γ); got {lookup_gamma!r}")
    if lookup_gamma and not lookup:
        raise ValueError(f"lookup_gamma={lookup_gamma} goes with lookup= (prompt lookup before the draft model)")
    return int(lookup_gamma)


@dataclass(frozen=True)
class SpeculationConfig:
    """kind "text": γ is 'auto' or 0..gamma_max (<= GAMMA_MAX_LIMIT). kind "policy": γ is 1..POLICY_GAMMA_LIMIT
    or None, and stop_below None: the draft kind's default (policy.DRAFT_DEFAULTS, `resolved`)."""
    gamma: int | str | None = "auto"  # the most draft tokens per round; "auto" (text): chosen per round
    gamma_max: int = DEFAULT_GAMMA_MAX  # the longest draft auto may choose and a fixed γ may ask for
    lookup: int = 0  # with a draft model: prompt lookup of the last lookup..max_ngram tokens first (0: off)
    lookup_gamma: int = 0  # the most proposals a lookup round makes (0: γ)
    max_ngram: int = NGRAM_MAX  # the longest n-gram the n-gram draft and lookup look up
    stop_below: float | None = 0.0  # dynamic draft length: stop after a proposal the draft gives p < this (0: never)
    acceptance: str = "greedy"  # "greedy" (exact) | "relaxed" (policies, lossy within `radius` bins)
    radius: int = 5  # relaxed: bins a draft action token may differ from the target's choice
    kind: str = "text"  # what decodes: "text" | "policy" (sets γ's bounds)
    last_chunk: bool = False  # policies: the ids of the chunk before are proposed first (last_chunk.py)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        check_gamma_max(self.gamma_max)
        if self.kind == "text":
            check_gamma(self.gamma, self.gamma_max)
        elif self.gamma is not None and not (_is_int(self.gamma) and 1 <= self.gamma <= POLICY_GAMMA_LIMIT):
            raise ValueError(f"gamma must be an integer in [1, {POLICY_GAMMA_LIMIT}], got {self.gamma!r}")
        if not (_is_int(self.max_ngram) and self.max_ngram >= 1):
            raise ValueError(f"max_ngram must be an integer >= 1 (need 1 <= min_ngram <= max_ngram, got 1, "
                             f"{self.max_ngram!r})")
        if not (_is_int(self.lookup) and 0 <= self.lookup <= self.max_ngram):
            raise ValueError(f"lookup must be an int in 0..max_ngram ({self.max_ngram}): the shortest n-gram whose "
                             f"earlier continuation is proposed before the draft model runs (0: off); got "
                             f"{self.lookup!r}")
        check_lookup_gamma(self.lookup_gamma, self.lookup)
        if (self.stop_below is not None or self.kind == "text") and not (
                isinstance(self.stop_below, (int, float)) and not isinstance(self.stop_below, bool)
                and 0.0 <= self.stop_below < 1.0):
            raise ValueError(f"stop_below must be a probability in [0, 1), got {self.stop_below!r}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance mode must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if not _is_int(self.radius) or self.radius < 0:
            raise ValueError(f"radius must be an integer >= 0 (bins), got {self.radius!r}")
        if not isinstance(self.last_chunk, bool):
            raise ValueError(f"last_chunk must be True or False, got {self.last_chunk!r}")
        if self.last_chunk and self.kind != "policy":
            raise ValueError("last_chunk drafts a policy's action chunk from the one before it; kind "
                             f"{self.kind!r} decodes no chunks (use kind='policy')")

    def resolved(self, gamma: int, stop_below: float) -> "SpeculationConfig":
        """This config with γ and stop_below filled in where they are None (a policy's draft-kind defaults)."""
        return dataclasses.replace(self, gamma=gamma if self.gamma is None else self.gamma,
                                   stop_below=stop_below if self.stop_below is None else self.stop_below)


# a policy's (gamma, stop_below) when not given, per draft kind: picked by bench/bench_vla.py's sweeps here
# (bench/results/vla.json "settings"). The head is cheap, so it drafts long runs and stops when unsure. A FAST
# policy's feature head ("fast-head") drafts short runs without a stop: a FAST chunk is a few ids, and its sweep at
# real size (bench_fast_policy.py; bench/results/NOTES.md, fast-policy-1b.json) was fastest at γ 4.
DRAFT_DEFAULTS = {"head": (15, 0.7), "fast-head": (4, 0.0), "decoder": (8, 0.5), None: (8, 0.0)}


def PolicyConfig(mode: str = "greedy", radius: int = 5, gamma: int | None = None,
                 stop_below: float | None = None, last_chunk: bool = False) -> SpeculationConfig:
    """A policy's SpeculationConfig: acceptance `mode` ("greedy" | "relaxed") and its radius in bins, the most
    draft tokens per round and the dynamic-stop threshold (None: the draft kind's default, DRAFT_DEFAULTS), and
    whether the ids of the chunk before are proposed first (last_chunk.py)."""
    return SpeculationConfig(gamma, stop_below=stop_below, acceptance=mode, radius=radius, kind="policy",
                             last_chunk=last_chunk)


def _gamma_arg(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma must be an integer or 'auto', got {v!r}") from None


def speculation_flags(p: argparse.ArgumentParser, kind: str = "text", lookup: int = 0, lookup_gamma: int = 0) -> None:
    """The flags that make a SpeculationConfig (`from_args`), for every CLI that speculates: text (--gamma,
    --gamma-max, --lookup, --lookup-gamma, with these lookup defaults, --stop-below) or a policy (--mode,
    --radius, --gamma, --stop-below)."""
    if kind == "policy":
        p.add_argument("--mode", choices=list(ACCEPTANCE), default="greedy")
        p.add_argument("--radius", type=int, default=5, help="relaxed: bins a draft token may be off")
        p.add_argument("--gamma", type=int, default=None, help="the most draft tokens per round (default: per "
                       "draft kind, edgespec.speculation.DRAFT_DEFAULTS)")
        p.add_argument("--stop-below", type=float, default=None,
                       help="dynamic draft length: stop a round's drafting after a proposal the draft gives a "
                            "probability below this (0 = always --gamma; default: per draft kind)")
        p.add_argument("--last-chunk", action="store_true",
                       help="propose the last chunk's action ids first: at the prefill when it repeated the one "
                            "before, else while the new chunk follows it (no model call; pays while the robot "
                            "holds a pose; exact under --mode greedy)")
        return
    p.add_argument("--gamma", type=_gamma_arg, default="auto", help="draft length, or 'auto' (device-measured)")
    p.add_argument("--gamma-max", type=int, default=DEFAULT_GAMMA_MAX,
                   help=f"longest draft (1..{GAMMA_MAX_LIMIT}) auto may choose or --gamma may ask for")
    p.add_argument("--lookup", type=int, default=lookup, metavar="N",
                   help="with a draft engine: propose from an earlier occurrence of the last N+ tokens before "
                        "running the draft model (prompt lookup; 0: off)")
    p.add_argument("--lookup-gamma", type=int, default=lookup_gamma, metavar="G",
                   help=f"with --lookup: the most proposals a round drafted by lookup makes (0..{LOOKUP_GAMMA_LIMIT}; "
                        f"0: γ). Lookup proposals cost no draft call, so they may run past the model's γ")
    p.add_argument("--stop-below", type=float, default=0.0, metavar="P",
                   help="with a draft engine or the text head: stop a round's drafting after a proposal the draft "
                        "gives a probability below P (0: always γ)")


def from_args(args: argparse.Namespace, kind: str = "text") -> SpeculationConfig:
    """The SpeculationConfig of speculation_flags' flags (checked: ValueError says what is wrong)."""
    if kind == "policy":
        return PolicyConfig(args.mode, args.radius, args.gamma, args.stop_below, args.last_chunk)
    return SpeculationConfig(args.gamma, args.gamma_max, args.lookup, args.lookup_gamma,
                             stop_below=getattr(args, "stop_below", 0.0))

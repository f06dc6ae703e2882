"""The decode loop: rounds until every sequence is finished, each round one call of a strategy chosen once.

    loop = Loop(target, drafter, LeanRounds(), pace, append, max_new_tokens, stats)
    for seqs in loop.run([Sequence(prompt, ctx)]): ...     # yields after every round

Strategies (each returns per sequence the emitted ids, the drafts kept and the drafts proposed, and commits
the kept rows in the target and the drafter):
    PlainSteps      one greedy sequence without a draft: the target's greedy_steps, calls back to back
    LeanRounds      one greedy sequence: speculative.fast_round (by ids, with an acceptance rule; a policy's
                    first round may read its prefix), or reference_round through the generic round
    PipelinedRounds one greedy sequence on a remote target: the next verify sent while this one is out
                    (pipeline.py)
    SampledRounds   any batch, any acceptance mode: speculative.speculative_round
`choose_rounds` picks one from what the target and the drafter declare (Capabilities, Drafter.decoder).
Text (generate.py) and action chunks (policy.py) both decode through `Loop.run`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .backends.base import Decoder
from .drafts import Drafter
from .profiling import Timer
from .speculative import Rule, fast_round, greedy_rule, reference_round, speculative_round
from .stats import RoundStats


@dataclass
class Sequence:
    prompt: list[int]  # a policy's: placeholder ids for its prefix rows
    ctx: list[int]  # prompt + emitted ids; the last is pending (not in the target's cache), unless the
    #                 target's cache is empty and the strategy reads a prefix
    finish: str | None = None  # "length" | "eos" | "stop" | "capacity"
    text_len: int | None = None  # where a stop string cut the text


Result = tuple[list[list[int]], "list[int] | np.ndarray", "list[int] | np.ndarray"]  # per sequence: emitted ids,
#                                                                                   drafts kept, drafts proposed


class LeanRounds:
    """fast_round for one greedy sequence (reference=True: the same through the generic round). prefix (1, P, E):
    the round that finds the target's cache empty reads it (a policy's chunk), with the acceptance `rule`."""

    def __init__(self, rule: Rule = greedy_rule, prefix: np.ndarray | None = None, reference: bool = False):
        self.rule, self.prefix, self.round = rule, prefix, reference_round if reference else fast_round

    def __call__(self, target: Decoder, drafter: Drafter | None, seqs: list[Sequence], active, gamma: int,
                 span: int, timer: Timer | None) -> Result:
        prefix = self.prefix if self.prefix is not None and not target.cache.lengths[0] else None
        sees = gamma or drafter is not None and drafter.sees_every_round  # γ 0: a drafter that reads every round
        new, k, c = self.round(target, drafter if sees else None, seqs[0].ctx, gamma, self.rule, prefix, timer,
                               span)  # span > gamma: a lookup round may propose more than gamma
        return [new], [k], [c]

    def close(self) -> None:
        pass


class PlainSteps:
    """One greedy sequence, no draft: the target's greedy_steps generator, one id per round. It is started at
    the first round for every call the sequence can still make (`steps`), and closed with the loop (its rows
    are committed then)."""

    def __init__(self, steps: Callable[[Sequence], int]):
        self.steps, self.calls = steps, None

    def __call__(self, target, drafter, seqs, active, gamma, span, timer) -> Result:
        s = seqs[0]
        if self.calls is None:
            n = self.steps(s)
            if n < 1:  # no room at all: the generic round says why
                return LeanRounds()(target, None, seqs, active, 0, 0, timer)
            self.calls = target.greedy_steps(s.ctx[-1], n)
        t0 = time.perf_counter()
        tok = next(self.calls)
        if timer is not None:
            timer.add("verify", t0, time.perf_counter())  # the call, as fast_round counts it
        return [[tok]], [0], [0]

    def close(self) -> None:
        if self.calls is not None:
            self.calls.close()


class SampledRounds:
    """speculative_round: any batch, greedy or sampled acceptance (mode, cfg, rng, noise, pick as it takes them)."""

    def __init__(self, mode: str, cfg, rng, noise, pick):
        self.args = (mode, cfg, rng, noise, pick)

    def __call__(self, target, drafter, seqs, active, gamma, span, timer) -> Result:
        new, k, n = speculative_round(target, drafter, [s.ctx for s in seqs], np.array(active), gamma, *self.args,
                                      timer or Timer(), span=span)
        return new, k, n

    def close(self) -> None:
        pass


def choose_rounds(target: Decoder, drafter: Drafter | None, batch: int, greedy: bool, lean: bool, steps,
                  sampled: Callable[[], SampledRounds]):
    """The strategy for a decode: plain steps, a pipelined remote round, the lean round, or the generic one."""
    if batch != 1 or not greedy or not lean:
        return sampled()
    if drafter is None and target.caps.steps:
        return PlainSteps(steps)
    if target.caps.pipeline and drafter is not None and drafter.decoder is not None:
        from .pipeline import PipelinedRounds
        return PipelinedRounds()
    return LeanRounds()


@dataclass
class Loop:
    """Rounds until every sequence is finished. gamma(context length, room, stats) -> the round's γ;
    append(sequence, ids) -> how many ids it kept (it sets `finish`). est: an AcceptanceEstimator that auto γ
    reads (updated when given); observe(asked, proposed, draft s, verify s, context, host s): auto γ's cost
    refinement (one sequence). A policy's chunk keeps its rows (release False): the next chunk starts from an
    empty cache anyway."""
    target: Decoder
    drafter: Drafter | None
    rounds: object  # LeanRounds | PlainSteps | SampledRounds | PipelinedRounds
    gamma: Callable[[int, int, RoundStats], int]
    append: Callable[[Sequence, list[int]], int]
    max_new_tokens: int
    stats: RoundStats
    timer: Timer | None = None
    est: object = None
    observe: Callable | None = None
    release: bool = True  # when done, rewind the target's cache and reset the drafter (text: rows unneeded)
    capacity: int = field(init=False)

    def __post_init__(self):
        self.capacity = self.target.max_context

    def room(self, seqs: list[Sequence], active: list[bool]) -> tuple[int, int]:
        """-> (the longest active context, the most drafts a round may propose): within the target's capacity,
        the tokens left (the round's own id is one of them) and the drafter's capacity. (Plain loops, no
        generators: this runs once per round, and a policy's round is a quarter of a millisecond.)"""
        longest, left = 0, self.max_new_tokens
        for s, a in zip(seqs, active):
            if a:
                n = len(s.ctx)
                longest = n if n > longest else longest
                k = self.max_new_tokens - (n - len(s.prompt))
                left = k if k < left else left
        room = min(self.capacity - longest, left - 1)
        if self.drafter is not None:
            room = min(room, self.drafter.room([s.ctx for s in seqs], active))
        return longest, room

    def run(self, seqs: list[Sequence]) -> Iterator[list[Sequence]]:
        """Rounds until every sequence is finished; yields after each round but the last. Then (release) the
        target's cache is rewound and the drafter reset (the caller's stats and result come after)."""
        target, drafter, stats, timer, b = self.target, self.drafter, self.stats, self.timer, len(seqs)
        rounds, pace, append, est, cap = self.rounds, self.gamma, self.append, self.est, self.capacity  # per round
        clock = timer is not None and self.observe is not None
        lane = timer is not None and timer.events is not None  # the profiler's per-round lane
        active = [s.finish is None for s in seqs]  # a list: numpy's per-call cost shows at batch 1
        try:
            while True in active:
                t0 = time.perf_counter() if clock or lane else 0.0
                longest, room = self.room(seqs, active)
                g = max(0, min(pace(longest, room, stats), room))
                span = max(g, min(drafter.span(g), room)) if drafter is not None else g
                stats.gamma_history.append((stats.new_tokens, g))
                if clock:
                    t_draft0, t_verify0 = timer.t["draft"], timer.t["verify"]
                new, k, n = rounds(target, drafter, seqs, active, g, span, timer)
                if lane:
                    timer.events.append(("round", t0, time.perf_counter()))
                stats.rounds += 1
                if not g:
                    stats.plain_rounds += 1
                for i, s in enumerate(seqs):
                    if not active[i]:
                        continue
                    ki, ni = int(k[i]), int(n[i])
                    stats.add_round(ki, ni)
                    if est is not None:
                        est.update(ki, ni, max(g, ni))  # a lookup round may propose more than g
                    stats.new_tokens += append(s, new[i])
                    if s.finish is None and len(s.ctx) > cap:
                        s.finish = "capacity"
                    if s.finish is not None:
                        active[i] = False
                        if b > 1:  # its rows are not needed; the others decode on
                            target.cache.rewind_to(np.where(np.arange(b) == i, 0, target.cache.lengths))
                            if drafter is not None:
                                drafter.reset(i)
                if clock:
                    draft_s, verify_s = timer.t["draft"] - t_draft0, timer.t["verify"] - t_verify0
                    host_s = time.perf_counter() - t0 - draft_s - verify_s
                    c = int(max(n))
                    if b == 1:  # batches: not measured
                        unpriced = drafter is not None and drafter.last_draft_unpriced
                        self.observe(max(g, c), c, 0.0 if unpriced else draft_s, verify_s, longest, host_s)
                if True in active:
                    yield seqs
        finally:
            self.rounds.close()
        if self.release:
            target.cache.rewind_to(0)
            if drafter is not None:
                for i in range(b):
                    drafter.reset(i)

"""The speculative round, and the acceptance rules beside it.

Terms (docs/architecture.md): the target verifies; the draft proposes γ tokens; a round = one draft run + one target
verify pass; accepted = draft tokens kept; correction = drawn from the residual at the first rejection;
bonus = drawn from the target's last position when all γ are accepted. A round emits 1..γ+1 tokens.
A round with γ = 0 is a plain decoding step. tokens per round = emitted tokens / target calls (the prefill
counts: it emits the first token), so plain decoding is exactly 1.

Two implementations of one round:
    fast_round          one sequence, argmax ids only (text greedy at batch 1, every action chunk);
    speculative_round   any batch, any acceptance mode, distributions (sampled text, batches), and the
                        reference `reference_round` runs fast_round's arguments through it (tests compare).
By-ids acceptance is a Rule: rule(drafts (c,), target ids (c+1,), position of drafts[0]) -> (kept, next id);
`greedy_rule` is exact, `RelaxedRule` is the opt-in lossy rule for action tokens.
A round may start a sequence (`prefix`, inputs_embeds engines): with an empty target cache, the verify
call reads prefix + drafts, so the prefill and the first round are one target call (a draft that proposes
from the prefix alone: the action draft head).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .backends.base import Decoder
from .drafts import Drafter, Proposal, greedy_pick
from .profiling import Timer
from .sampling import GumbelNoise, SamplingConfig, check_finite, check_ids, probs, sample

Rule = Callable[[np.ndarray, np.ndarray, int], "tuple[int, int]"]  # by-ids acceptance, see the module docstring


def accept_greedy(drafts: np.ndarray, t: np.ndarray) -> tuple[int, int]:
    """drafts (n,); t (n+1,) the target's argmax ids. Keep drafts while they equal the target's argmax."""
    k = 0
    while k < len(drafts) and drafts[k] == t[k]:
        k += 1
    return k, int(t[k])


def accept_rejection(drafts: np.ndarray, p: np.ndarray, q: np.ndarray | None, rng: np.random.Generator) -> tuple[int, int]:
    """drafts (n,); p (n+1, V) target probs; q (n, V) draft probs (None = point mass on each draft)."""
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else q[i, x]
        if rng.random() * qx < p[i, x]:  # q <= p: always accept; q > p: accept with prob p/q
            continue
        resid = p[i].copy()  # rejected: draw from norm(max(0, p - q))
        if q is None:
            resid[x] = 0.0
        else:
            resid = np.maximum(resid - q[i], 0.0)
        if resid.sum() <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
            resid = p[i]
        return i, sample(resid, rng)
    return len(drafts), sample(p[len(drafts)], rng)  # all accepted: bonus token from p


def accept_relaxed(drafts: np.ndarray, t: np.ndarray, lo: int, hi: int, radius: np.ndarray) -> tuple[int, int]:
    """Action tokens (lossy, opt-in). drafts (n,); t (n+1,) the target's choices, its argmax over the action
    ids lo..hi-1; radius (n,) bins allowed per draft position (0 = exact, e.g. a binary dimension). Ids are
    bins, so |id difference| = bin distance: keep a draft while it is an action id within radius[i] of the
    target's choice. With radius 0 everywhere this is exact greedy decoding constrained to actions."""
    k = 0
    while k < len(drafts) and lo <= drafts[k] < hi and abs(int(drafts[k]) - int(t[k])) <= radius[k]:
        k += 1
    return k, int(t[k])


def accept_coupled(drafts: np.ndarray, logits: np.ndarray, cfg: SamplingConfig, noise: GumbelNoise,
                   b: int, pos0: int) -> tuple[int, int]:
    """The target draws position pos0+i with the same Gumbel noise the draft used; keep while equal."""
    for i, x in enumerate(drafts):
        t = noise.pick(logits[i], cfg, b, pos0 + i)
        if t != x:
            return i, t
    return len(drafts), noise.pick(logits[len(drafts)], cfg, b, pos0 + len(drafts))


def greedy_rule(drafts: np.ndarray, t: np.ndarray, pos: int) -> tuple[int, int]:
    """Exact greedy acceptance as a Rule."""
    return accept_greedy(drafts, t)


class RelaxedRule:
    """accept_relaxed as a Rule for one chunk of action ids: the draft at sequence position `pos` is chunk
    index pos - offset and may be radius[index] bins off. Records the largest bin distance it accepted
    (max_dev_bins): make one per chunk."""

    def __init__(self, lo: int, hi: int, radius: np.ndarray, offset: int):
        self.lo, self.hi, self.radius, self.offset = lo, hi, radius, offset  # radius (H*D,) bins
        self.max_dev_bins = 0

    def __call__(self, drafts: np.ndarray, t: np.ndarray, pos: int) -> tuple[int, int]:
        r = self.radius[pos - self.offset:pos - self.offset + len(drafts)]
        k, nxt = accept_relaxed(drafts, t, self.lo, self.hi, r)
        if k and r[:k].any():
            self.max_dev_bins = max(self.max_dev_bins, int(np.abs(drafts[:k] - t[:k]).max()))
        return k, nxt


def fast_round(target: Decoder, drafter: Drafter | None, ctx: list[int], gamma: int, rule: Rule = greedy_rule,
               prefix: np.ndarray | None = None, timer: Timer | None = None,
               span: int | None = None) -> tuple[list[int], int, int]:
    """One round for one sequence, by ids, with no per-round objects. ctx: the sequence so far; its last id
    is pending (not in the target's cache), or, with `prefix` (1, P, E) and an empty target cache, ctx is P
    placeholder ids for the prefix rows. span (>= gamma, default gamma): the most proposals the round may
    verify (drafter.span(gamma) within the caller's room). Commits the kept rows in the target (and the
    drafter) and returns (emitted ids, kept drafts k, drafted c); the caller appends the emitted ids to ctx."""
    t0 = time.perf_counter()
    span = gamma if span is None else span
    if span < gamma:
        raise ValueError(f"span (the most proposals a round verifies) must be >= gamma {gamma}, got {span}")
    feed = np.empty((1, span + 1), np.int64)  # pending id, then the drafts
    sees = gamma or drafter is not None and drafter.sees_every_round  # γ 0: only a drafter that reads every round
    c = drafter.draft(ctx, gamma, feed[0, 1:]) if sees else 0
    drafts = feed[0, 1:c + 1]
    t1 = time.perf_counter()
    if prefix is None:  # [pending, d_1..d_c] at rows committed..committed+c
        feed[0, 0] = ctx[-1]
        t = target.ids(feed[:, :c + 1])[0]  # (c+1,): [i] predicts position len(ctx) + i
        rows = 1
    else:  # prefix rows 0..P-1, then the drafts: row P-1 predicts the first id
        x = np.concatenate([prefix, target.embedding[drafts][None]], 1) if c else prefix
        t = target.ids(None, embeds=x, last=c + 1)[0, -(c + 1):]
        rows = prefix.shape[1]
    t2 = time.perf_counter()
    check_ids(t, "target", len(ctx))
    k, nxt = rule(drafts, t, len(ctx))
    target.cache.commit(rows + k)
    if drafter is not None:
        drafter.commit(k)
    new = drafts[:k].tolist() + [nxt]
    if timer is not None:
        timer.add("draft", t0, t1)
        timer.add("verify", t1, t2)
        timer.add("sampling", t2, time.perf_counter())
    return new, k, c


def reference_round(target: Decoder, drafter: Drafter | None, ctx: list[int], gamma: int, rule: Rule = greedy_rule,
                    prefix: np.ndarray | None = None, timer: Timer | None = None,
                    span: int | None = None) -> tuple[list[int], int, int]:
    """fast_round's arguments through the generic speculative_round (slow, obvious): tests compare the two."""
    new, k, c = speculative_round(target, drafter, [ctx], np.ones(1, bool), gamma, "greedy", SamplingConfig(),
                                  None, None, greedy_pick, timer or Timer(), rule=rule, prefix=prefix, span=span)
    return new[0], int(k[0]), int(c[0])


def speculative_round(target: Decoder, drafter: Drafter | None, contexts: list[list[int]], active: np.ndarray,
                      gamma: int, mode: str, cfg: SamplingConfig, rng, noise, pick, timer: Timer,
                      rule: Rule | None = None, prefix: np.ndarray | None = None,
                      span: int | None = None) -> tuple[list, np.ndarray, np.ndarray]:
    """One round for every active sequence. Returns (new tokens per sequence, accepted (B,), drafted (B,)).
    span (> gamma): the most proposals per sequence the round may verify, for a drafter whose span(gamma)
    exceeds gamma (LookupDraft); None: gamma.
    mode "greedy" brings back only the target's argmax ids and accepts with `rule` (greedy_rule when None);
    "rejection" and "coupled" bring back its logits. `prefix` (1, P, E): the round starts the sequence (B = 1,
    by ids, empty target cache, contexts[0] = P placeholder ids), its verify call reads prefix + drafts."""
    b = len(contexts)
    committed = target.cache.lengths.copy()  # (B,) target rows; contexts[b][-1] is the pending token
    by_ids = mode == "greedy"
    if prefix is not None and (b != 1 or not by_ids or committed[0]):
        raise ValueError("a round that starts a sequence from its prefix runs one sequence, by ids, on an "
                         "empty cache")
    rule = rule or greedy_rule
    # 1) draft: up to γ proposals per sequence, for positions len(contexts[b]) ...
    with timer("draft"):
        wide = {"span": span} if gamma and span is not None and span > gamma else {}  # LookupDraft's keyword
        sees = gamma or drafter is not None and drafter.sees_every_round  # γ 0: a drafter that reads every round
        prop: Proposal = drafter.propose(contexts, gamma, pick, active, **wide) if sees else \
            Proposal(np.zeros((b, 0), np.int64), np.zeros(b, np.int64))
    n = np.where(active, prop.counts, 0)  # (B,)
    s = int(n.max()) + 1
    # 2) verify: pending token (or the prefix) + drafts in one target call
    feed = np.empty((b, s), dtype=np.int64)
    feed[:, 0] = [c[-1] for c in contexts]
    feed[:, 1:] = prop.tokens[:, :s - 1]
    valid = np.arange(s)[None, :] <= n[:, None] if (n != s - 1).any() else None
    rows = 1
    with timer("verify"):  # [b, i] predicts position len(contexts[b]) + i
        if prefix is not None:
            x = np.concatenate([prefix, target.embedding[feed[:, 1:]]], 1)
            verified = target.ids(None, embeds=x, last=s)[:, -s:]  # (1, s)
            rows = prefix.shape[1]
        else:
            verified = target.ids(feed, valid) if by_ids else target(feed, valid)  # ids (B, s) | logits (B, s, V)
    # 3) accept / reject, then the correction or bonus token
    with timer("sampling"):
        check = check_ids if by_ids else check_finite
        check(verified if active.all() else verified[active], "target", int(committed.max()) + rows)
        found, k = [], np.zeros(b, dtype=np.int64)
        for i in range(b):
            if not active[i]:
                found.append([])
                continue
            d, t = prop.tokens[i, :n[i]], verified[i, :n[i] + 1]  # t: ids (n+1,) or logits (n+1, V)
            if mode == "greedy":
                k[i], nxt = rule(d, t, len(contexts[i]))
            elif mode == "rejection":
                q = None if prop.q is None else prop.q[i, :n[i]]
                k[i], nxt = accept_rejection(d, probs(t, cfg), q, rng)
            else:
                k[i], nxt = accept_coupled(d, t, cfg, noise, i, int(committed[i]) + 1)
            found.append([int(t) for t in d[:k[i]]] + [nxt])
    # 4) commit: the target keeps the pending token (or the prefix) and k drafts; the draft rolls back
    target.cache.commit(np.where(active, k + rows, 0))
    if drafter is not None:
        drafter.commit(k)
    return found, k, n

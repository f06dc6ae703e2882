"""The speculative round, and the acceptance rules beside it.

Terms (DESIGN.md): the target verifies; the draft proposes γ tokens; a round = one draft run + one target
verify pass; accepted = draft tokens kept; correction = drawn from the residual at the first rejection;
bonus = drawn from the target's last position when all γ are accepted. A round emits 1..γ+1 tokens.
"""
from __future__ import annotations

import numpy as np

from .decoder import Decoder
from .drafts import Drafter, Proposal
from .sampling import GumbelNoise, SamplingConfig, check_finite, check_ids, probs, sample


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


def speculative_round(target: Decoder, drafter: Drafter | None, contexts: list[list[int]], active: np.ndarray,
                      gamma: int, mode: str, cfg: SamplingConfig, rng, noise, pick, timer,
                      relax=None) -> tuple[list, np.ndarray]:
    """One round for every active sequence. Returns (new tokens per sequence, accepted (B,), drafted (B,)).
    Greedy and relaxed rounds bring back only the target's argmax ids; sampled ones its logits.
    mode "relaxed" (action tokens) calls relax(drafts (n,), target ids (n+1,), first draft position) -> (k, next)."""
    b = len(contexts)
    committed = target.cache.lengths.copy()  # (B,) target rows; contexts[b][-1] is the pending token
    # 1) draft: up to γ proposals per sequence, for positions committed+1 ...
    with timer("draft"):
        prop: Proposal = drafter.propose(contexts, gamma, pick, active) if gamma else \
            Proposal(np.zeros((b, 0), np.int64), np.zeros(b, np.int64))
    n = np.where(active, prop.counts, 0)  # (B,)
    s = int(n.max()) + 1
    # 2) verify: pending token + drafts in one target call, rows committed .. committed+s-1
    feed = np.empty((b, s), dtype=np.int64)
    feed[:, 0] = [c[-1] for c in contexts]
    feed[:, 1:] = prop.tokens[:, :s - 1]
    valid = np.arange(s)[None, :] <= n[:, None] if (n != s - 1).any() else None
    by_ids = mode in ("greedy", "relaxed")
    with timer("verify"):  # [b, i] predicts position committed[b] + i + 1
        verified = target.ids(feed, valid) if by_ids else target(feed, valid)  # ids (B, s) | logits (B, s, V)
    # 3) accept / reject, then the correction or bonus token
    with timer("sampling"):
        check = check_ids if by_ids else check_finite
        check(verified if active.all() else verified[active], "target", int(committed.max()))
        found, k = [], np.zeros(b, dtype=np.int64)
        for i in range(b):
            if not active[i]:
                found.append([])
                continue
            d, t = prop.tokens[i, :n[i]], verified[i, :n[i] + 1]  # t: ids (n+1,) or logits (n+1, V)
            if mode == "greedy":
                k[i], nxt = accept_greedy(d, t)
            elif mode == "rejection":
                q = None if prop.q is None else prop.q[i, :n[i]]
                k[i], nxt = accept_rejection(d, probs(t, cfg), q, rng)
            elif mode == "relaxed":
                k[i], nxt = relax(d, t, int(committed[i]) + 1)
            else:
                k[i], nxt = accept_coupled(d, t, cfg, noise, i, int(committed[i]) + 1)
            found.append([int(t) for t in d[:k[i]]] + [nxt])
    # 4) commit: the target keeps the pending token and k drafts; the draft rolls back what was rejected
    target.cache.commit(np.where(active, k + 1, 0))
    if drafter is not None:
        drafter.commit(k)
    return found, k, n

"""Device-measured cost model for choosing the draft length γ (Leviathan et al. 2023, section 3.4).

A round that asks the drafter for γ tokens gets c <= γ proposals (an n-gram lookup often finds fewer), so
it costs what really ran, at the current context length L:

    time(γ, L) = t_round + t_draft_round + E_c[ c·t_draft(L) + t_verify(c+1, L) ]      (γ >= 1)
    time(0, L) = t_round + t_verify(1, L)                                                  (plain decoding)
    E[tokens | γ] = 1 + sum_{j<γ} prod_{i<=j} f_i a_i      (i.i.d.: (1 - α^(γ+1)) / (1 - α) when f = 1)

t_verify(S, L): one target call with S tokens, measured at a few context buckets and interpolated in L;
t_draft(L): one draft proposal (a draft model call); t_draft_round: what a draft run costs per round
whatever it proposes (an n-gram lookup); t_round: the host's part of a round (acceptance, bookkeeping).
a_i: acceptance at draft position i, f_i: how often the drafter proposes position i when asked
(AcceptanceEstimator). The γ with the most expected tokens per second wins; γ = 0 is plain decoding.

`measure` times those terms on this device at load, with probes of its own (target calls, draft runs, and
rounds of speculative.fast_round with a free draft); the decode loop then refines them from the rounds it runs
(`CostModel.observe`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from .drafts import Drafter, Proposal
from .profiling import Timer
from .speculative import fast_round

CONTEXT_BUCKETS = (64, 256, 1024)  # contexts where load-time costs are measured (capped at the engine's)
MEASURE_BUDGET_S = 2.0  # load-time cost measurement: repeat passes until this much time is spent ...
MEASURE_REPS = (3, 40)  # ... but at least / at most this many passes (each timing every call once)
OUTLIER_RATIO = 3.0  # an observed time above this many times the estimate counts as this many (a
#                      descheduled round or a GC pause must not move the model much)


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _positive(name: str, x, allow_zero: bool) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    ok = np.isfinite(a).all() and ((a >= 0).all() if allow_zero else (a > 0).all())
    if not ok or a.size == 0:
        want = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be {want} finite seconds, got {np.asarray(x).tolist()}")
    return a


class CostModel:
    """Seconds of each part of a round on this device (see the module docstring).

    t_verify: (K, γmax+1) or (γmax+1,) for one context: t_verify[k][s-1] = a target call of s tokens at
    contexts[k]. t_draft: seconds per proposal, one for all contexts or (K,). contexts: (K,) ascending.
    """

    def __init__(self, t_verify, t_draft, t_round: float = 0.0, contexts=(CONTEXT_BUCKETS[0],),
                 t_draft_round: float = 0.0):
        v = _positive("t_verify", t_verify, allow_zero=False)
        v = v[None] if v.ndim == 1 else v
        self.contexts = np.asarray(contexts, dtype=np.int64).reshape(-1)  # (K,)
        k = len(self.contexts)
        if v.ndim != 2 or v.shape[0] != k:
            raise ValueError(f"t_verify must be one row of timings per context ({k} contexts "
                             f"{self.contexts.tolist()}), got shape {v.shape}")
        if k == 0 or (self.contexts < 1).any() or (np.diff(self.contexts) <= 0).any():
            raise ValueError(f"contexts must be ascending positive lengths, got {self.contexts.tolist()}")
        d = _positive("t_draft", t_draft, allow_zero=True)
        if d.ndim > 1 or d.size not in (1, k):
            raise ValueError(f"t_draft must be one number or one per context ({k}), got {d.tolist()}")
        self.verify = v.copy()  # (K, γmax+1)
        self.draft = np.broadcast_to(d, (k,)).copy()  # (K,) seconds per proposal
        self.t_round = float(_positive("t_round", t_round, allow_zero=True))
        self.t_draft_round = float(_positive("t_draft_round", t_draft_round, allow_zero=True))

    @property
    def gamma_max(self) -> int:
        return self.verify.shape[1] - 1

    @property
    def t_verify(self) -> list[float]:
        """Verify costs for S = 1..γmax+1 at the shortest context (reports)."""
        return self.verify[0].tolist()

    @property
    def t_draft(self) -> float:
        """Seconds per proposal at the shortest context (reports)."""
        return float(self.draft[0])

    # -- interpolation in the context length --------------------------------------------------------
    def _bracket(self, context: int | None) -> tuple[int, int, float]:
        """-> (k0, k1, u): context lies u of the way from contexts[k0] to contexts[k1] (u > 1 past the last)."""
        c = self.contexts
        if context is None or len(c) == 1 or context <= c[0]:
            return 0, 0, 0.0
        k1 = min(int(np.searchsorted(c, context)), len(c) - 1)
        k0 = k1 - 1
        return k0, k1, (context - c[k0]) / (c[k1] - c[k0])

    def _at(self, row: np.ndarray, context: int | None) -> np.ndarray | float:
        """row (K, ...) interpolated linearly in the context; past the last bucket extrapolated along the
        last two, never below the last."""
        k0, k1, u = self._bracket(context)
        x = (1 - u) * row[k0] + u * row[k1]
        return np.maximum(x, row[k1]) if u > 1 else x

    def verify_s(self, s: int, context: int | None = None) -> float:
        return float(self._at(self.verify[:, s - 1], context))

    def draft_s(self, context: int | None = None) -> float:
        return float(self._at(self.draft, context))

    # -- prediction -----------------------------------------------------------------------------------
    def round_times(self, top: int, context: int | None = None, reach: np.ndarray | None = None) -> np.ndarray:
        """(top+1,) expected seconds of a round that asks for γ = 0..top drafts. reach (top+1,): P(c >= j) the
        drafter proposes at least j (default 1: it proposes all it is asked for)."""
        k0, k1, u = self._bracket(context)
        verify = (1 - u) * self.verify[k0, :top + 1] + u * self.verify[k1, :top + 1]  # (top+1,) S = 1..top+1
        if u > 1:
            verify = np.maximum(verify, self.verify[k1, :top + 1])
        ran = np.arange(top + 1) * self.draft_s(context) + verify  # (top+1,) a round with c = j proposals
        if reach is None:
            out = ran.copy()
        else:  # asking γ: c = j < γ with P(c = j) = reach[j] - reach[j+1], c = γ with P(c >= γ)
            before = np.concatenate([[0.0], np.cumsum((reach[:-1] - reach[1:]) * ran[:-1])])
            out = before + reach * ran
        out[1:] += self.t_draft_round
        return out + self.t_round

    def rates(self, alpha: float, top: int, context: int | None = None, tokens: np.ndarray | None = None,
              reach: np.ndarray | None = None) -> np.ndarray:
        """(top+1,) expected tokens per second asking for γ = 0..top: tokens (top+1,) = E[tokens | γ] (default
        the paper's i.i.d. formula at α), reach as in round_times."""
        if tokens is None:
            tokens = np.array([expected_tokens(alpha, g) for g in range(top + 1)])
        return tokens / self.round_times(top, context, reach)

    def round_s(self, gamma: int, context: int | None = None, counts: np.ndarray | None = None) -> float:
        """Expected seconds of a round asking for γ; counts (γ+1,) = P(c proposals), default c = γ."""
        reach = None if counts is None else np.cumsum(np.asarray(counts)[::-1])[::-1]
        return float(self.round_times(gamma, context, reach)[gamma])

    def rate(self, alpha: float, gamma: int, tokens: float | None = None, context: int | None = None,
             counts: np.ndarray | None = None) -> float:
        """Expected tokens per second with γ drafts: the paper's E[tokens] at acceptance α, or `tokens`
        (expected tokens per round from measured position-wise acceptance) when given."""
        e = expected_tokens(alpha, gamma) if tokens is None or gamma == 0 else tokens
        return e / self.round_s(gamma, context, counts)

    def predicted_speedup(self, alpha: float, gamma: int, context: int | None = None) -> float:
        return self.rate(alpha, gamma, context=context) / self.rate(alpha, 0, context=context)

    def best_gamma(self, alpha: float, limit: int | None = None, context: int | None = None,
                   estimator: "AcceptanceEstimator | None" = None) -> int:
        """argmax over γ in 0..limit of expected tokens/s at this context (the shortest γ among equals);
        with an `estimator`, its position-wise acceptance and fill replace the i.i.d. formula."""
        top = self.gamma_max if limit is None else max(0, min(limit, self.gamma_max))
        tokens, reach = estimator.curves(top) if estimator is not None else (None, None)
        return int(np.argmax(self.rates(alpha, top, context, tokens, reach)))

    # -- learning from rounds ---------------------------------------------------------------------------
    @staticmethod
    def _blend(est: float, obs: float, weight: float) -> float:
        obs = min(obs, OUTLIER_RATIO * est) if est > 0 else obs
        return est + weight * (obs - est)

    def observe(self, asked: int, proposed: int, draft_s: float, verify_s: float, context: int | None = None,
                host_s: float | None = None, weight: float = 0.1) -> None:
        """Blend in one round's measured costs, credited to what ran: the verify call had S = proposed + 1
        tokens (not asked + 1), the draft made `proposed` proposals (a draft step costs more in the loop than
        in isolation: the target's weights evict the draft's from the cache)."""
        if not 0 <= proposed <= asked:
            raise ValueError(f"a round proposes 0..asked drafts: asked {asked}, proposed {proposed}")
        k0, k1, u = self._bracket(context)
        u = min(u, 1.0)
        if verify_s > 0 and proposed <= self.gamma_max:
            s = proposed
            pred = (1 - u) * self.verify[k0, s] + u * self.verify[k1, s]
            err = self._blend(pred, verify_s, weight) - pred  # move both neighbouring buckets toward it
            self.verify[k0, s] += (1 - u) * err if k0 != k1 else err
            if k0 != k1:
                self.verify[k1, s] += u * err
        if asked > 0 and draft_s > 0:
            if proposed == 0:  # the draft ran and found nothing: its per-round cost
                self.t_draft_round = self._blend(self.t_draft_round, draft_s, weight)
            else:
                per = max(0.0, draft_s - self.t_draft_round) / proposed
                pred = (1 - u) * self.draft[k0] + u * self.draft[k1]
                err = self._blend(pred, per, weight) - pred
                self.draft[k0] += (1 - u) * err if k0 != k1 else err
                if k0 != k1:
                    self.draft[k1] += u * err
                self.draft = np.maximum(self.draft, 0.0)
        if host_s is not None and host_s > 0:
            self.t_round = self._blend(self.t_round, host_s, weight)

    def to_dict(self) -> dict:
        ms = lambda a: np.round(np.asarray(a) * 1e3, 4).tolist()  # noqa: E731
        return {"t_verify_ms": ms(self.verify[0]), "t_draft_ms": round(self.t_draft * 1e3, 4),
                "t_round_ms": round(self.t_round * 1e3, 4), "t_draft_round_ms": round(self.t_draft_round * 1e3, 4),
                "contexts": self.contexts.tolist(), "t_verify_ms_by_context": ms(self.verify),
                "t_draft_ms_by_context": ms(self.draft)}


@dataclass
class AcceptanceEstimator:
    """Running estimate of α from rounds: each accepted draft is a success, a round that stopped at a
    rejection is one failure (drafts after it were never tried). Old rounds decay away. It also tracks how
    often the drafter fills position i when asked for it (an n-gram lookup often proposes fewer than γ).
    Per-position arrays grow with the longest draft seen (`positions` presizes them)."""
    prior_accept: float = 3.0
    prior_reject: float = 1.0
    decay: float = 0.97
    accepted: float = 0.0
    rejected: float = 0.0
    positions: int = 0
    tried_at: np.ndarray = field(default_factory=lambda: np.zeros(0))  # decayed drafts tried at position i
    kept_at: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... and kept
    asked_at: np.ndarray = field(default_factory=lambda: np.zeros(0))  # decayed rounds asking for i, having i-1
    filled_at: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... that got a proposal there

    def __post_init__(self):
        self._grow(self.positions)

    def _grow(self, n: int) -> None:
        if n > len(self.tried_at):
            pad = lambda a: np.concatenate([a, np.zeros(n - len(a))])  # noqa: E731
            self.tried_at, self.kept_at = pad(self.tried_at), pad(self.kept_at)
            self.asked_at, self.filled_at = pad(self.asked_at), pad(self.filled_at)

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_accept) / (self.accepted + self.rejected + self.prior_accept + self.prior_reject)

    def update(self, accepted: int, drafted: int, asked: int | None = None) -> None:
        """One round: `asked` drafts were asked for (default: `drafted`), `drafted` proposed, `accepted` kept."""
        asked = drafted if asked is None else asked
        if not 0 <= accepted <= drafted <= asked:
            raise ValueError(f"need 0 <= accepted <= drafted <= asked, got {accepted}, {drafted}, {asked}")
        self._grow(asked)
        i, d = np.arange(len(self.asked_at)), self.decay
        offered = (i < asked) & (i <= drafted)  # position i is asked for when 0..i-1 were proposed
        self.asked_at = self.asked_at * d + offered
        self.filled_at = self.filled_at * d + (offered & (i < drafted))
        if drafted == 0:
            return
        self.accepted = self.accepted * d + accepted
        self.rejected = self.rejected * d + (1 if accepted < drafted else 0)
        tried = (i < drafted) & (i <= accepted)  # position i is tried only when 0..i-1 were all kept
        self.tried_at = self.tried_at * d + tried
        self.kept_at = self.kept_at * d + (tried & (i < accepted))

    def _at(self, a: np.ndarray, n: int) -> np.ndarray:
        return a[:n] if len(a) >= n else np.concatenate([a, np.zeros(n - len(a))])

    def curves(self, top: int, prior: float = 2.0, fill_prior: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens, reach), each (top+1,) for γ = 0..top: tokens[γ] = E[tokens per round | γ] =
        1 + sum_{j<γ} prod_{i<=j} f_i a_i, reach[j] = P(the drafter proposes at least j) = prod_{i<j} f_i.
        a_i: acceptance at position i, shrunk toward the pooled α where a position has few observations;
        f_i: P(proposes position i | asked for it, proposed i-1), shrunk toward 1. Acceptance is not i.i.d.
        (easy stretches accept everything, hard ones reject at once), so this can differ from the paper's
        formula either way."""
        a = (self._at(self.kept_at, top) + prior * self.alpha) / (self._at(self.tried_at, top) + prior)
        f = (self._at(self.filled_at, top) + fill_prior) / (self._at(self.asked_at, top) + fill_prior)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(f * a))])
        reach = np.concatenate([[1.0], np.cumprod(f)])
        return tokens, reach

    def expected_tokens(self, gamma: int) -> float:
        return float(self.curves(gamma)[0][gamma])

    def proposal_counts(self, gamma: int) -> np.ndarray:
        """(γ+1,) P(a round that asks for γ drafts gets c of them), c = 0..γ."""
        reach = self.curves(gamma)[1]
        return reach - np.append(reach[1:], 0.0)


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def monotone(x) -> np.ndarray:
    """The least-squares non-decreasing fit of x (pool adjacent violators): a verify call of more tokens
    never costs less, so timing noise that says otherwise is averaged out."""
    blocks = []  # [mean, weight]
    for v in np.asarray(x, dtype=np.float64):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([np.full(int(w), m) for m, w in blocks])


class _FixedDraft(Drafter):
    """Proposes γ copies of token 0 at no cost: probe rounds with it time the host's part of a round."""

    def propose(self, contexts, gamma, pick, active) -> Proposal:
        return Proposal(np.zeros((len(contexts), gamma), np.int64), np.where(active, gamma, 0))

    def draft(self, ctx, gamma, out) -> int:
        out[:gamma] = 0
        return gamma


def _filled(dec, n: int):
    """dec with n committed rows of zeros in its cache: for timing only (a call costs the same whatever the
    rows hold), it saves the prefill of every measured context."""
    dec.cache.reserve(n)
    dec.cache.wrote(n)
    dec.cache.commit(n)
    return dec


def _draft_probe(drafter: Drafter, ctx: list[int], gamma: int, counts: list) -> None:
    """One draft run over ctx (its last token pending), then the drafter forgets it again, so every run does a
    round's work at the same context: a catch-up of one token and γ proposals (a LookupDraft's model: lookup
    rounds cost next to nothing, model rounds are priced)."""
    out = np.empty(gamma, np.int64)
    counts.append(drafter.model_draft(ctx, gamma, out))
    if drafter.decoder is not None:  # back to ctx[:-1] in its cache
        cache = drafter.decoder.cache
        cache.rewind_to(np.minimum(cache.lengths, len(ctx) - 1))


def _round_probe(target, prompt: list[int], gamma: int, host: list) -> Callable[[], None]:
    """-> a call that runs one fast_round with a free draft on a decoder of `target` (restarting the sequence
    before it outgrows the engine) and appends the round's host time (outside draft and verify) to `host`."""
    dec, timer, cap, free = target.decoder(1), Timer(), target.manifest.max_context, _FixedDraft()
    state = {"ctx": None}

    def one_round() -> None:
        ctx = state["ctx"]
        if ctx is None or len(ctx) + gamma + 2 > cap:
            ctx = state["ctx"] = list(prompt)
            dec.cache.rewind_to(0)
            _filled(dec, len(ctx) - 1)
        t0, d0, v0 = time.perf_counter(), timer.t["draft"], timer.t["verify"]
        new, _, _ = fast_round(dec, free, ctx, gamma, timer=timer)
        ctx += new
        host.append(time.perf_counter() - t0 - (timer.t["draft"] - d0) - (timer.t["verify"] - v0))
    return one_round


def measure(target, make_drafter: Callable[[], Drafter | None], gamma_max: int, capacity: int,
            budget_s: float = MEASURE_BUDGET_S, min_reps: int = MEASURE_REPS[0], max_reps: int = MEASURE_REPS[1],
            contexts=CONTEXT_BUCKETS) -> CostModel:
    """Time what a round is made of on this device, at each context bucket (capped at `capacity`, the
    engines' smallest): target calls of S = 1..γmax+1 tokens, the drafter (make_drafter(): a fresh one for
    one sequence, None without a draft) asked for 1 and for a few tokens (per proposal and per round), and
    rounds with a free draft (the host's part). After one warm-up pass, passes that time every call once, in
    a shuffled order, repeat until `budget_s` is spent (at least min_reps, at most max_reps passes); each cost
    is the median over passes."""
    if not (budget_s >= 0 and 1 <= min_reps <= max_reps):
        raise ValueError(f"need budget_s >= 0 and 1 <= min_reps <= max_reps, got {budget_s}, {min_reps}, {max_reps}")
    m, gmax = target.manifest, gamma_max
    top = capacity - gmax - 2  # room for a verify call of γmax+1 tokens (and a draft run) after the context
    if top < 1:
        raise ValueError(f"gamma_max {gmax} leaves no context to measure at (capacity {capacity})")
    ctxs = sorted({min(int(c), top) for c in contexts})
    rng = np.random.default_rng(0)
    block = rng.integers(0, m.vocab_size, 32)  # contexts repeat it, so an n-gram draft finds continuations
    probes = {}  # key -> a call to time; ("verify", k, s) | ("draft", k, g) | ("round",)
    counts = {}  # ("draft", k, g) -> proposals per call
    g2 = min(4, gmax)
    drafting = False
    for k, n in enumerate(ctxs):
        tgt = _filled(target.decoder(1), n)  # fresh, never pooled: it grows to this bucket's length
        for s in range(1, gmax + 2):
            probes[("verify", k, s)] = partial(tgt.ids, rng.integers(0, m.vocab_size, (1, s)))
        drafter = make_drafter()
        drafting = drafter is not None
        if drafting and drafter.decoder is not None:
            _filled(drafter.decoder, n - 1)  # the probe's draft runs catch up on the last token only
        for g in sorted({1, g2}) if drafting else ():
            probes[("draft", k, g)] = partial(_draft_probe, drafter, list(np.resize(block, n)), g,
                                              counts.setdefault(("draft", k, g), []))
    host: list = []
    if drafting:
        probes[("round",)] = _round_probe(target, np.resize(block, ctxs[0]).tolist(), g2, host)
    times = {key: [] for key in probes}
    keys = list(probes)
    t0, passes = time.perf_counter(), -1  # pass -1 warms every shape and is not kept
    while passes < min_reps or (passes < max_reps and time.perf_counter() - t0 < budget_s):
        if passes == 0:
            t0 = time.perf_counter()
        for i in rng.permutation(len(keys)):
            key = keys[i]
            t = time.perf_counter()
            probes[key]()
            if passes >= 0:
                times[key].append(time.perf_counter() - t)
        passes += 1
    med = {key: float(np.median(v)) for key, v in times.items()}
    t_verify = [monotone([med[("verify", k, s)] for s in range(1, gmax + 2)]) for k in range(len(ctxs))]
    t_draft, fixed, t_round = [0.0] * len(ctxs), [0.0], 0.0
    if drafting:
        fixed = []
        for k in range(len(ctxs)):
            (t1, c1), (t2, c2) = [(med[("draft", k, g)], float(np.median(counts[("draft", k, g)])))
                                  for g in (1, g2)]
            if c2 > c1:  # time = fixed + c·per proposal, through the two points
                per = max(0.0, (t2 - t1) / (c2 - c1))
                t_draft[k], f = per, max(0.0, t1 - c1 * per)
            elif c1 > 0:
                t_draft[k], f = t1 / c1, 0.0
            else:  # never proposed anything: all of it is per round
                f = t1
            fixed.append(f)
        kept = host[len(host) // 4:]  # the first rounds warm up
        t_round = float(np.median(kept)) if kept else 0.0
    return CostModel(t_verify, t_draft, t_round, contexts=ctxs, t_draft_round=float(np.median(fixed)))

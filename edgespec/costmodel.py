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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

CONTEXT_BUCKETS = (64, 256, 1024)  # contexts where load-time costs are measured (capped at the engine's)
DEFAULT_GAMMA_MAX = 8  # longest draft `auto` considers unless load(gamma_max=) says otherwise
GAMMA_MAX_LIMIT = 16  # the longest draft `gamma_max` may allow
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
    def round_s(self, gamma: int, context: int | None = None, counts: np.ndarray | None = None) -> float:
        """Expected seconds of a round that asks for γ drafts; counts (γ+1,) = P(c proposals), default c = γ."""
        if gamma == 0:
            return self.t_round + self.verify_s(1, context)
        if counts is None:
            counts = np.zeros(gamma + 1)
            counts[gamma] = 1.0
        k0, k1, u = self._bracket(context)
        verify = (1 - u) * self.verify[k0, :gamma + 1] + u * self.verify[k1, :gamma + 1]  # (γ+1,) S = 1..γ+1
        if u > 1:
            verify = np.maximum(verify, self.verify[k1, :gamma + 1])
        c = np.arange(gamma + 1)
        return self.t_round + self.t_draft_round + float(counts @ (c * self.draft_s(context) + verify))

    def rate(self, alpha: float, gamma: int, tokens: float | None = None, context: int | None = None,
             counts: np.ndarray | None = None) -> float:
        """Expected tokens per second with γ drafts: the paper's E[tokens] at acceptance α, or `tokens`
        (expected tokens per round from measured position-wise acceptance) when given."""
        if gamma == 0:
            return 1.0 / self.round_s(0, context)
        e = expected_tokens(alpha, gamma) if tokens is None else tokens
        return e / self.round_s(gamma, context, counts)

    def predicted_speedup(self, alpha: float, gamma: int, context: int | None = None) -> float:
        return self.rate(alpha, gamma, context=context) / self.rate(alpha, 0, context=context)

    def best_gamma(self, alpha: float, limit: int | None = None, expected=None, context: int | None = None,
                   counts=None) -> int:
        """argmax over γ in 0..limit of expected tokens/s at this context; `expected(γ)` overrides the
        i.i.d. formula, `counts(γ)` gives P(c proposals) (default: the drafter proposes all γ)."""
        top = self.gamma_max if limit is None else max(0, min(limit, self.gamma_max))
        return max(range(top + 1), key=lambda g: self.rate(
            alpha, g, expected(g) if expected and g else None, context, counts(g) if counts and g else None))

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
    The position lists grow with the longest draft seen (`positions` presizes them)."""
    prior_accept: float = 3.0
    prior_reject: float = 1.0
    decay: float = 0.97
    accepted: float = 0.0
    rejected: float = 0.0
    positions: int = 0
    tried_at: list = field(default_factory=list)  # decayed drafts tried at position i
    kept_at: list = field(default_factory=list)  # ... and kept
    asked_at: list = field(default_factory=list)  # decayed rounds that asked for position i, having position i-1
    filled_at: list = field(default_factory=list)  # ... and got a proposal there

    def __post_init__(self):
        self._grow(self.positions)

    def _grow(self, n: int) -> None:
        for lst in (self.tried_at, self.kept_at, self.asked_at, self.filled_at):
            lst.extend([0.0] * (n - len(lst)))

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_accept) / (self.accepted + self.rejected + self.prior_accept + self.prior_reject)

    def update(self, accepted: int, drafted: int, asked: int | None = None) -> None:
        """One round: `asked` drafts were asked for (default: `drafted`), `drafted` proposed, `accepted` kept."""
        asked = drafted if asked is None else asked
        if not 0 <= accepted <= drafted <= asked:
            raise ValueError(f"need 0 <= accepted <= drafted <= asked, got {accepted}, {drafted}, {asked}")
        self._grow(asked)
        for i in range(len(self.asked_at)):  # position i is asked for when i < asked and 0..i-1 were proposed
            offered = i < asked and i <= drafted
            self.asked_at[i] = self.asked_at[i] * self.decay + offered
            self.filled_at[i] = self.filled_at[i] * self.decay + (offered and i < drafted)
        if drafted == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if accepted < drafted else 0)
        for i in range(len(self.tried_at)):  # position i is tried only when 0..i-1 were all kept
            tried = i < drafted and i <= accepted
            self.tried_at[i] = self.tried_at[i] * self.decay + tried
            self.kept_at[i] = self.kept_at[i] * self.decay + (tried and i < accepted)

    def fill(self, j: int, prior: float = 1.0) -> float:
        """P(the drafter proposes position j | asked for it, proposed j-1), shrunk toward 1."""
        a = self.asked_at[j] if j < len(self.asked_at) else 0.0
        f = self.filled_at[j] if j < len(self.filled_at) else 0.0
        return (f + prior) / (a + prior)

    def proposal_counts(self, gamma: int) -> np.ndarray:
        """(γ+1,) P(a round that asks for γ drafts gets c of them), c = 0..γ."""
        reach = np.cumprod([1.0] + [self.fill(j) for j in range(gamma)])  # P(c >= j), j = 0..γ
        return reach - np.append(reach[1:], 0.0)

    def expected_tokens(self, gamma: int, prior: float = 2.0) -> float:
        """E[tokens per round] = 1 + sum_j prod_{i<=j} f_i a_i from position-wise acceptance a_i (shrunk toward
        the pooled α where a position has few observations) and fill f_i. Acceptance is not i.i.d. (easy
        stretches accept everything, hard ones reject at once), so this can differ from the paper's formula
        either way."""
        alpha, e, run = self.alpha, 1.0, 1.0
        for j in range(gamma):
            t = self.tried_at[j] if j < len(self.tried_at) else 0.0
            k = self.kept_at[j] if j < len(self.kept_at) else 0.0
            run *= self.fill(j) * (k + prior * alpha) / (t + prior)
            e += run
        return e


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

"""Device-measured cost model for choosing the draft length γ (Leviathan et al. 2023, section 3.4).

E[tokens per round] = (1 - α^(γ+1)) / (1 - α); time per round = γ·t_draft + t_verify(γ+1) + t_round.
γ = 0 means plain decoding (one target step per token). The γ with the most tokens per second wins.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class CostModel:
    t_verify: list[float]  # t_verify[s-1]: seconds of one target call with s tokens, s = 1..γmax+1
    t_draft: float  # seconds per draft token (one draft call, or one n-gram lookup)
    t_round: float = 0.0  # fixed per-round host overhead (acceptance, bookkeeping)

    def __post_init__(self):
        if not self.t_verify or min(self.t_verify) <= 0:
            raise ValueError(f"t_verify must be positive timings, got {self.t_verify}")

    @property
    def gamma_max(self) -> int:
        return len(self.t_verify) - 1

    def rate(self, alpha: float, gamma: int, tokens: float | None = None) -> float:
        """Expected tokens per second with γ drafts: the paper's E[tokens] at acceptance α, or `tokens`
        (expected tokens per round from measured position-wise acceptance) when given."""
        if gamma == 0:
            return 1.0 / self.t_verify[0]
        e = expected_tokens(alpha, gamma) if tokens is None else tokens
        return e / (gamma * self.t_draft + self.t_verify[gamma] + self.t_round)

    def predicted_speedup(self, alpha: float, gamma: int) -> float:
        return self.rate(alpha, gamma) / self.rate(alpha, 0)

    def best_gamma(self, alpha: float, limit: int | None = None, expected=None) -> int:
        """argmax over γ in 0..limit of expected tokens/s; `expected(γ)` overrides the i.i.d. formula."""
        top = self.gamma_max if limit is None else min(limit, self.gamma_max)
        return max(range(top + 1), key=lambda g: self.rate(alpha, g, expected(g) if expected and g else None))

    def observe(self, gamma: int, draft_s: float, verify_s: float, weight: float = 0.1) -> None:
        """Blend in one round's measured costs (in the loop a draft step costs more than in isolation:
        the target's weights evict the draft's from the cache)."""
        if gamma > 0 and draft_s > 0:
            self.t_draft += weight * (draft_s / gamma - self.t_draft)
        if 0 <= gamma < len(self.t_verify) and verify_s > 0:
            self.t_verify[gamma] += weight * (verify_s - self.t_verify[gamma])

    def to_dict(self) -> dict:
        return {"t_verify_ms": [round(t * 1e3, 4) for t in self.t_verify], "t_draft_ms": round(self.t_draft * 1e3, 4),
                "t_round_ms": round(self.t_round * 1e3, 4)}


@dataclass
class AcceptanceEstimator:
    """Running estimate of α from rounds: each accepted draft is a success, a round that stopped at a
    rejection is one failure (drafts after it were never tried). Old rounds decay away."""
    prior_accept: float = 3.0
    prior_reject: float = 1.0
    decay: float = 0.97
    accepted: float = 0.0
    rejected: float = 0.0
    tried_at: list = field(default_factory=lambda: [0.0] * 16)  # decayed drafts tried at position i
    kept_at: list = field(default_factory=lambda: [0.0] * 16)  # ... and kept

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_accept) / (self.accepted + self.rejected + self.prior_accept + self.prior_reject)

    def update(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if accepted < drafted else 0)
        for i in range(len(self.tried_at)):  # position i is tried only when 0..i-1 were all kept
            tried = i < drafted and i <= accepted
            self.tried_at[i] = self.tried_at[i] * self.decay + tried
            self.kept_at[i] = self.kept_at[i] * self.decay + (tried and i < accepted)

    def expected_tokens(self, gamma: int, prior: float = 2.0) -> float:
        """E[tokens per round] = 1 + sum_i prod_{j<=i} a_j from position-wise acceptance a_j (shrunk toward
        the pooled α where a position has few observations). Acceptance is not i.i.d. (easy stretches accept
        everything, hard ones reject at once), so this can differ from the paper's formula either way."""
        alpha, e, run = self.alpha, 1.0, 1.0
        for j in range(gamma):
            t = self.tried_at[j] if j < len(self.tried_at) else 0.0
            k = self.kept_at[j] if j < len(self.kept_at) else 0.0
            run *= (k + prior * alpha) / (t + prior)
            e += run
        return e


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))

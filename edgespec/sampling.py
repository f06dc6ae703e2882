"""Sampling: the settings, logits -> probabilities (temperature, top-k, top-p), and the three pickers.

All functions take logits (..., V) float32 and work on the last axis. Draft and target distributions go
through the same `probs` so that rejection sampling compares like with like.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ACCEPTANCE_MODES = ("greedy", "rejection", "coupled")
# Smallest sampling temperature (0 = greedy, and nothing in (0, TEMPERATURE_MIN) is accepted). At 1e-4 a
# logit gap of 0.01 is already 100 nats, so exp(-gap / T) < 4e-44 underflows float32 to 0: sampling is
# argmax except on exact ties, i.e. greedy with rounding artefacts. Further down, logits / T stops being a
# number: fp16-range logits (65504) overflow float32 below T ~ 2e-34, and a temperature of 1e-310 overflows
# even the float64 division here (30 / 1e-310 = inf, then inf - inf = NaN probabilities). Ask for 0.
TEMPERATURE_MIN = 1e-4


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy; else >= TEMPERATURE_MIN
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and np.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < TEMPERATURE_MIN:
            raise ValueError(f"temperature must be 0 (greedy) or >= {TEMPERATURE_MIN}, got {t!r}: below "
                             f"{TEMPERATURE_MIN} sampling is greedy up to rounding and logits / temperature "
                             f"overflows; use temperature 0 for greedy decoding")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_finite(logits: np.ndarray, engine: str, step: int) -> None:
    if not np.isfinite(logits.sum()) and not np.isfinite(logits).all():  # one cheap reduction first
        bad = int((~np.isfinite(logits)).sum())
        raise FloatingPointError(f"{engine} engine produced {bad} NaN/inf logits at step {step}; "
                                 f"refusing to sample or accept from them")


def check_ids(ids: np.ndarray, engine: str, step: int) -> None:
    """The engine's next_ids carry NONFINITE_ID (-1) where its logits held NaN or inf."""
    if ids.min(initial=0) < 0:
        bad = int((ids < 0).sum())
        raise FloatingPointError(f"{engine} engine produced NaN/inf logits at step {step} ({bad} position(s)); "
                                 f"refusing to accept from them")


def filtered_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits / T with everything outside top-k / top-p set to -inf. (..., V) -> (..., V) float64."""
    x = logits.astype(np.float64) / (cfg.temperature if cfg.temperature > 0 else 1.0)
    v = x.shape[-1]
    if 0 < cfg.top_k < v:
        kth = np.partition(x, v - cfg.top_k, axis=-1)[..., v - cfg.top_k:v - cfg.top_k + 1]
        x = np.where(x < kth, -np.inf, x)
    if cfg.top_p < 1.0:
        order = np.argsort(-x, axis=-1)
        sx = np.take_along_axis(x, order, -1)
        p = np.exp(sx - sx[..., :1])
        p /= p.sum(-1, keepdims=True)
        before = np.cumsum(p, -1) - p  # mass strictly before each token
        drop_sorted = before >= cfg.top_p  # keeps the smallest prefix whose mass reaches top_p
        drop = np.empty_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        x = np.where(drop, -np.inf, x)
    return x


def probs(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Sampling distribution (..., V) float64 after temperature, top-k and top-p."""
    x = filtered_logits(logits, cfg)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a 1-D distribution (inverse CDF; robust to rounding)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


class GumbelNoise:
    """Position-keyed Gumbel noise for coupled sampling: noise(b, pos) depends only on (seed, b, pos).

    Draft and target draw token `pos` as argmax(filtered_logits + noise(b, pos)), so with a fixed seed the
    output is the same whether or not a draft speculated, and is an exact sample from the target
    (Gumbel-max). Values are cached for the positions of the current round.
    """

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.v = seed, vocab_size
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, b: int, pos: int) -> np.ndarray:
        key = (b, pos)
        g = self._cache.get(key)
        if g is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            g = np.random.default_rng([self.seed, b, pos]).gumbel(size=self.v)
            self._cache[key] = g
        return g

    def pick(self, logits: np.ndarray, cfg: SamplingConfig, b: int, pos: int) -> int:
        return int(np.argmax(filtered_logits(logits, cfg) + self(b, pos)))

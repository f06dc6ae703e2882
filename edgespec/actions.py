"""Action tokens: OpenVLA-compatible binning of continuous robot actions into token ids.

Bit-compatible with openvla/openvla prismatic/vla/action_tokenizer.py and its q01/q99 normalisation:

    normalise (masked dims):  x = clip(2 (a - q01) / (q99 - q01 + 1e-8) - 1, -1, 1)   (unmasked: x = a)
    edges e = linspace(-1, 1, n_bins); centres c = (e[:-1] + e[1:]) / 2              (n_bins - 1 values)
    encode:  d = digitize(clip(x, -1, 1), e) in 1..n_bins;  id = vocab_end - d          (the last ids, reversed)
    decode:  i = clip(vocab_end - id - 1, 0, n_bins - 2);  x = c[i];  a = 0.5 (x + 1)(q99 - q01) + q01 (masked)

`vocab_end` is the text vocabulary size for an OpenVLA-style model (action ids are its last n_bins ids);
`ActionTokenizer.native(n_bins)` gives a small policy its own id space 0..n_bins-1. A chunk of H steps x
D dims is laid out time-major: ids[t * D + d].
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NORM_EPS = 1e-8  # OpenVLA's epsilon in the q01/q99 normalisation


@dataclass
class ActionStats:
    """Per-dimension normalisation statistics; mask[d] False = pass the dimension through (e.g. a gripper)."""
    q01: list
    q99: list
    mask: list = field(default_factory=list)

    def __post_init__(self):
        self.q01 = np.asarray(self.q01, dtype=np.float64)
        self.q99 = np.asarray(self.q99, dtype=np.float64)
        self.mask = np.ones(len(self.q01), bool) if len(self.mask) == 0 else np.asarray(self.mask, dtype=bool)
        if not (self.q01.ndim == self.q99.ndim == self.mask.ndim == 1 and
                len(self.q01) == len(self.q99) == len(self.mask)):
            raise ValueError(f"q01, q99 and mask must be 1-D of one length, got {self.q01.shape}, "
                             f"{self.q99.shape}, {self.mask.shape}")
        if not (np.isfinite(self.q01).all() and np.isfinite(self.q99).all()):
            raise ValueError("q01 and q99 must be finite")
        if np.any(self.q99[self.mask] < self.q01[self.mask]):
            bad = np.nonzero(self.mask & (self.q99 < self.q01))[0].tolist()
            raise ValueError(f"q99 < q01 for dimensions {bad}")

    @property
    def dims(self) -> int:
        return len(self.q01)

    # file format: {"q01": [...], "q99": [...], "mask": [...]} (OpenVLA's dataset_statistics "action" entry)
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"q01": self.q01.tolist(), "q99": self.q99.tolist(),
                                          "mask": self.mask.tolist()}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ActionStats":
        data = json.loads(Path(path).read_text())
        data = data.get("action", data)  # also accepts OpenVLA's {"action": {...}} nesting
        missing = [k for k in ("q01", "q99") if k not in data]
        if missing:
            raise ValueError(f"{path}: action statistics need {missing}; got keys {sorted(data)}")
        return cls(data["q01"], data["q99"], data.get("mask", []))

    def normalize(self, a: np.ndarray) -> np.ndarray:
        a = self._check(a)
        x = np.clip(2 * (a - self.q01) / (self.q99 - self.q01 + NORM_EPS) - 1, -1, 1)
        return np.where(self.mask, x, a)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        x = self._check(x)
        return np.where(self.mask, 0.5 * (x + 1) * (self.q99 - self.q01) + self.q01, x)

    def _check(self, a) -> np.ndarray:
        a = np.asarray(a, dtype=np.float64)
        if a.shape[-1:] != (self.dims,):
            raise ValueError(f"actions must end in {self.dims} dimensions (the statistics' length), got shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("actions contain NaN or inf")
        return a


class ActionTokenizer:
    def __init__(self, vocab_end: int, n_bins: int = 256, stats: ActionStats | None = None):
        if n_bins < 2:
            raise ValueError(f"n_bins must be >= 2, got {n_bins}")
        if vocab_end < n_bins:
            raise ValueError(f"vocab_end ({vocab_end}) must be >= n_bins ({n_bins}): action ids are the last "
                             f"n_bins ids below vocab_end")
        self.vocab_end, self.n_bins, self.stats = int(vocab_end), int(n_bins), stats
        self.edges = np.linspace(-1.0, 1.0, n_bins)
        self.centers = (self.edges[:-1] + self.edges[1:]) / 2.0  # (n_bins - 1,)

    @classmethod
    def native(cls, n_bins: int = 256, stats: ActionStats | None = None) -> "ActionTokenizer":
        """A policy whose whole vocabulary is action bins: ids 0..n_bins-1."""
        return cls(n_bins, n_bins, stats)

    @property
    def first_id(self) -> int:
        return self.vocab_end - self.n_bins

    def is_action(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        return (ids >= self.first_id) & (ids < self.vocab_end)

    def encode(self, actions) -> np.ndarray:
        """actions (..., D) in robot units (or [-1, 1] without stats) -> ids (..., D) int64."""
        x = np.asarray(actions, dtype=np.float64)
        if self.stats is not None:
            x = self.stats.normalize(x)
        elif not np.isfinite(x).all():
            raise ValueError("actions contain NaN or inf")
        d = np.digitize(np.clip(x, -1.0, 1.0), self.edges)
        return (self.vocab_end - d).astype(np.int64)

    def decode(self, ids) -> np.ndarray:
        """ids (..., D) -> actions (..., D): bin centres, unnormalised with the statistics if given."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.is_action(ids).all():
            bad = ids[~self.is_action(ids)][:5].tolist()
            raise ValueError(f"ids {bad} are not action ids (expected {self.first_id}..{self.vocab_end - 1})")
        x = self.centers[np.clip(self.vocab_end - ids - 1, 0, self.n_bins - 2)]
        return self.stats.unnormalize(x) if self.stats is not None else x

    def decode_chunk(self, ids, horizon: int, dims: int) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.shape != (horizon * dims,):
            raise ValueError(f"expected {horizon} x {dims} = {horizon * dims} ids, got shape {ids.shape}")
        return self.decode(ids.reshape(horizon, dims))

"""A draft head for action tokens: a two-layer MLP over the encoder's prefix and the ids already emitted,
computed in numpy. It proposes what a draft decoder proposes at a fraction of the cost of an engine call.

    head = DraftHead.load("engines/vla-reacher/draft_head.npz")
    head.start(prefix)                    # prefix (1, P, E): ctx = W_ctx . flatten(prefix), once per chunk
    tok, p = head.next(ids)               # ids: the chunk's ids so far (time-major) -> next id, its probability

For chunk position t (dimension t % D) with ids x_0..x_{t-1}, and "none"/"start" indices where a feature
does not exist yet (head_features):
    h  = relu(ctx + pos[t] + prev[x_{t-1}] + same[x_{t-D}] + vel[x_{t-D} - x_{t-2D}] + other_vel[x_{t-1} - x_{t-1-D}])
    h2 = relu(W_2 h + b_2)
    t <  D: logits over the bins            = W_abs h2 + b_abs        (n_bins,)
    t >= D: logits over steps -R..R from x_{t-D} = W_rel h2 + b_rel   (2R+1,), bins outside 0..n-1 excluded
Velocities are clipped to -R..R as features. The five embedding rows come from one stacked table in one
gather, so a proposal is a gather, two small matrix-vector products and an argmax.
Trained by export/training/train_draft_head.py on the target's own greedy chunks (distillation).
`HeadDraft` wraps it as a `Drafter`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .drafts import OneSequenceDrafter, load_arrays, mv, top

TABLES = ("prev", "same", "vel", "other_vel")


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def head_features(ids: np.ndarray, dims: int, n_ids: int, radius: int) -> dict[str, np.ndarray]:
    """ids (B, T) int -> per position t the row index into each table (B, T): what position t sees of
    x_0..x_{t-1} (teacher forcing: row t never reads ids[:, t:])."""
    b, t = ids.shape
    start, none = n_ids, 2 * radius + 1
    out = {k: np.empty((b, t), np.int64) for k in TABLES}
    for j in range(t):
        out["prev"][:, j] = ids[:, j - 1] if j >= 1 else start
        out["same"][:, j] = ids[:, j - dims] if j >= dims else start
        out["vel"][:, j] = np.clip(ids[:, j - dims] - ids[:, j - 2 * dims], -radius, radius) + radius \
            if j >= 2 * dims else none
        out["other_vel"][:, j] = np.clip(ids[:, j - 1] - ids[:, j - 1 - dims], -radius, radius) + radius \
            if j - 1 - dims >= 0 else none
    return out


@dataclass
class DraftHeadWeights:
    ctx_w: np.ndarray  # (P*E, H)
    ctx_b: np.ndarray  # (H,)
    pos: np.ndarray  # (T, H)
    prev: np.ndarray  # (n+1, H)
    same: np.ndarray  # (n+1, H)
    vel: np.ndarray  # (2R+2, H)
    other_vel: np.ndarray  # (2R+2, H)
    fc2_w: np.ndarray  # (H, H)
    fc2_b: np.ndarray  # (H,)
    abs_w: np.ndarray  # (H, n)
    abs_b: np.ndarray  # (n,)
    rel_w: np.ndarray  # (H, 2R+1)
    rel_b: np.ndarray  # (2R+1,)
    dims: int
    horizon: int
    radius: int

    def __post_init__(self):
        h = self.ctx_b.shape[0]
        n, r2 = self.abs_b.shape[0], 2 * self.radius + 1
        want = {"ctx_w": (self.ctx_w.shape[0], h), "pos": (self.horizon * self.dims, h), "prev": (n + 1, h),
                "same": (n + 1, h), "vel": (r2 + 1, h), "other_vel": (r2 + 1, h), "fc2_w": (h, h), "fc2_b": (h,),
                "abs_w": (h, n), "rel_w": (h, r2), "rel_b": (r2,)}
        bad = [f"{k}: want {s}, got {getattr(self, k).shape}" for k, s in want.items() if getattr(self, k).shape != s]
        if bad:
            raise ValueError("draft head weights do not fit together: " + "; ".join(bad))

    @property
    def n_ids(self) -> int:
        return self.abs_b.shape[0]

    def save(self, path: str | Path, dtype=np.float16) -> None:
        """Weights stored as `dtype` (fp16 by default: half the bytes; a draft only proposes, the target
        decides, so rounding it cannot change a decoded action), loaded back as float32."""
        arrays = {f.name: getattr(self, f.name) for f in fields(self)}
        np.savez(path, **{k: np.asarray(v, dtype) if isinstance(v, np.ndarray) else np.int64(v)
                          for k, v in arrays.items()})

    @classmethod
    def load(cls, path: str | Path) -> "DraftHeadWeights":
        z = load_arrays(path, [f.name for f in fields(cls)], "draft head")
        return cls(**{k: int(v) if k in ("dims", "horizon", "radius") else np.ascontiguousarray(v, np.float32)
                      for k, v in z.items()})

    @classmethod
    def from_torch(cls, head, dims: int, horizon: int, radius: int) -> "DraftHeadWeights":
        def w(lin):
            return lin.weight.detach().numpy().T.copy(), lin.bias.detach().numpy().copy()
        ctx_w, ctx_b = w(head.ctx)
        fc2_w, fc2_b = w(head.fc2)
        abs_w, abs_b = w(head.abs_out)
        rel_w, rel_b = w(head.rel_out)
        emb = {k: getattr(head, k).weight.detach().numpy().copy() for k in ("pos",) + TABLES}
        return cls(ctx_w, ctx_b, emb["pos"], emb["prev"], emb["same"], emb["vel"], emb["other_vel"], fc2_w, fc2_b,
                   abs_w, abs_b, rel_w, rel_b, dims, horizon, radius)


class DraftHead:
    """The numpy head. `start(prefix)` once per chunk, then `next(ids)` per proposal."""

    def __init__(self, weights: DraftHeadWeights):
        self.w = w = weights
        self.dims, self.radius, self.n_ids = w.dims, w.radius, w.n_ids
        self._ctx = np.zeros_like(w.ctx_b)
        # one stacked table: rows pos | prev | same | vel | other_vel, and where each part starts
        parts = [w.pos] + [getattr(w, k) for k in TABLES]
        self._table = np.ascontiguousarray(np.concatenate(parts, 0))
        self._at = np.cumsum([0] + [len(p) for p in parts[:-1]])  # (5,) offsets
        self._rows = np.zeros(5, np.int64)
        self.calls = 0

    @classmethod
    def load(cls, path: str | Path) -> "DraftHead":
        return cls(DraftHeadWeights.load(path))

    def start(self, prefix: np.ndarray) -> None:
        """prefix (1, P, E) float32."""
        flat = prefix.reshape(-1)
        if flat.shape[0] != self.w.ctx_w.shape[0]:
            raise ValueError(f"prefix has {flat.shape[0]} values; this draft head was trained on "
                             f"{self.w.ctx_w.shape[0]} (P x E)")
        self._ctx = mv(flat, self.w.ctx_w) + self.w.ctx_b

    def _hidden(self, ids, t: int) -> np.ndarray:
        d, r, start, none = self.dims, self.radius, self.n_ids, 2 * self.radius + 1
        rows = self._rows
        rows[0] = t
        rows[1] = ids[t - 1] if t >= 1 else start
        rows[2] = ids[t - d] if t >= d else start
        rows[3] = min(max(ids[t - d] - ids[t - 2 * d], -r), r) + r if t >= 2 * d else none
        rows[4] = min(max(ids[t - 1] - ids[t - 1 - d], -r), r) + r if t - 1 - d >= 0 else none
        x = self._table[rows + self._at].sum(0)
        x += self._ctx
        np.maximum(x, 0.0, out=x)
        x = mv(x, self.w.fc2_w)
        x += self.w.fc2_b
        return np.maximum(x, 0.0, out=x)

    def next(self, ids) -> tuple[int, float]:
        """ids: the chunk's ids so far (list or array, time-major) -> (the head's next id, its probability)."""
        t = len(ids)
        h = self._hidden(ids, t)
        self.calls += 1
        if t < self.dims:
            return top(mv(h, self.w.abs_w) + self.w.abs_b)
        z, first = self._steps(h, ids, t)
        best, p = top(z)
        return first + best, p

    def _steps(self, h: np.ndarray, ids, t: int) -> tuple[np.ndarray, int]:
        """-> the step logits that land on a bin (steps -R..R from ids[t-D], clipped to 0..n-1), and the
        bin id of the first of them."""
        z = mv(h, self.w.rel_w) + self.w.rel_b  # (2R+1,)
        base = int(ids[t - self.dims]) - self.radius
        lo, hi = max(0, -base), min(len(z), self.n_ids - base)
        return z[lo:hi], base + lo

    def reference_logits(self, prefix: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Every position's logits at once, teacher-forced on ids (T,), from head_features and explicit
        matrix products (slow, obvious; the training formula) -> abs (D, n), rel (T-D, 2R+1)."""
        w = self.w
        f = head_features(np.asarray(ids)[None], self.dims, self.n_ids, self.radius)
        ctx = prefix.reshape(1, -1) @ w.ctx_w + w.ctx_b  # (1, H)
        x = ctx + w.pos[:len(ids)] + sum(getattr(w, k)[f[k][0]] for k in TABLES)  # (T, H)
        h = relu(relu(x) @ w.fc2_w + w.fc2_b)
        return h[:self.dims] @ w.abs_w + w.abs_b, h[self.dims:] @ w.rel_w + w.rel_b


class HeadDraft(OneSequenceDrafter):
    """The head as a Drafter for one sequence: contexts hold `offset` placeholder ids for the prefix, then
    the chunk's ids. It drafts from the prefix alone (start(prefix) once per chunk), so a chunk's first round
    can be the target's prefill (speculative.fast_round with prefix). Stops after a proposal with
    probability < stop_below."""
    from_prefix = True

    def __init__(self, head: DraftHead, offset: int, stop_below: float = 0.0):
        self.head, self.offset, self.stop_below = head, offset, stop_below

    def start(self, prefix: np.ndarray) -> None:
        self.head.start(prefix)

    def begin(self, prefix: np.ndarray) -> None:
        """A new chunk after prefix (1, P, E)."""
        self.head.start(prefix)

    def draft(self, ctx, gamma, out) -> int:
        work = ctx[self.offset:]  # the chunk's ids so far (a copy: proposals are appended)
        for j in range(gamma):
            tok, p = self.head.next(work)
            out[j] = tok
            if p < self.stop_below:
                return j + 1
            work.append(tok)
        return gamma


class HiddenHeadDraft(OneSequenceDrafter):
    """The head as a Drafter for a prompt policy, whose prefix length varies with its prompt: its context is the
    target's final hidden state at the prefix's last position (a (1, E) "prefix", so ctx_w is (E, H)), read through
    `features(position)` (the target's hidden_at) from the chunk's prefill. It cannot draft before that prefill, so
    a chunk's first round is a plain prefill (from_prefix False) and the head starts at its first draft. The head
    proposes bins 0..n-1; the policy's ids are those + first_id (OpenVLA's are the vocabulary's last n)."""
    from_prefix = False
    reads_prefill = True

    def __init__(self, head: DraftHead, features, first_id: int, stop_below: float = 0.0):
        self.head, self.features, self.first_id, self.stop_below = head, features, first_id, stop_below
        self.offset, self._started = 0, False

    def begin(self, prefix: np.ndarray) -> None:
        """A new chunk after prefix (1, P, E): the head starts at its first draft, from the prefill's hidden state."""
        self.offset, self._started = prefix.shape[1], False

    def draft(self, ctx, gamma, out) -> int:
        if not gamma:
            return 0
        if not self._started:  # the last target call was this chunk's prefill
            self.head.start(np.asarray(self.features(self.offset - 1), np.float32)[None, None])
            self._started = True
        lo = self.first_id
        work = [i - lo for i in ctx[self.offset:]]
        for j in range(gamma):
            tok, p = self.head.next(work)
            out[j] = tok + lo
            if p < self.stop_below:
                return j + 1
            work.append(tok)
        return gamma

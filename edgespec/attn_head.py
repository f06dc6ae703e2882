"""An attention feature head (EAGLE-style; Li et al., ICML 2024): one causal decoder layer over the target's final
hidden states that guesses the next hidden state and proposes from it, drafting on from its own guesses. Where the
MLP text head (text_head.py) reads the last hidden state alone, this one attends to every earlier position.

At position t, for f_t the target's final hidden state (what its LM head reads) and x_{t+1} the token emitted from
it (shapes: E the target's hidden size, H the head's, n heads of d = H / n):
    r = [f_t, e(x_{t+1})] W_in + b_in                              (H,)   e: the target's input embeddings
    q, k, v = rope(norm1(r) W_qkv)                                 (n, d) each; rotary at position t
    r = r + attend(q; keys and values of positions <= t) W_o
    r = r + (silu(a) * b) W_down,  [a, b] = norm2(r) W_gu          (2H,) -> (H,)
    g_t = norm3(r) W_out + b_out                                   (E,)   the guess of f_{t+1}
    proposal = argmax(g_t L^T)                                     L: the target's LM head (V, E)
Drafting from a context of L tokens: the keys and values of positions 0..L-2 come from the target's true states
(kept across rounds: only the positions the target verified since the last round are added), the first guess is
g_{L-2}; each further proposal feeds (g, proposal) at the next position, and those entries are dropped at the
round's end. Trained by export/training/train_attn_head.py. `reference_guesses` is the slow obvious version.

The products with E-wide vectors are folded at load, as text_head.py folds its own: with z = norm3(r) (H,),
    proposal logits = z (W_out L^T) + b_out L^T                     (H, V): never the (V, E) LM head per proposal
    the next position's r = z (W_out W_f) + b_out W_f + P[token]    W_f: W_in's rows for f; P = e W_e + b_in (V, H)
so a drafted position costs H-wide products only, and a true state one (E, H) product.

Those products run on native_step.c's float16 panel kernel on the calling thread (es_rows_f16) where the native
library loads and a matrix's width is a multiple of its panel, else on numpy in float32 (`products`). The kernel
is about 2-3x faster than numpy's single-threaded loop at these sizes, and it never wakes the engine's thread pool.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .drafts import OneSequenceDrafter, load_arrays, mv

PRODUCTS = ("auto", "native", "numpy")
ROWS_PER_CALL = 12  # es_rows_f16 takes at most MAX_ROWS (native_step.c) rows of x
HEAD_KIND = "attention"  # the file's `kind`: what edgespec.load tells this head from the MLP text head by
HEAD_FORMAT = 1
ROPE_THETA = 10000.0


def silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


@dataclass
class AttnHeadWeights:
    w_in: np.ndarray  # (2E, H)
    b_in: np.ndarray  # (H,)
    norm1: np.ndarray  # (H,)
    w_qkv: np.ndarray  # (H, 3H): q, k, v, each n heads of d
    w_o: np.ndarray  # (H, H)
    norm2: np.ndarray  # (H,)
    w_gu: np.ndarray  # (H, 4H): gate, then up
    w_down: np.ndarray  # (2H, H)
    norm3: np.ndarray  # (H,)
    w_out: np.ndarray  # (H, E)
    b_out: np.ndarray  # (E,)
    embed: np.ndarray  # (V, E) the target's input embeddings
    lm: np.ndarray  # (V, E) the target's LM head
    heads: int
    eps: float  # the norms' epsilon

    def __post_init__(self):
        self.heads, self.eps = int(self.heads), float(self.eps)
        for f in fields(self):  # row-major float32 (a transposed Linear weight is column-major: mv reads it slowly)
            if f.name not in ("heads", "eps"):
                setattr(self, f.name, np.ascontiguousarray(getattr(self, f.name), np.float32))
        e2, h = self.w_in.shape
        e, v = e2 // 2, self.embed.shape[0]
        want = {"w_in": (2 * e, h), "b_in": (h,), "norm1": (h,), "w_qkv": (h, 3 * h), "w_o": (h, h), "norm2": (h,),
                "w_gu": (h, 4 * h), "w_down": (2 * h, h), "norm3": (h,), "w_out": (h, e), "b_out": (e,),
                "embed": (v, e), "lm": (v, e)}
        bad = [f"{n}: want {s}, got {getattr(self, n).shape}" for n, s in want.items() if getattr(self, n).shape != s]
        if bad:
            raise ValueError("attention head weights do not fit together: " + "; ".join(bad))
        if self.heads < 1 or h % self.heads or (h // self.heads) % 2:
            raise ValueError(f"attention head: {h} wide must split into {self.heads} heads of an even size")

    @property
    def hidden_size(self) -> int:
        return self.w_out.shape[1]

    def save(self, path: str | Path, dtype=np.float16) -> None:
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("heads", "eps")}
        np.savez(path, kind=np.array(HEAD_KIND), format=np.int64(HEAD_FORMAT), heads=np.int64(self.heads),
                 eps=np.float64(self.eps), **{k: np.asarray(v, dtype) for k, v in arrays.items()})

    @classmethod
    def load(cls, path: str | Path) -> "AttnHeadWeights":
        names = [f.name for f in fields(cls)]
        z = load_arrays(path, ["kind", "format"] + names, "attention draft head")
        if str(z["kind"]) != HEAD_KIND or int(z["format"]) != HEAD_FORMAT:
            raise ValueError(f"{path}: attention head kind {str(z['kind'])!r} format {int(z['format'])}, this runtime "
                             f"reads {HEAD_KIND!r} format {HEAD_FORMAT}")
        return cls(**{n: (z[n].item() if n in ("heads", "eps") else np.asarray(z[n], np.float32)) for n in names})


def is_attention_head(path: str | Path) -> bool:
    """Whether a head file (.npz) holds an attention head (else: the MLP text head)."""
    if not Path(path).is_file():
        return False  # the loader says what is missing
    with np.load(path) as z:
        return "kind" in z.files and str(z["kind"]) == HEAD_KIND


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (N,) or (T, N) @ w (N, M) on the calling thread (drafts.mv: numpy's BLAS threads would wait for the cores
    the engine's pool spins on, and slow its next call)."""
    return mv(x, w) if x.ndim == 1 else np.einsum("tn,nm->tm", x, w, optimize=False)


def native_library():
    """native_step.c's library, or None where it does not build or load (no C compiler: numpy products)."""
    from .backends.native_lib import library
    from .contract import EngineError
    try:
        return library()
    except (EngineError, OSError):
        return None


class Matrix:
    """x @ W for one of the head's matrices W (K, N): es_rows_f16 over W packed as float16 panels when `lib` is
    given and N is a multiple of the panel width, else numpy in float32 (_mm)."""

    def __init__(self, w: np.ndarray, lib=None):
        from .backends.native_format import PANEL, pack
        self.w = np.ascontiguousarray(w, np.float32)
        self.k, self.n = self.w.shape
        self.lib = lib if lib is not None and self.n % PANEL == 0 else None
        self.packed = pack(self.w.T.astype(np.float16)) if self.lib is not None else None  # (N/PANEL, K, PANEL)

    def __call__(self, x: np.ndarray) -> np.ndarray:  # (K,) or (T, K) -> (N,) or (T, N)
        if self.lib is None:
            return _mm(x, self.w)
        rows = np.ascontiguousarray(np.atleast_2d(x), np.float32)
        if rows.shape[1] != self.k:
            raise ValueError(f"attention head product: x has {rows.shape[1]} columns, the matrix {self.k} rows")
        y = np.empty((len(rows), self.n), np.float32)
        for t in range(0, len(rows), ROWS_PER_CALL):
            n = min(ROWS_PER_CALL, len(rows) - t)
            rc = self.lib.es_rows_f16(rows[t:].ctypes.data, n, self.packed.ctypes.data, self.k, self.n,
                                      y[t:].ctypes.data)
            if rc != 0:
                raise RuntimeError(f"es_rows_f16 refused {n} rows x ({self.k}, {self.n}): code {rc}")
        return y[0] if x.ndim == 1 else y


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


class AttnHead:
    """The head with its cache of keys and values: `extend` adds the target's true states, `guess` drafts on. Both
    return z = norm3(r) (H,), from which `propose` gives the id and `state` the guessed hidden state."""

    reads_every_position = True  # the target's state at every position it verified (AttnHeadDraft)
    gives_confidence = False  # proposals come without a probability: no stop_below

    def __init__(self, w: AttnHeadWeights, products: str = "auto"):
        """products: "native" (es_rows_f16; refused where the library does not load), "numpy" (float32, the
        reference), or "auto" (native where it loads)."""
        if products not in PRODUCTS:
            raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
        lib = native_library() if products != "numpy" else None
        if products == "native" and lib is None:
            raise RuntimeError("products='native': native_step.c's library does not build or load here")
        self.products = "native" if lib is not None else "numpy"
        self.w = w
        e, h = w.w_out.shape[1], w.w_out.shape[0]
        self.n, self.d = w.heads, h // w.heads
        w_f = np.ascontiguousarray(w.w_in[:e])  # (E, H)
        self._p = np.ascontiguousarray(w.embed @ w.w_in[e:] + w.b_in)  # (V, H): a token's part of r
        self._a_b = w.b_out @ w_f  # (H,)
        lm_t = w.lm.T
        self._m_b = w.b_out @ lm_t  # (V,)
        self._f = Matrix(w_f, lib)  # (E, H)
        self._a = Matrix(w.w_out @ w_f, lib)  # (H, H)
        self._m = Matrix(w.w_out @ lm_t, lib)  # (H, V)
        self._qkv_m, self._o, self._gu, self._down = (Matrix(m, lib) for m in (w.w_qkv, w.w_o, w.w_gu, w.w_down))
        self._inv = (1.0 / ROPE_THETA ** (np.arange(self.d // 2) / (self.d // 2))).astype(np.float32)  # (d/2,)
        self.keys = np.zeros((0, self.n, self.d), np.float32)  # (P, n, d): positions 0..P-1, true states
        self.values = np.zeros((0, self.n, self.d), np.float32)
        self.calls = 0

    @classmethod
    def load(cls, path: str | Path, products: str = "auto") -> "AttnHead":
        return cls(AttnHeadWeights.load(path), products)

    def reset(self) -> None:
        self.keys, self.values = self.keys[:0], self.values[:0]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x (T, n, d), pos (T,)
        ang = pos[:, None].astype(np.float32) * self._inv[None]  # (T, d/2)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., :self.d // 2], x[..., self.d // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    def _qkv(self, r: np.ndarray, pos: np.ndarray):
        """Residuals (T, H) at positions pos -> q, k, v (T, n, d)."""
        qkv = self._qkv_m(_norm(r, self.w.norm1, self.w.eps)).reshape(len(r), 3, self.n, self.d)
        return self._rope(qkv[:, 0], pos), self._rope(qkv[:, 1], pos), qkv[:, 2]

    def _finish(self, r: np.ndarray, q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """One position's residual (H,) and query (n, d) over keys / values (P, n, d) -> its z (H,)."""
        w = self.w
        s = np.einsum("nd,pnd->np", q, keys) / np.sqrt(self.d)  # (n, P)
        p = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("np,pnd->nd", p / p.sum(-1, keepdims=True), values).reshape(-1)  # (H,)
        r = r + self._o(a)
        gate, up = np.split(self._gu(_norm(r, w.norm2, w.eps)), 2)
        r = r + self._down(silu(gate) * up)
        return _norm(r, w.norm3, w.eps)

    def extend(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The target's true states (T, E) at the next T positions and the tokens emitted from them (T,) -> z after
        the last of them; their keys and values are kept."""
        p0 = len(self.keys)
        r = self._f(np.asarray(states, np.float32)) + self._p[np.asarray(tokens)]
        q, k, v = self._qkv(r, np.arange(p0, p0 + len(r)))
        self.keys, self.values = np.concatenate([self.keys, k]), np.concatenate([self.values, v])
        return self._finish(r[-1], q[-1], self.keys, self.values)

    def guess(self, z: np.ndarray, token: int, keys: np.ndarray, values: np.ndarray):
        """A drafted position: the last z and the token proposed from it, after keys / values (P, n, d) -> (its z,
        keys and values with this position's)."""
        r = (self._a(z) + self._a_b + self._p[token])[None]
        q, k, v = self._qkv(r, np.array([len(keys)]))
        keys, values = np.concatenate([keys, k]), np.concatenate([values, v])
        return self._finish(r[0], q[0], keys, values), keys, values

    def propose(self, z: np.ndarray) -> int:
        self.calls += 1
        return int(np.argmax(self._m(z) + self._m_b))

    def state(self, z: np.ndarray) -> np.ndarray:
        """The guessed hidden state (E,) of a z."""
        return z @ self.w.w_out + self.w.b_out

    def reference_guesses(self, states: np.ndarray, tokens: np.ndarray, drafted: list[int]) -> list[np.ndarray]:
        """Slow and obvious: the guessed states (E,) after true states (T, E) / tokens (T,), then after each drafted
        token fed with the guess before it, unfolded, every position computed from scratch over all so far, in
        float32 numpy products."""
        w, ref = self.w, self if self.products == "numpy" else self._numpy_twin()
        feats, toks, out = [np.asarray(s, np.float32) for s in states], [int(t) for t in tokens], []
        for step in range(len(drafted) + 1):
            r = np.concatenate([np.stack(feats), w.embed[np.array(toks)]], -1) @ w.w_in + w.b_in
            q, k, v = ref._qkv(r, np.arange(len(feats)))
            out.append(ref.state(ref._finish(r[-1], q[-1], k, v)))
            if step < len(drafted):
                feats.append(out[-1])
                toks.append(drafted[step])
        return out

    def _numpy_twin(self) -> "AttnHead":
        """This head on numpy products (made once: its fold reads the (V, E) tables)."""
        if getattr(self, "_twin", None) is None:
            self._twin = AttnHead(self.w, "numpy")
        return self._twin

    def reference_proposal(self, g: np.ndarray) -> int:
        """The proposal from a guessed state (E,), unfolded: its argmax through the LM head."""
        return int(np.argmax(g @ self.w.lm.T))


class AttnHeadDraft(OneSequenceDrafter):
    """The attention head as a Drafter for one greedy sequence. features(p) -> the target's final hidden state at
    position p (the target decoder's last call). It reads every round, γ = 0 ones too (sees_every_round): a round's
    verify call is the only place the states of the positions it commits can be read."""

    sees_every_round = True

    def __init__(self, head: AttnHead, features):
        self.head, self.features = head, features
        self._z = None  # z after the last true position
        head.reset()

    def draft(self, ctx, gamma, out) -> int:
        head, last = self.head, len(ctx) - 2  # the target's states are known at positions <= last
        if last + 1 < len(head.keys) or last < 0:  # not the context the cache holds (a new sequence): start over
            head.reset()
        done = len(head.keys)
        if last >= done:  # the positions the target verified since the last round
            self._z = head.extend(np.stack([self.features(p) for p in range(done, last + 1)]),
                                  np.asarray(ctx[done + 1:last + 2]))
        if self._z is None:
            return 0
        z, keys, values = self._z, head.keys, head.values
        for j in range(gamma):
            out[j] = head.propose(z)
            if j + 1 < gamma:
                z, keys, values = head.guess(z, int(out[j]), keys, values)
        return gamma

    def reset(self, b: int) -> None:
        self.head.reset()
        self._z = None

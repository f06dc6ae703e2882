"""A feature-level text draft (EAGLE-style; Li et al., ICML 2024): a numpy MLP that reads the target's
final hidden state and the token emitted from it, guesses the target's next hidden state, proposes the
next token from that guess, and drafts on from its own guesses. No draft model, no engine call.

For h_t, the target's final hidden state (after its last norm: what its LM head reads) at the position
that emitted token x_{t+1}:
    u_1 = silu(h_t W_h + P[x_{t+1}])                          (H,)   P[x] = e(x) W_e + b_in, e: embeddings
    ĥ_j = u_j W_out + b_out                                    (E,)   the guess of h_{t+j}
    logits_j = ĥ_j L_F^T = u_j M + m                           (K,)   L_F: the target's LM head rows of the
                                                                      head's vocabulary F (K frequent ids)
    d_j = F[argmax logits_j];  u_{j+1} = silu(ĥ_j W_h + P[d_j]) = silu(u_j A + a + P[d_j])
The folded matrices (M = W_out L_F^T, A = W_out W_h) are computed once at load; a proposal is one gather
and two small matrix-vector products, on the calling thread (`mv`). `reference_logits` computes the unfolded formula (slow, obvious).
Trained by export/training/train_text_head.py on the target's own hidden states and greedy choices.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .drafts import OneSequenceDrafter, load_arrays, mv, top

HEAD_FORMAT = 1


def silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))  # x * sigmoid(x), without exp overflow


@dataclass
class TextHeadWeights:
    w_h: np.ndarray  # (E, H) hidden state -> head
    w_e: np.ndarray  # (E, H) token embedding -> head
    b_in: np.ndarray  # (H,)
    w_out: np.ndarray  # (H, E) head -> guessed hidden state
    b_out: np.ndarray  # (E,)
    embed: np.ndarray  # (V, E) the target's input embeddings
    lm: np.ndarray  # (K, E) the target's LM head rows of `vocab`
    vocab: np.ndarray  # (K,) int64 the ids the head can propose

    def __post_init__(self):
        e, h = self.w_h.shape
        self.vocab = np.asarray(self.vocab, np.int64)
        v, k = self.embed.shape[0], len(self.vocab)
        want = {"w_e": (e, h), "b_in": (h,), "w_out": (h, e), "b_out": (e,), "embed": (v, e), "lm": (k, e)}
        bad = [f"{n}: want {s}, got {getattr(self, n).shape}" for n, s in want.items() if getattr(self, n).shape != s]
        if bad:
            raise ValueError("text head weights do not fit together: " + "; ".join(bad))
        if k == 0 or self.vocab.min() < 0 or self.vocab.max() >= v or len(set(self.vocab.tolist())) != k:
            raise ValueError(f"the head's vocabulary must be {k} distinct ids in [0, {v}), got "
                             f"{self.vocab[:8].tolist()}...")

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def check_fits(self, where: str, embed_shape: tuple[int, int], ids: tuple[int, int], target: str) -> None:
        """Refuse a head trained for another target: its embedding table must be `embed_shape` (V, E) and it may
        propose only ids in [ids[0], ids[1]). where: how the error names the head; target: how it names the target."""
        if self.embed.shape != tuple(embed_shape):
            raise ValueError(f"{where} was trained on a target with a {self.embed.shape} embedding table; "
                             f"{target} has {tuple(embed_shape)}")
        lo, hi = ids
        if self.vocab.min() < lo or self.vocab.max() >= hi:
            raise ValueError(f"{where} proposes ids {int(self.vocab.min())}..{int(self.vocab.max())}; the action ids "
                             f"are {lo}..{hi - 1}")

    def save(self, path: str | Path, dtype=np.float16) -> None:
        """Stored as `dtype` (fp16: half the bytes; a draft only proposes, the target decides)."""
        arrays = {f.name: getattr(self, f.name) for f in fields(self)}
        np.savez(path, format=np.int64(HEAD_FORMAT),
                 **{k: v if k == "vocab" else np.asarray(v, dtype) for k, v in arrays.items()})

    @classmethod
    def load(cls, path: str | Path) -> "TextHeadWeights":
        z = load_arrays(path, ["format"] + [f.name for f in fields(cls)], "text draft head")
        if int(z["format"]) != HEAD_FORMAT:
            raise ValueError(f"{path}: text head format {int(z['format'])}, this runtime reads {HEAD_FORMAT}")
        return cls(**{f.name: np.asarray(z[f.name], np.int64 if f.name == "vocab" else np.float32)
                      for f in fields(cls)})


class TextHead:
    """The folded head: `first(h, x)` from a target hidden state, then `next(x)` from its own guesses."""

    reads_every_position = False  # it reads the target's last hidden state only (AttnHead reads each position's)
    gives_confidence = True  # each proposal comes with its probability (stop_below)

    def __init__(self, w: TextHeadWeights):
        self.w = w
        self.vocab = w.vocab
        lm_t = np.ascontiguousarray(w.lm.T)  # (E, K)
        self._p = np.ascontiguousarray(w.embed @ w.w_e + w.b_in)  # (V, H)
        self._w_h = np.ascontiguousarray(w.w_h)
        self._a = np.ascontiguousarray(w.w_out @ w.w_h)  # (H, H)
        self._a_b = w.b_out @ w.w_h  # (H,)
        self._m = np.ascontiguousarray(w.w_out @ lm_t)  # (H, K)
        self._m_b = w.b_out @ lm_t  # (K,)
        self._u = np.zeros(w.b_in.shape[0], np.float32)
        self.calls = 0

    @classmethod
    def load(cls, path: str | Path) -> "TextHead":
        return cls(TextHeadWeights.load(path))

    def first(self, h: np.ndarray, x: int) -> tuple[int, float]:
        """h (E,) the target's hidden state that emitted x -> (the proposed id after x, its probability)."""
        self._u = silu(mv(np.asarray(h, np.float32), self._w_h) + self._p[x])
        return self._propose()

    def next(self, x: int) -> tuple[int, float]:
        """After the head's own proposal x -> (the next proposed id, its probability)."""
        self._u = silu(mv(self._u, self._a) + self._a_b + self._p[x])
        return self._propose()

    def _propose(self) -> tuple[int, float]:
        self.calls += 1
        best, p = top(mv(self._u, self._m) + self._m_b)
        return int(self.vocab[best]), p

    def reference_logits(self, h: np.ndarray, xs: list[int]) -> np.ndarray:
        """The unfolded formula (slow, obvious): h (E,), xs the tokens fed (x_{t+1}, d_1, ...) -> (len(xs), K)."""
        w, out, g = self.w, [], h.astype(np.float64)
        for x in xs:
            u = silu(g @ w.w_h + w.embed[x] @ w.w_e + w.b_in)
            g = u @ w.w_out + w.b_out
            out.append(g @ w.lm.T)
        return np.array(out)


class TextHeadDraft(OneSequenceDrafter):
    """The head as a Drafter for one greedy sequence. `features(ctx)` returns the target's final hidden
    state (E,) at the position that emitted ctx[-1] (the target engine's hidden-state output)."""

    def __init__(self, head: TextHead, features, stop_below: float = 0.0):
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below must be in [0, 1), got {stop_below!r}")
        self.head, self.features, self.stop_below = head, features, stop_below

    def begin(self, prefix: np.ndarray) -> None:
        """A policy's new chunk: nothing to prime (the head reads the target's hidden state each round, so it
        cannot draft before the chunk's prefill: from_prefix False)."""

    def draft(self, ctx, gamma, out) -> int:
        if not gamma:
            return 0
        tok, p = self.head.first(self.features(ctx), ctx[-1])
        for j in range(gamma):
            out[j] = tok
            if p < self.stop_below:
                return j + 1
            if j + 1 < gamma:
                tok, p = self.head.next(tok)
        return gamma

"""FAST action tokens (Pertsch et al. 2025, "FAST: Efficient Action Tokenization for Vision-Language-Action Models"):
a chunk of actions as a short, variable-length sequence of BPE tokens.

    tok, report = FastTokenizer.fit(chunks, scale=10, vocab_size=1024)   # chunks (N, H, D), normalised
    ids = tok.encode(chunk)              # (H, D) -> list of token ids, variable length (no end token)
    chunk2 = tok.decode(ids)             # -> (H, D); |chunk2 - chunk| <= tok.error_bound everywhere
    tok.save(path); FastTokenizer.load(path)

The steps, per chunk x (H steps, D dims; already normalised, e.g. ActionStats.normalize to about [-1, 1]):

    c = DCT-II along time of each dimension (orthonormal: C x with C (H, H) orthogonal)
    q = round(scale c)                   integers; most high-frequency coefficients of a smooth chunk are 0
    s = q flattened frequency-major      (q[0, 0..D-1], q[1, 0..D-1], ...): low frequencies first
    ids = BPE(s)                         each integer one symbol of the alphabet [q_min, q_max], merged by a BPE
                                         vocabulary fitted on demonstrations (the `tokenizers` library)

and back: the ids' symbols, the integers, / scale, the inverse DCT. Rounding moves each coefficient by at most
0.5 / scale and the inverse DCT is orthogonal, so each dimension's error has an L2 norm of at most
0.5 sqrt(H) / scale, and so does its largest element: `error_bound`. Nothing is clipped: a coefficient outside the
fitted alphabet is an error naming it (refit with more data or a smaller scale), and ids that do not decode to
exactly H D integers are an error naming both counts. The end of a chunk is the END token's id (`end_id`), which
the vocabulary holds but encode() does not append: the decoder emits it after a chunk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "edgespec-fast/1"
END = "<end>"  # the token that ends a chunk (a special token of the vocabulary)
BASE = 0x4E00  # the integers' symbols: one Unicode character each, from here (CJK: no whitespace, no specials)


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix (n, n): c = C @ x, x = C.T @ c (scipy.fft.dct(x, norm='ortho'))."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    c = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    c[0] /= np.sqrt(2.0)
    return c


@dataclass(frozen=True)
class FitReport:
    chunks: int
    tokens_per_chunk_mean: float
    tokens_per_chunk_max: int
    coefficients_per_chunk: int  # H D: what a fixed-bin tokenizer spends on every chunk
    max_abs_error: float  # over every fitted chunk, encoded and decoded
    error_bound: float  # 0.5 sqrt(H) / scale (module docstring)
    alphabet: tuple  # (q_min, q_max)


class FastTokenizer:
    def __init__(self, horizon: int, dims: int, scale: float, q_min: int, q_max: int, bpe_json: str):
        if horizon < 1 or dims < 1 or not scale > 0 or q_max < q_min:
            raise ValueError(f"FastTokenizer needs horizon >= 1, dims >= 1, scale > 0 and q_min <= q_max; got "
                             f"{horizon}, {dims}, {scale}, {q_min}..{q_max}")
        from tokenizers import Tokenizer
        self.horizon, self.dims, self.scale, self.q_min, self.q_max = horizon, dims, float(scale), q_min, q_max
        self._bpe_json = bpe_json
        self.bpe = Tokenizer.from_str(bpe_json)
        self.C = dct_matrix(horizon)
        end = self.bpe.token_to_id(END)
        if end is None:
            raise ValueError(f"the BPE vocabulary has no {END!r} token")
        self.end_id = end
        self.vocab_size = self.bpe.get_vocab_size()
        self._symbols = [self.bpe.id_to_token(i) for i in range(self.vocab_size)]

    # -- fitting ---------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, chunks, scale: float = 10.0, vocab_size: int = 1024, min_frequency: int = 2,
            margin: int = 2) -> tuple["FastTokenizer", FitReport]:
        """Fit on demonstrations: chunks (N, H, D) float, normalised. The alphabet is the coefficients' range seen,
        widened by `margin` on each side; the BPE vocabulary (at most vocab_size, END included) is learned on the
        coefficient strings. -> (the tokenizer, its report on the same chunks)."""
        from tokenizers import Tokenizer, models, trainers
        chunks = np.asarray(chunks, np.float64)
        if chunks.ndim != 3 or chunks.shape[0] < 1 or not np.isfinite(chunks).all():
            raise ValueError(f"chunks must be finite (N, H, D) with N >= 1, got shape {chunks.shape}")
        n, h, d = chunks.shape
        q = cls._quantize(chunks, dct_matrix(h), scale)  # (N, H, D) int
        q_min, q_max = int(q.min()) - margin, int(q.max()) + margin
        alphabet = [chr(BASE + i) for i in range(q_max - q_min + 1)]
        strings = ["".join(chr(BASE + int(v) - q_min) for v in row.reshape(-1)) for row in q]
        bpe = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, len(alphabet) + 1), min_frequency=min_frequency,
                                      special_tokens=[END], initial_alphabet=alphabet, show_progress=False)
        bpe.train_from_iterator(strings, trainer=trainer)
        tok = cls(h, d, scale, q_min, q_max, bpe.to_str())
        lengths = [len(tok.encode(c)) for c in chunks]
        err = max(float(np.abs(tok.decode(tok.encode(c)) - c).max()) for c in chunks)
        return tok, FitReport(n, float(np.mean(lengths)), int(max(lengths)), h * d, err, tok.error_bound,
                              (q_min, q_max))

    @staticmethod
    def _quantize(chunks: np.ndarray, C: np.ndarray, scale: float) -> np.ndarray:
        """(..., H, D) -> round(scale C x) along H, int64."""
        return np.rint(np.einsum("kh,...hd->...kd", C, chunks) * scale).astype(np.int64)

    @property
    def error_bound(self) -> float:
        return float(0.5 * np.sqrt(self.horizon) / self.scale)

    # -- encode / decode -------------------------------------------------------------------------------------
    def encode(self, chunk) -> list[int]:
        """(H, D) normalised actions -> token ids (variable length; END not appended)."""
        x = np.asarray(chunk, np.float64)
        if x.shape != (self.horizon, self.dims) or not np.isfinite(x).all():
            raise ValueError(f"a chunk must be finite ({self.horizon}, {self.dims}), got shape {x.shape}")
        q = self._quantize(x, self.C, self.scale).reshape(-1)
        out = (q < self.q_min) | (q > self.q_max)
        if out.any():
            i = int(np.argmax(out))
            raise ValueError(f"DCT coefficient {i} (frequency {i // self.dims}, dim {i % self.dims}) is {int(q[i])} "
                             f"after scaling, outside the fitted alphabet {self.q_min}..{self.q_max}: refit on "
                             f"data that covers it, or with a smaller scale (now {self.scale})")
        text = "".join(chr(BASE + int(v) - self.q_min) for v in q)
        return self.bpe.encode(text).ids

    def coefficients(self, ids) -> np.ndarray:
        """Token ids (END, if last, ignored) -> the (H, D) scaled integer coefficients; ValueError naming what is
        wrong when the ids are not a whole chunk."""
        ids = [int(i) for i in ids]
        if ids and ids[-1] == self.end_id:
            ids = ids[:-1]
        bad = [i for i in ids if not 0 <= i < self.vocab_size or i == self.end_id]
        if bad:
            raise ValueError(f"FAST ids must be in 0..{self.vocab_size - 1} with {END} ({self.end_id}) only last; "
                             f"got {bad[:5]}")
        text = "".join(self._symbols[i] for i in ids)
        n = self.horizon * self.dims
        if len(text) != n:
            raise ValueError(f"FAST ids decode to {len(text)} coefficients; a chunk is {self.horizon} x {self.dims} "
                             f"= {n}")
        return (np.array([ord(ch) - BASE for ch in text], np.int64) + self.q_min).reshape(self.horizon, self.dims)

    def decode(self, ids) -> np.ndarray:
        """Token ids -> (H, D) normalised actions (the inverse DCT of the coefficients / scale)."""
        return self.C.T @ (self.coefficients(ids) / self.scale)

    # -- files -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "horizon": self.horizon, "dims": self.dims, "scale": self.scale,
                "q_min": self.q_min, "q_max": self.q_max, "bpe": json.loads(self._bpe_json)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "FastTokenizer":
        d = json.loads(Path(path).read_text())
        if d.get("format") != FORMAT:
            raise ValueError(f"{path}: format {d.get('format')!r}, expected {FORMAT!r}")
        return cls(d["horizon"], d["dims"], d["scale"], d["q_min"], d["q_max"], json.dumps(d["bpe"]))

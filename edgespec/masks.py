"""What a call tells the graph about which cache rows to see: `step_inputs` by the engine's flavour, and the
additive attention-bias builders (the portable contract's `attention_bias`, shape [B, 1, S, P]).

The P key slots are the bound cache rows. Sequence b has L[b] committed rows; its S new tokens sit at
positions (= rows) L[b] .. L[b]+S-1, written there by the call itself. Query s of row b sees the committed
rows and the new rows up to its own; every other row is stale and masked.
"""
from __future__ import annotations

import numpy as np

from . import contract as C
from .contract import MASKED


_TRI: dict[int, np.ndarray] = {}  # S -> (S, S) causal block of 0 / MASKED


def _check(lengths: np.ndarray, seq: int, rows: int) -> None:
    if int(lengths.max()) + seq > rows:
        raise ValueError(f"committed lengths {lengths.tolist()} plus {seq} new tokens exceed the bound cache "
                         f"rows ({rows})")


def causal_bias(lengths: np.ndarray, seq: int, rows: int, sliding_window: int | None = None,
                valid: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """lengths (B,) committed rows per sequence; seq S new tokens; rows P bound cache rows (>= L + S).

    valid (B, S) bool, optional: False marks padding among the new tokens (masked as keys; a padded
    query also sees itself, so its softmax stays finite). Returns float32 (B, 1, S, P).
    The common case (no window, no padding) is a few slice assignments; everything else goes through
    `causal_bias_reference`, which the tests compare it with.
    """
    lengths = np.asarray(lengths)
    if sliding_window is not None or valid is not None:
        return causal_bias_reference(lengths, seq, rows, sliding_window, valid, out)
    _check(lengths, seq, rows)
    if out is None:
        out = np.empty((len(lengths), 1, seq, rows), dtype=np.float32)
    out.fill(MASKED)
    tri = _TRI.get(seq)
    if tri is None:
        tri = _TRI[seq] = np.where(np.tri(seq, dtype=bool), np.float32(0.0), np.float32(MASKED))
    for i, n in enumerate(lengths.tolist()):
        out[i, 0, :, :n] = 0.0
        out[i, 0, :, n:n + seq] = tri
    return out


def causal_bias_reference(lengths: np.ndarray, seq: int, rows: int, sliding_window: int | None = None,
                          valid: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The slow, obvious construction (boolean masks, then one np.where); handles every case."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, seq, rows)
    b = lengths.shape[0]
    q_pos = lengths[:, None] + np.arange(seq)[None, :]  # (B, S) absolute query positions
    k_pos = np.arange(rows)[None, None, :]  # (1, 1, P) row r holds position r
    ok = k_pos <= q_pos[:, :, None]  # (B, S, P) causal: committed rows and the new ones up to itself
    if valid is not None:
        valid = np.asarray(valid, dtype=bool)
        new = k_pos - lengths[:, None, None]  # (B, 1, P) index of row r among the new tokens
        is_new = (new >= 0) & (new < seq)
        key_valid = np.where(is_new, valid[np.arange(b)[:, None, None], np.clip(new, 0, seq - 1)], True)
        ok &= key_valid  # padded keys are hidden ...
        ok |= (k_pos == q_pos[:, :, None]) & ~valid[:, :, None]  # ... but a padded query sees itself
    if sliding_window is not None:
        ok &= (q_pos[:, :, None] - k_pos) < sliding_window
    ok = ok[:, None]  # (B, 1, S, P)
    if out is None:
        out = np.empty(ok.shape, dtype=np.float32)
    np.copyto(out, np.where(ok, np.float32(0.0), np.float32(MASKED)))
    return out


def query_lengths(valid: np.ndarray | None, batch: int, seq: int) -> np.ndarray:
    """(B,) int64 real tokens per sequence among the S new ones. valid (B, S) bool must be right padding (each
    row True then False): the ort flavour's GroupQueryAttention only takes counts."""
    if valid is None:
        return np.full(batch, seq, dtype=np.int64)
    valid = np.asarray(valid, dtype=bool)
    counts = valid.sum(1).astype(np.int64)
    if valid.shape != (batch, seq) or (valid != (np.arange(seq)[None, :] < counts[:, None])).any():
        raise ValueError(f"valid must be ({batch}, {seq}) right padding (each row True, then False) for an ort-flavour "
                         f"engine; got {valid.astype(int).tolist()}")
    return counts


def step_inputs(manifest, lengths: np.ndarray, seq: int, rows: int, valid: np.ndarray | None = None) -> dict:
    """The small inputs of one call, by contract name: S new tokens per sequence at rows lengths[b].. of a cache
    bound with `rows` rows (P).
        portable: position_ids (B, S) int64, attention_bias (B, 1, S, P) float32 (causal_bias)
        ort:      seqlens_k (B,) int32 = L + Q - 1, query_seqlens (B,) int32 = Q, total_sequence_length () int32
    A sequence with no real token (Q = 0) on an empty cache feeds its first padding row as Q = 1 (GQA needs
    seqlens_k >= 0); that row is never committed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if manifest.flavor == "ort":
        _check(lengths, seq, rows)
        q = query_lengths(valid, len(lengths), seq)
        q = np.where((q == 0) & (lengths == 0), 1, q)
        total = lengths + q
        return {C.SEQLENS_K: (total - 1).astype(np.int32), C.QUERY_SEQLENS: q.astype(np.int32),
                C.TOTAL_SEQUENCE_LENGTH: np.array(total.max(), dtype=np.int32)}
    pos = lengths[:, None] + np.arange(seq, dtype=np.int64)[None, :]  # (B, S)
    return {C.POSITION_IDS: pos, C.ATTENTION_BIAS: causal_bias(lengths, seq, rows, manifest.sliding_window, valid)}


def step_inputs_into(manifest, lengths: np.ndarray, seq: int, rows: int, valid: np.ndarray | None,
                     out: dict) -> None:
    """step_inputs written in place into `out`'s arrays (the decoder's bound inputs, shaped as step_inputs
    returns them). The common call, an ort-flavour engine with every new token real, is three small writes;
    every other call copies step_inputs' result (the reference: tests compare the two)."""
    if manifest.flavor == "ort" and valid is None:
        top = int(lengths.max())
        if top + seq > rows:
            _check(lengths, seq, rows)
        np.add(lengths, seq - 1, out=out[C.SEQLENS_K], casting="unsafe")
        out[C.QUERY_SEQLENS].fill(seq)
        out[C.TOTAL_SEQUENCE_LENGTH].fill(top + seq)
        return
    for name, value in step_inputs(manifest, lengths, seq, rows, valid).items():
        out[name][...] = value


def one_step_into(manifest, pos: int, rows: int, out: dict) -> None:
    """step_inputs_into for one sequence and one new token at row `pos` of `rows` bound rows (a plain decoding
    step): for the ort flavour three scalar writes, for the portable flavour step_inputs_into."""
    if manifest.flavor == "ort":
        if pos + 1 > rows:
            _check(np.array([pos]), 1, rows)
        out[C.SEQLENS_K][0] = pos
        out[C.QUERY_SEQLENS][0] = 1
        out[C.TOTAL_SEQUENCE_LENGTH][()] = pos + 1
        return
    step_inputs_into(manifest, np.array([pos], np.int64), 1, rows, None, out)

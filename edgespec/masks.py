"""Additive attention-bias builders (the contract's `attention_bias`, shape [B, 1, S, P + S]).

Key slots 0..P-1 are the bound cache buffer (rows >= the committed length L are stale and masked);
slots P..P+S-1 are the S new tokens of this call. Query s of row b sits at position L[b] + s.
"""
from __future__ import annotations

import numpy as np

from .contract import MASKED


_TRI: dict[int, np.ndarray] = {}  # S -> (S, S) causal block of 0 / MASKED


def causal_bias(lengths: np.ndarray, seq: int, past: int, sliding_window: int | None = None,
                valid: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """lengths (B,) committed rows per sequence; seq S new tokens; past P bound buffer rows.

    valid (B, S) bool, optional: False marks padding among the new tokens (masked as keys; a padded
    query also sees itself, so its softmax stays finite). Returns float32 (B, 1, S, P + S).
    The common case (no window, no padding) is a few slice assignments; everything else goes through
    `causal_bias_reference`, which the tests compare it with.
    """
    if sliding_window is not None or valid is not None:
        return causal_bias_reference(lengths, seq, past, sliding_window, valid, out)
    b = len(lengths)
    if out is None:
        out = np.empty((b, 1, seq, past + seq), dtype=np.float32)
    out[:, :, :, :past] = MASKED
    for i, n in enumerate(lengths.tolist()):
        if n > past:
            raise ValueError(f"committed lengths {list(lengths)} exceed the bound cache rows ({past})")
        out[i, 0, :, :n] = 0.0
    tri = _TRI.get(seq)
    if tri is None:
        tri = _TRI[seq] = np.where(np.tri(seq, dtype=bool), np.float32(0.0), np.float32(MASKED))
    out[:, 0, :, past:] = tri
    return out


def causal_bias_reference(lengths: np.ndarray, seq: int, past: int, sliding_window: int | None = None,
                          valid: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The slow, obvious construction (boolean masks, then one np.where); handles every case."""
    lengths = np.asarray(lengths, dtype=np.int64)
    b = lengths.shape[0]
    if np.any(lengths > past):
        raise ValueError(f"committed lengths {lengths.tolist()} exceed the bound cache rows ({past})")
    q_pos = lengths[:, None] + np.arange(seq)[None, :]  # (B, S) absolute query positions
    k_pos_past = np.broadcast_to(np.arange(past)[None, :], (b, past))  # (B, P)
    ok_past = k_pos_past[:, None, :] < lengths[:, None, None]  # (B, 1->S, P) committed rows only
    ok_past = np.broadcast_to(ok_past, (b, seq, past))
    ok_new = np.broadcast_to(np.tri(seq, dtype=bool)[None], (b, seq, seq))  # causal among new tokens
    if sliding_window is not None:
        ok_past = ok_past & ((q_pos[:, :, None] - k_pos_past[:, None, :]) < sliding_window)
        ok_new = ok_new & ((np.arange(seq)[:, None] - np.arange(seq)[None, :]) < sliding_window)[None]
    if valid is not None:
        valid = np.asarray(valid, dtype=bool)
        ok_new = ok_new & valid[:, None, :]
        ok_new = ok_new | (np.eye(seq, dtype=bool)[None] & ~valid[:, :, None])
    ok = np.concatenate([ok_past, ok_new], axis=-1)[:, None]  # (B, 1, S, P+S)
    if out is None:
        out = np.empty(ok.shape, dtype=np.float32)
    np.copyto(out, np.where(ok, np.float32(0.0), np.float32(MASKED)))
    return out


def tree_bias(length: int, past: int, parents: list[int]) -> np.ndarray:
    """Bias for a token tree of S nodes (batch 1): node s attends to the committed rows and its ancestors.

    parents[s] is the index of node s's parent among the new tokens, or -1 for a root.
    Returns float32 (1, 1, S, P + S).
    """
    s = len(parents)
    ok_new = np.eye(s, dtype=bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree parents must point to earlier nodes; node {i} has parent {p}")
        if p >= 0:
            ok_new[i] |= ok_new[p]
    ok_past = np.broadcast_to(np.arange(past)[None, :] < length, (s, past))
    ok = np.concatenate([ok_past, ok_new], axis=-1)[None, None]
    return np.where(ok, np.float32(0.0), np.float32(MASKED))

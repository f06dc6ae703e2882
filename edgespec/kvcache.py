"""The KV cache: one buffer per layer for keys and one for values, and a committed length per sequence.

    buffers[2i], buffers[2i+1]: keys / values of layer i, each (B, Hkv, capacity, D), on the engine's device

Row r of sequence b holds position r. Rows 0..lengths[b]-1 are committed. An engine call writes its S new
rows in place at the committed length (the decoder binds each `present` output to the buffer it reads as
`past`); the caller then `commit`s the rows it keeps. Rows past the committed length are stale: masked,
overwritten by later calls, never cleared or copied (except the rows of a call whose outputs were not
finite, which are zeroed so that the cache only ever holds finite values). Rolling back (`rewind_to`)
lowers the length: O(1). The buffers grow in chunks as the live context grows (amortised O(1) per
token), so a step binds about as many rows as the context holds, not the engine's full capacity. With
`doubling` they grow to the next power of two instead (TensorRT: each size is a new set of CUDA graphs, so few
sizes, and a call binds at most twice the live rows).

Nothing outside this class changes `lengths`: the verbs are `reserve`, `commit` and `rewind_to`.

Backends that may not bind one buffer as both an input and an output (TensorRT: its I/O tensors must not
alias) get `in_place=False`: two buffer sets, read from `buffers`, written to `out_buffers` (the graph's
ScatterND copies the bound rows and adds the new ones), swapped after each call. That costs one
device-side copy of the bound rows per call; rolling back is still lowering the length.
"""
from __future__ import annotations

import numpy as np

from .memory import Buffer, HostMemory

GROW_CHUNK = 128  # rows added per reallocation


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_context: int,
                 dtype="float32", memory: HostMemory | None = None, chunk: int = GROW_CHUNK,
                 in_place: bool = True, capacity: int | None = None, doubling: bool = False):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.shape = (batch, kv_heads, head_dim)
        self.num_layers, self.max_context, self.chunk = num_layers, max_context, chunk
        self.doubling = doubling  # grow to the next power of two (>= chunk) rather than the next chunk
        self.dtype = np.dtype(dtype)
        self.memory = memory or HostMemory()
        self._set_lengths(np.zeros(batch, dtype=np.int64))  # committed rows per sequence
        self._written = np.zeros(batch, dtype=np.int64)  # rows holding values the last calls wrote
        self.generation = 0  # bumps whenever buffers are reallocated (bindings must be renewed)
        self.in_place = in_place
        b, h, d = self.shape
        rows = min(capacity or chunk, max_context)  # capacity: a fixed size from the start (CUDA graphs)
        self._sets = [[self.memory.zeros((b, h, rows, d), self.dtype) for _ in range(2 * num_layers)]
                      for _ in range(1 if in_place else 2)]
        self.parity = 0  # which set holds the cache (flips after every call when not in place)

    @property
    def buffers(self) -> list[Buffer]:
        """The cache: per layer key, value (B, Hkv, capacity, D). A call reads these as `past`."""
        return self._sets[self.parity]

    @property
    def out_buffers(self) -> list[Buffer]:
        """Where a call writes `present`: the same buffers when in place, else the other set."""
        return self._sets[self.parity ^ 1] if not self.in_place else self._sets[0]

    def _set_lengths(self, new: np.ndarray) -> None:
        self._lengths = new
        self._view = new.view()
        self._view.flags.writeable = False

    @property
    def lengths(self) -> np.ndarray:
        """(B,) committed rows per sequence (a read-only view)."""
        return self._view

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    @property
    def batch(self) -> int:
        return self.shape[0]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows per sequence (grow in chunks, never past max_context)."""
        if rows > self.max_context:
            raise ValueError(f"KV cache needs {rows} rows but the engine's max context is {self.max_context}")
        if rows > self.capacity:
            step = max(self.chunk, 1 << (rows - 1).bit_length()) if self.doubling else -(-rows // self.chunk) * self.chunk
            new = min(self.max_context, step)
            self._sets = [[self.memory.grow(buf, new) for buf in bufs] for bufs in self._sets]
            self.generation += 1

    def wrote(self, s: int) -> None:
        """An engine call wrote S rows per sequence at the committed lengths into `out_buffers` (the decoder
        calls this); those are the cache from now on."""
        self._written = self._lengths + s
        if not self.in_place:
            self.parity ^= 1

    def zero_written(self, s: int) -> None:
        """Zero the S rows per sequence the last call wrote at the committed lengths: after a call whose
        outputs were not finite, so the cache never holds NaN or inf (a masked row weighs 0, and 0 x NaN is
        NaN)."""
        for buf in self.buffers:
            for b, n in enumerate(self._lengths.tolist()):
                self.memory.zero_rows(buf, b, n, n + s)

    def commit(self, n) -> None:
        """Keep n (int, or (B,) per sequence) more rows of what the last calls wrote."""
        new = self._lengths + n
        if (new < self._lengths).any() or (new > self._written).any():
            raise ValueError(f"commit({np.asarray(n).tolist()}): committed {self._lengths.tolist()} rows, "
                             f"written up to {self._written.tolist()}; can keep 0..{(self._written - self._lengths).tolist()}")
        self._set_lengths(new)

    def rewind_to(self, lengths) -> None:
        """Lower the committed lengths (int, or (B,) per sequence) to `lengths`; later rows become stale."""
        new = np.broadcast_to(np.asarray(lengths, dtype=np.int64), self._lengths.shape).copy()
        if np.any(new < 0) or np.any(new > self._lengths):
            raise ValueError(f"rewind_to({np.asarray(lengths).tolist()}): lengths must be in 0..{self._lengths.tolist()}")
        self._set_lengths(new)
        self._written = new.copy()

    def host(self, j: int) -> np.ndarray:
        """Buffer j as a host array (B, Hkv, capacity, D): the array itself on the CPU, a copy on a device."""
        return self.memory.to_host(self.buffers[j])

    def rows(self, b: int, n: int | None = None) -> list[np.ndarray]:
        """Committed rows of sequence b (for tests): per buffer (Hkv, n, D), host copies."""
        n = int(self._lengths[b]) if n is None else n
        return [self.host(j)[b, :, :n].copy() for j in range(len(self.buffers))]

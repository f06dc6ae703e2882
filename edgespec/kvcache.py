"""The KV cache: one buffer per layer for keys and one for values, and a committed length per sequence.

    buffers[2i], buffers[2i+1]: keys / values of layer i, each (B, Hkv, capacity, D), float32

Rows 0..lengths[b]-1 of sequence b are committed. Rows past that are stale: masked by the attention
bias, overwritten by later writes, never cleared or copied. Rolling back is lowering `lengths` (O(1)).
The buffer grows in chunks as the live context grows (amortised O(1) per token), so a step binds
about as many rows as the context holds, not the engine's full capacity.
"""
from __future__ import annotations

import numpy as np

GROW_CHUNK = 128  # rows added per reallocation


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_context: int,
                 dtype=np.float32, chunk: int = GROW_CHUNK):
        self.shape = (batch, kv_heads, head_dim)
        self.num_layers, self.max_context, self.dtype, self.chunk = num_layers, max_context, dtype, chunk
        self.lengths = np.zeros(batch, dtype=np.int64)  # committed rows per sequence
        self.buffers: list[np.ndarray] = []
        self.generation = 0  # bumps whenever buffers are reallocated (bindings must be renewed)
        self._alloc(min(chunk, max_context))

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def _alloc(self, rows: int) -> None:
        b, h, d = self.shape
        new = [np.zeros((b, h, rows, d), dtype=self.dtype) for _ in range(2 * self.num_layers)]
        for old, buf in zip(self.buffers, new):
            keep = min(old.shape[2], rows)
            buf[:, :, :keep] = old[:, :, :keep]
        self.buffers = new
        self.generation += 1

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows per sequence (grow in chunks, never past max_context)."""
        if rows > self.max_context:
            raise ValueError(f"KV cache needs {rows} rows but the engine's max context is {self.max_context}")
        if rows > self.capacity:
            self._alloc(min(self.max_context, -(-rows // self.chunk) * self.chunk))

    def write(self, presents: list[np.ndarray], at: np.ndarray) -> None:
        """presents[2i], [2i+1]: (B, Hkv, S, D) new rows of layer i, written at rows at[b]..at[b]+S-1."""
        s = presents[0].shape[2]
        if len(at) == 1 or np.all(at == at[0]):
            a = int(at[0])
            for buf, new in zip(self.buffers, presents):
                buf[:, :, a:a + s] = new
        else:
            for b, a in enumerate(at.tolist()):
                for buf, new in zip(self.buffers, presents):
                    buf[b, :, a:a + s] = new[b]

    def rows(self, b: int, n: int | None = None) -> list[np.ndarray]:
        """Committed rows of sequence b (for tests): per buffer (Hkv, n, D)."""
        n = int(self.lengths[b]) if n is None else n
        return [buf[b, :, :n] for buf in self.buffers]

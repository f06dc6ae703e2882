"""A contract decoder bound to its KV cache: `Decoder(tokens)` runs S new tokens per sequence.

ONNX Runtime IOBinding over preallocated arrays, one binding per S (new tokens per call): its outputs
(logits and the new K/V rows) are arrays kept for that S and its cache inputs are bound once per cache
reallocation, so a call binds only its three small inputs — also when S changes from call to call, as
in speculative rounds — and a steady decode allocates nothing large. The call writes the new rows into the cache at the committed lengths but does not commit them:
the caller sets `cache.lengths` to what it keeps.
"""
from __future__ import annotations

import time

import numpy as np

from . import contract as C
from .compat import compat_call
from .engine import OrtEngine
from .kvcache import KVCache
from .masks import causal_bias


class Decoder:
    def __init__(self, engine: OrtEngine, batch: int = 1, embedding: np.ndarray | None = None):
        import onnxruntime as ort

        self.engine, self.m = engine, engine.manifest
        m = self.m
        self.batch = batch
        self.cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context)
        self._ort = ort
        self._bindings: dict[int, list] = {}  # S -> [IOBinding, cache generation bound, logits, presents, OrtValues]
        self._cache_ovs: tuple[int, list] = (-1, [])  # (generation, OrtValues of the cache buffers)
        self.embedding = embedding  # (V, E) for inputs_embeds engines
        self.calls = 0
        self.engine_s = 0.0  # wall time inside the engine's run (the rest of a call is host overhead)
        self.kv_write_s = 0.0  # copying the new rows into the cache
        self.trace: list | None = None  # (name, start, end) events when profiling
        self.trace_name = "engine"

    @property
    def vocab_size(self) -> int:
        return self.m.vocab_size

    @property
    def max_context(self) -> int:
        return self.m.max_context

    def _binding(self, s: int) -> tuple:
        """-> (IOBinding for S new tokens with outputs and the current cache bound, logits, presents)."""
        entry = self._bindings.get(s)
        if entry is None:
            b, m = self.batch, self.m
            logits = np.empty((b, s, m.vocab_size), np.float32)
            presents = [np.empty((b, m.num_kv_heads, s, m.head_dim), np.float32) for _ in range(2 * m.num_layers)]
            bind = self.engine.session.io_binding()
            ovs = [self._ort.OrtValue.ortvalue_from_numpy(a) for a in [logits] + presents]  # kept alive below
            for name, ov in zip(self.engine.output_names, ovs):
                bind.bind_ortvalue_output(name, ov)
            entry = self._bindings[s] = [bind, -1, logits, presents, ovs]
        gen = self.cache.generation
        if entry[1] != gen:
            if self._cache_ovs[0] != gen:
                self._cache_ovs = (gen, [self._ort.OrtValue.ortvalue_from_numpy(a) for a in self.cache.buffers])
            ovs = self._cache_ovs[1]
            for i in range(self.m.num_layers):
                entry[0].bind_ortvalue_input(C.past_key(i), ovs[2 * i])
                entry[0].bind_ortvalue_input(C.past_value(i), ovs[2 * i + 1])
            entry[1] = gen
        return entry[0], entry[2], entry[3]

    def __call__(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
                 embeds: np.ndarray | None = None) -> np.ndarray:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1 -> logits (B, S, V).

        valid (B, S) bool marks real tokens when sequences feed different counts (right padding).
        embeds (B, S, E) float32 replaces `tokens` on inputs_embeds engines (a VLA encoder's prefix).
        The returned array is reused by the next call with the same S: read it before then.
        """
        if self.m.kind == "optimum":
            return compat_call(self, tokens, valid)
        if embeds is not None:
            if self.m.input_mode != "embeds" or embeds.ndim != 3 or embeds.shape[2] != self.m.hidden_size:
                raise ValueError(f"embeds must be (B, S, {self.m.hidden_size}) for an inputs_embeds engine; "
                                 f"got {embeds.shape} for a {self.m.input_mode!r} engine")
            tokens = np.zeros(embeds.shape[:2], np.int64)
        b, s = tokens.shape
        cache = self.cache
        cache.reserve(int(cache.lengths.max()) + s)
        bind, logits, presents = self._binding(s)
        pos = cache.lengths[:, None] + np.arange(s, dtype=np.int64)[None, :]  # (B, S)
        bias = causal_bias(cache.lengths, s, cache.capacity, self.m.sliding_window, valid)  # (B, 1, S, P+S)
        first = np.ascontiguousarray(tokens, dtype=np.int64)
        if embeds is not None:
            first = np.ascontiguousarray(embeds, dtype=np.float32)
        elif self.m.input_mode == "embeds":
            first = self.embedding[first]
        bind.bind_cpu_input(self.m.inputs[0].name, first)
        bind.bind_cpu_input(C.POSITION_IDS, pos)
        bind.bind_cpu_input(C.ATTENTION_BIAS, bias)
        t0 = time.perf_counter()
        self.engine.session.run_with_iobinding(bind)
        t1 = time.perf_counter()
        cache.write(presents, cache.lengths)
        t2 = time.perf_counter()
        self.engine_s += t1 - t0
        self.kv_write_s += t2 - t1
        self.calls += 1
        if self.trace is not None:
            self.trace.append((f"{self.trace_name}.run S={s}", t0, t1))
            self.trace.append((f"{self.trace_name}.kv_write", t1, t2))
        return logits

    def reference_call(self, tokens: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """The same as __call__ through plain `session.run` (slow, obvious): for tests."""
        b, s = tokens.shape
        cache = self.cache
        cache.reserve(int(cache.lengths.max()) + s)
        feeds = {self.m.inputs[0].name: tokens.astype(np.int64) if self.m.input_mode == "ids"
                 else self.embedding[tokens],
                 C.POSITION_IDS: cache.lengths[:, None] + np.arange(s, dtype=np.int64)[None, :],
                 C.ATTENTION_BIAS: causal_bias(cache.lengths, s, cache.capacity, self.m.sliding_window, valid)}
        for i in range(self.m.num_layers):
            feeds[C.past_key(i)] = cache.buffers[2 * i]
            feeds[C.past_value(i)] = cache.buffers[2 * i + 1]
        out = self.engine.run(feeds)
        cache.write([out[n] for n in self.engine.output_names[1:]], cache.lengths)
        return out[C.LOGITS]

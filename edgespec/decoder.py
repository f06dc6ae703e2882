"""A contract decoder bound to its KV cache: `Decoder(tokens)` runs S new tokens per sequence.

ONNX Runtime IOBinding, one binding per S (new tokens per call). Everything large stays where the engine
runs (host memory on the CPU provider, CUDA memory on the CUDA and TensorRT providers):
- each layer's cache buffer is bound as `past` and as `present`, so the graph writes the S new rows into
  the cache in place at the committed lengths: nothing is copied after the call;
- `logits` and `next_ids` are bound to buffers kept per S; only what the caller asks for comes back to the
  host: `ids()` copies S ids per sequence, `__call__` / `last_logits()` the S x V logits.
- the inputs are host arrays bound once per binding; a call writes its ids (or embeds) and its small inputs
  into them in place (the manifest's flavour says which: position_ids and attention_bias, or
  GroupQueryAttention's seqlens_k, query_seqlens and total_sequence_length; masks.step_inputs builds both),
  so a call makes no new binding, also when S changes from call to call, as in speculative rounds. Bindings
  are renewed when the cache grows. The call writes the new rows but does not
commit them: the caller keeps what it accepts with `cache.commit(n)`.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import contract as C
from .compat import compat_call
from .engine import OrtEngine
from .kvcache import KVCache
from .masks import one_step_into, step_inputs, step_inputs_into
from .memory import Buffer, HostMemory, memory_for
from .sampling import check_ids


@dataclass
class _Binding:
    """One IOBinding for S new tokens per sequence: the cache generation it is bound to, its output buffers,
    and the host arrays bound as its inputs (by contract name)."""
    bind: object  # onnxruntime IOBinding
    generation: int
    logits: Buffer  # (B, S, V)
    ids: Buffer  # (B, S) int64
    hidden: Buffer | None  # (B, S, E) on --hidden engines
    inputs: dict  # name -> np.ndarray


class Decoder:
    def __init__(self, engine: OrtEngine, batch: int = 1, embedding: np.ndarray | None = None,
                 memory: HostMemory | None = None):
        self.engine, self.m = engine, engine.manifest
        m = self.m
        self.batch = batch
        self.memory = memory or memory_for(engine.provider)
        self.cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context, m.cache_dtype,
                             self.memory, in_place=engine.provider != "tensorrt")  # TensorRT: I/O never alias
        self._bindings: dict[tuple, _Binding] = {}  # (S, parity) -> its binding
        self._last: _Binding | None = None  # the binding of the last call (its outputs are still in place)
        self.last_start = np.zeros(batch, np.int64)  # (B,) the cache length before the last call
        self._ids_host: np.ndarray | None = None  # the last call's next_ids on the host, once fetched
        self.embedding = embedding  # (V, E) for inputs_embeds engines
        self.calls = 0
        self.engine_s = 0.0  # wall time inside the engine's run (the rest of a call is host overhead)
        self.trace: list | None = None  # (name, start, end) events when profiling
        self.trace_name = "engine"

    @property
    def vocab_size(self) -> int:
        return self.m.vocab_size

    @property
    def max_context(self) -> int:
        return self.m.max_context

    def reset(self) -> None:
        """Empty cache (rewound to 0, buffers and bindings kept), zero counters, no trace."""
        self.cache.rewind_to(0)
        self.calls, self.engine_s, self.trace, self.trace_name = 0, 0.0, None, "engine"
        self._last, self._ids_host = None, None

    def _binding(self, s: int) -> _Binding:
        """The binding for S new tokens per sequence, bound to the current cache (renewed after it grows)."""
        key = (s, self.cache.parity)
        entry = self._bindings.get(key)
        mem = self.memory
        if entry is None:
            b, m = self.batch, self.m
            logits, ids = mem.zeros((b, s, m.vocab_size), np.float32), mem.zeros((b, s), np.int64)
            outs = [(C.LOGITS, logits), (C.NEXT_IDS, ids)]
            hidden = mem.zeros((b, s, m.hidden_size), np.float32) if m.has_hidden else None
            if hidden is not None:
                outs.append((C.HIDDEN, hidden))
            bind = self.engine.session.io_binding()
            for name, buf in outs:
                bind.bind_output(name, mem.device, mem.device_id, buf.dtype.type, list(buf.shape), buf.ptr)
            entry = self._bindings[key] = _Binding(bind, -1, logits, ids, hidden, {})
        if entry.generation != self.cache.generation:
            cache, bind = self.cache, entry.bind
            for buf, out, (past, present) in zip(cache.buffers, cache.out_buffers, C.cache_names(self.m.num_layers)):
                # in place: the same memory in and out, so the graph writes the new rows where they belong
                bind.bind_input(past, mem.device, mem.device_id, buf.dtype.type, list(buf.shape), buf.ptr)
                bind.bind_output(present, mem.device, mem.device_id, out.dtype.type, list(out.shape), out.ptr)
            # the call's inputs: host arrays bound once, written in place by every call (their shapes depend
            # on the bound rows for the portable flavour's attention_bias)
            b, first = self.batch, self.m.inputs[0]
            shape, dtype = ((b, s), np.int64) if first.name == C.INPUT_IDS else ((b, s, self.m.hidden_size), np.float32)
            small = step_inputs(self.m, np.zeros(b, np.int64), s, cache.capacity)
            entry.inputs = {first.name: np.zeros(shape, dtype), **{n: np.zeros_like(v) for n, v in small.items()}}
            for name, arr in entry.inputs.items():
                bind.bind_input(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
            entry.generation = cache.generation
        return entry

    def _inputs(self, tokens, valid, embeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A portable engine's -> (first input, position_ids (B, S), attention_bias (B, 1, S, P)) on the host,
        cache reserved (the TensorRT decoder binds these)."""
        first, small = self._prepare(tokens, valid, embeds)
        return first, small[C.POSITION_IDS], small[C.ATTENTION_BIAS]

    def _prepare(self, tokens, valid, embeds) -> tuple[np.ndarray, dict]:
        """-> (first input, the flavour's small inputs by name: masks.step_inputs) on the host, cache reserved."""
        first = self._first(tokens, embeds)
        cache, lengths = self.cache, self.cache.lengths
        cache.reserve(int(lengths.max()) + first.shape[1])
        return first, step_inputs(self.m, lengths, first.shape[1], cache.capacity, valid)

    def _first(self, tokens, embeds) -> np.ndarray:
        """The call's first input on the host: ids (B, S) int64, or embeds (B, S, E) float32, checked."""
        if embeds is not None:
            if self.m.input_mode != "embeds" or embeds.ndim != 3 or embeds.shape[2] != self.m.hidden_size:
                raise ValueError(f"embeds must be (B, S, {self.m.hidden_size}) for an inputs_embeds engine; "
                                 f"got {embeds.shape} for a {self.m.input_mode!r} engine")
            first = np.ascontiguousarray(embeds, dtype=np.float32)
        elif self.m.input_mode == "embeds":
            first = self.embedding[np.asarray(tokens)]
        else:
            first = np.ascontiguousarray(tokens, dtype=np.int64)
        if first.shape[0] != self.batch:
            raise ValueError(f"this decoder runs batches of {self.batch}, got {first.shape[0]} sequences")
        return first

    def run(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None) -> None:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1: one engine call; the new rows land
        in the cache, the outputs stay in the engine's memory (read them with ids() / last_logits()).

        valid (B, S) bool marks real tokens when sequences feed different counts (right padding).
        embeds (B, S, E) float32 replaces `tokens` on inputs_embeds engines (a VLA encoder's prefix).
        """
        first = self._first(tokens, embeds)
        s, cache = first.shape[1], self.cache
        cache.reserve(int(cache.lengths.max()) + s)
        start = cache.lengths.copy()  # (B,) the position of the call's first row
        entry = self._binding(s)
        bind, inputs = entry.bind, entry.inputs
        inputs[self.m.inputs[0].name][...] = first
        step_inputs_into(self.m, start, s, cache.capacity, valid, inputs)
        t0 = time.perf_counter()
        self.engine.session.run_with_iobinding(bind)
        self._called(s, entry, t0, time.perf_counter(), start, valid)

    def _called(self, s: int, last, t0: float, t1: float, start: np.ndarray | None = None,
                valid: np.ndarray | None = None) -> None:
        """After an engine call of S tokens per sequence (t0..t1 inside the engine): the rows it wrote are the
        cache's, `last` holds its outputs (start: (B,) the position of its first row), a row whose outputs are
        not finite is scrubbed, and the counters and the trace move on. Every backend's run() ends here."""
        self.cache.wrote(s)
        self._last, self._ids_host = last, None
        if start is not None:
            self.last_start = start
        self._scrub_if_failed(s, valid)
        self.engine_s += t1 - t0
        self.calls += 1
        if self.trace is not None:
            self.trace.append((f"{self.trace_name}.run S={s}", t0, t1))

    def _scrub_if_failed(self, s: int, valid: np.ndarray | None = None) -> None:
        """A call with NaN or inf logits (next_ids = NONFINITE_ID) in a real (valid) row may have written
        non-finite K/V rows: zero them, so no later call reads them (the caller still sees the failure in its
        outputs). Padding rows' outputs mean nothing (the ort flavour leaves them unspecified)."""
        ids = self.last_ids()
        if valid is not None:
            ids = np.where(valid, ids, 0)
        if ids.min() < 0:
            self.cache.zero_written(s)

    def last_logits(self) -> np.ndarray:
        """(B, S, V) logits of the last call, on the host (on the CPU: the bound array, reused by the next
        call with the same S, so read it before then)."""
        return self.memory.to_host(self._last.logits)

    def hidden_at(self, b: int, position: int) -> np.ndarray:
        """(E,) the final hidden state the last call computed at sequence b's `position` (an engine exported
        with --hidden; the row that predicted the token at position + 1), on the host."""
        if not self.m.has_hidden:
            raise C.EngineError(f"{self.engine.dir}: this engine does not output its hidden state; re-export it "
                                f"with `edgespec export ... --hidden`")
        row = position - int(self.last_start[b])
        if self._last is None or not 0 <= row < self._last.hidden.shape[1]:
            raise ValueError(f"position {position} is not a row of the last call (it wrote rows "
                             f"{int(self.last_start[b])}.. of sequence {b})")
        return self.memory.to_host(self._last.hidden)[b, row]

    def last_ids(self) -> np.ndarray:
        """(B, S) int64 argmax ids of the last call over the manifest's argmax_ids, on the host (copied back
        once per call)."""
        if self._ids_host is None:
            self._ids_host = self._fetch_ids()
        return self._ids_host

    def _fetch_ids(self) -> np.ndarray:
        return self.memory.to_host(self._last.ids)

    def __call__(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
                 embeds: np.ndarray | None = None) -> np.ndarray:
        """run(), then the logits (B, S, V) on the host."""
        if self.m.kind == "optimum":
            return compat_call(self, tokens, valid)
        self.run(tokens, valid, embeds)
        return self.last_logits()

    def ids(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None, last: int | None = None) -> np.ndarray:
        """run(), then only the argmax ids (B, S) come back to the host (greedy and relaxed decoding).
        last: the caller reads only the last `last` positions' ids (a remote target computes only those and
        returns -1 before them; an engine computes every position anyway)."""
        if self.m.kind == "optimum":
            lo, hi = self.m.argmax_range
            return compat_call(self, tokens, valid)[..., lo:hi].argmax(-1) + lo
        self.run(tokens, valid, embeds)
        return self.last_ids()

    def greedy_steps(self, pending: int, n: int) -> Iterator[int]:
        """Plain greedy decoding of one sequence: up to n S=1 calls back to back, the first fed `pending` (the
        sequence's last id, not yet in the cache), each later one the argmax id of the call before; yields
        each call's id. Nothing else may call this decoder until the generator is done or closed (the caller
        may close it after any id); then the cache has committed exactly the rows of the ids it was fed. NaN
        or inf logits: that row is zeroed and FloatingPointError raised.

        Between two calls only the call's id and its small inputs are written, in place, into the one
        binding (the cache is reserved for all n rows first, and its lengths brought up to date at the end):
        the host time between calls also lets ONNX Runtime's worker threads fall asleep, and a thread still
        spinning slows the host's own work. greedy_steps_reference is the same through ids() and commit()
        (tests compare)."""
        if self.batch != 1:
            raise ValueError(f"greedy_steps decodes one sequence; this decoder runs batches of {self.batch}")
        cache, m = self.cache, self.m
        if m.input_mode != "ids" or m.kind == "optimum" or not cache.in_place:
            yield from self.greedy_steps_reference(pending, n)
            return
        start = int(cache.lengths[0])
        cache.reserve(start + n)  # every row now: no regrowth, so one binding serves every call
        entry = self._binding(1)
        inputs, bind, run, to_host = entry.inputs, entry.bind, self.engine.session.run_with_iobinding, self.memory.to_host
        ids_in, capacity = inputs[m.inputs[0].name], cache.capacity  # (1, 1) int64
        tok, kept, ran = pending, 0, 0  # kept: rows whose ids came back finite (committed at the end)
        try:
            for _ in range(n):
                ids_in[0, 0] = tok
                one_step_into(m, start + kept, capacity, inputs)
                t0 = time.perf_counter()
                run(bind)
                t1 = time.perf_counter()
                self.engine_s += t1 - t0
                self.calls += 1
                ran += 1
                if self.trace is not None:
                    self.trace.append((f"{self.trace_name}.run S=1", t0, t1))
                tok = to_host(entry.ids).item(0)
                if tok < 0:  # NONFINITE_ID: this row may hold NaN or inf
                    break
                kept += 1
                yield tok
        finally:
            cache.wrote(kept)
            cache.commit(kept)
            if ran:
                self._last, self._ids_host, self.last_start = entry, None, np.array([start + ran - 1], np.int64)
        if ran > kept:
            cache.wrote(1)
            cache.zero_written(1)
            check_ids(np.array([tok]), "target", start + ran)

    def greedy_steps_reference(self, pending: int, n: int) -> Iterator[int]:
        """greedy_steps through ids() and commit(), one call at a time (slow, obvious; TensorRT, embeds engines)."""
        tok = pending
        for _ in range(n):
            tok = int(self.ids(np.array([[tok]], np.int64))[0, 0])
            check_ids(np.array([tok]), "target", int(self.cache.lengths[0]) + 1)
            self.cache.commit(1)
            yield tok

    def reference_call(self, tokens: np.ndarray, valid: np.ndarray | None = None,
                       embeds: np.ndarray | None = None) -> np.ndarray:
        """The same as __call__ through plain `session.run` on host copies of the cache, whose returned
        `present`s then replace the cache's contents (slow, obvious): for tests."""
        first, small = self._prepare(tokens, valid, embeds)
        feeds = {self.m.inputs[0].name: first, **small}
        names = C.cache_names(self.m.num_layers)
        for j, (past, _) in enumerate(names):
            feeds[past] = self.cache.host(j).copy()
        out = self.engine.run(feeds)
        for j, (_, present) in enumerate(names):
            self.memory.write(self.cache.out_buffers[j], out[present])
        self.cache.wrote(first.shape[1])
        return out[C.LOGITS]

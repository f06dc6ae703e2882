"""The native CPU engine (provider "cpu-native"): one C call per decoder step, float32 math over float16 weights
or blocks of int8 / int4 weights.

A checkpoint stored in float16 (the bundled pair is) is exported to an fp32 ONNX graph whose weights are
those float16 values widened: 4 bytes read per weight and token, where 2 hold the same number. Decoding on
the CPU is bound by reading the weights, so `native_step.c` keeps them as float16, widens each on the fly
(exactly) and accumulates in float32: the same function as the fp32 engine, in another summation order (the
export gate and the tests compare the two), at half the weight bytes per token. int8 and int4 folders carry
integer weights (WEIGHT_KINDS): blocks of 32 values along the input with one float16 scale per block and
output column, w = q * scale, read at 1.06 / 0.56 bytes per weight; the arithmetic stays float32.

    engine folder: engine.json, whose extra["native"] names
                   native.npz   the weights (matrices in packed panels of float16 or of integer blocks:
                                extra["native"]["weights"] and ["head_weights"] say which; float32 norms,
                                biases, rope frequencies and scalings; int64 per-layer rotary index and
                                window), written by `edgespec export` (or `python -m edgespec.export.native`);
                                extra["native"] records its layout (format 2, features, rotary_dim, ropes,
                                activation, weights: expected_shapes reads them)

Every family export/checkpoint.py reads runs here (native_step.c's header lists the per-layer computation);
the load checks native.npz against engine.json (shapes, the features' arrays and no others, the per-layer
windows against layer_windows). A format 1 file (before the families: plain Llama) is read as format 2.

The C source is compiled on first use (native_lib.py); the weights' layout is native_format.py's.
`NativeEngine.decoder(batch)` gives a `Decoder` whose
calls run that step on the same KV cache (B, Hkv, T, D), written in place at the committed lengths: one C
call per decoder call, the batch's rows through each weight matrix together.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..contract import EngineError, Manifest
from ..kvcache import KVCache
from ..memory import Buffer, HostMemory
from .base import Capabilities, Decoder, EmbeddingTable
from .native_folder import NativeFolder, model_struct, read_native
from .native_lib import library
from .providers import default_threads
from .threads import governor_for


class NativeEngine(EmbeddingTable):
    """An engine folder's native weights, ready for `decoder()`; checked against engine.json at load."""

    provider = "cpu-native"

    def __init__(self, engine_dir: str | Path | None, threads: int | None = None, check_hashes: bool = True, *,
                 folder: NativeFolder | None = None):
        """engine_dir's native weights, or `folder`'s (native_folder.in_memory: made where they run)."""
        f = folder if folder is not None else read_native(engine_dir, check_hashes, self.provider)
        self.dir, self.manifest, self.info, self.arrays, self.intermediate = (f.dir, f.manifest, f.info, f.arrays,
                                                                              f.intermediate)
        self.head_rows = f.head_rows  # the step's logits rows: the vocabulary rounded up to whole panels
        for k in ("inv_freq", "rope_scale"):
            self.arrays[k] = np.ascontiguousarray(self.arrays[k], np.float32)
        self.threads = default_threads(threads)  # the most threads a call runs on
        # threads left open: each call's count chosen from measured calls (threads.py), else every call on self.threads
        self.governor = governor_for(threads, self.threads, os.environ.get("EDGESPEC_THREADS"))
        self.lib = library()
        self.model, self._tables = model_struct(f, lambda k: self.arrays[k].ctypes.data)

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None) -> "NativeDecoder":
        """A NativeDecoder for `batch` sequences (`embedding` is never used: an inputs_embeds engine's ids are
        looked up in the folder's table)."""
        return NativeDecoder(self, batch)


class _Outputs:
    """The last call's outputs, shaped like decoder._Binding's (logits, ids, hidden). The step writes `rows`
    logits per token (the lm_head's padded rows); `logits` is the vocabulary's columns of them."""

    def __init__(self, memory: HostMemory, b: int, s: int, m: Manifest, rows: int):
        self.full = memory.zeros((b, s, rows), np.float32)
        v = m.vocab_size
        self.logits = self.full if rows == v else Buffer((b, s, v), self.full.dtype, self.full.ptr,
                                                         self.full.handle[..., :v])
        self.ids = memory.zeros((b, s), np.int64)
        self.hidden = memory.zeros((b, s, m.hidden_size), np.float32) if m.has_hidden else None


class NativeDecoder(Decoder):
    """The Decoder (base.py) over native_step.c: a call is one es_forward over every sequence, each at its own
    committed length (the weights are read once per call, whatever the batch)."""

    def __init__(self, engine: NativeEngine, batch: int = 1):
        m, memory = engine.manifest, HostMemory()
        cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context, "float32", memory)
        super().__init__(engine, batch, memory, cache)
        self.caps = Capabilities(hidden=m.has_hidden, embeds=m.input_mode == "embeds")
        self._outs: dict[int, _Outputs] = {}
        self._scratch, self._scratch_s = np.zeros(0, np.float32), 0  # scratch sized for calls of up to S tokens
        self._pointers: tuple = (-1, [])  # (cache generation, per sequence (key, value) address tables)

    def _prepare_call(self, b: int, s: int, rows: int) -> _Outputs:
        """Room for calls of S tokens per sequence up to `rows` cache rows: the cache reserved, the scratch and
        the outputs sized, the key / value address tables current. -> the outputs of an S-token call."""
        cache, e = self.cache, self.engine
        if rows > cache.capacity or s > self._scratch_s:  # buffers a helper thread of the last call may still
            e.lib.es_quiesce()                            # read are about to be freed
        cache.reserve(rows)
        out = self._outs.get(s)
        if out is None:
            out = self._outs[s] = _Outputs(self.memory, b, s, self.m, e.head_rows)
        if s > self._scratch_s:
            need = e.lib.es_scratch_floats(ctypes.byref(e.model), b * s)
            if self._scratch.size < need:
                self._scratch = np.zeros(need, np.float32)
            self._scratch_s = s
        if self._pointers[0] != cache.generation:  # key / value addresses, sequence-major: [b L + layer]
            L = self.m.num_layers
            keys = [cache.buffers[2 * j].handle[i].ctypes.data for i in range(b) for j in range(L)]
            values = [cache.buffers[2 * j + 1].handle[i].ctypes.data for i in range(b) for j in range(L)]
            self._pointers = (cache.generation, ((ctypes.c_void_p * (b * L))(*keys), (ctypes.c_void_p * (b * L))(*values)))
        return out

    def _forward(self, b: int, s: int, ids: np.ndarray, x_in, start: np.ndarray, out: _Outputs) -> tuple[float, float]:
        """One es_forward of S tokens per sequence at rows start (B,) into `out`, on the governor's thread
        count. -> (t0, t1) around the C call."""
        e, gov = self.engine, self.engine.governor
        ks, vs = self._pointers[1]
        hidden = out.hidden.handle if out.hidden is not None else None
        threads = gov.threads((b, s)) if gov is not None else e.threads
        t0 = time.perf_counter()
        rc = e.lib.es_forward(ctypes.byref(e.model), b, s, ids.ctypes.data,
                              x_in.ctypes.data if x_in is not None else None, start.ctypes.data, ks, vs,
                              self.cache.capacity, out.full.handle.ctypes.data, out.ids.handle.ctypes.data,
                              hidden.ctypes.data if hidden is not None else None, self._scratch.ctypes.data,
                              threads)
        t1 = time.perf_counter()
        if rc == -1:
            raise EngineError(f"native step: rows {start.tolist()} + {s} do not fit the cache's "
                              f"{self.cache.capacity} rows")
        if rc != 0:
            raise MemoryError("native step: could not allocate its scratch")
        if gov is not None:
            gov.observe((b, s), threads, t1 - t0)
        return t0, t1

    def run(self, tokens, valid=None, embeds=None) -> None:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1 (see Decoder.run). Padding tokens
        (valid False) are computed like any token; their rows are never committed."""
        ids, x_in = self._ids_or_rows(tokens, valid, embeds, "cpu-native")  # x_in: an inputs_embeds engine's rows
        b, s = ids.shape
        out = self._prepare_call(b, s, int(self.cache.lengths.max()) + s)
        start = np.ascontiguousarray(self.cache.lengths, np.int64)  # a copy: (B,)
        t0, t1 = self._forward(b, s, ids, x_in, start, out)
        self._called(s, out, t0, t1, start, valid)

    def greedy_steps(self, pending: int, n: int) -> Iterator[int]:
        """Plain greedy decoding of one sequence: up to n S=1 calls back to back, the first fed `pending` (the
        sequence's last id, not yet in the cache), each later one the argmax id of the call before; yields
        each call's id. Nothing else may call this decoder until the generator is done or closed (the caller
        may close it after any id); then the cache has committed exactly the rows of the ids it was fed. NaN
        or inf logits: that row is zeroed and FloatingPointError raised.

        The cache is reserved for all n rows first and its lengths brought up to date at the end; between two
        calls only the id and the row are written (Decoder._steps_back_to_back). run()'s checks and bookkeeping
        cost more here than they seem: each step streams the weights through the caches, so every object Python
        touches after it comes back from DRAM. greedy_steps_reference is the same through ids() and commit()
        (tests compare)."""
        if self.batch != 1:
            raise ValueError(f"greedy_steps decodes one sequence; this decoder runs batches of {self.batch}")
        if self.m.input_mode != "ids":
            yield from self.greedy_steps_reference(pending, n)
            return
        self._check_ids(np.array([pending], np.int64))
        cache = self.cache
        base = int(cache.lengths[0])
        out = self._prepare_call(1, 1, base + n)
        ids, start, next_ids = np.zeros((1, 1), np.int64), np.zeros(1, np.int64), out.ids.handle

        def one(tok: int, row: int) -> tuple[float, float, int]:
            ids[0, 0], start[0] = tok, row
            t0, t1 = self._forward(1, 1, ids, None, start, out)
            return t0, t1, next_ids.item(0)

        yield from self._steps_back_to_back(pending, n, base, one, out)

    def __del__(self):
        try:  # a helper thread may still read this decoder's buffers (native_step.c's pool)
            self.engine.lib.es_quiesce()
        except Exception:  # interpreter shutdown
            pass

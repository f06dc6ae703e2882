"""The native step on an NVIDIA GPU (provider "cuda-native"): the engine folder's native.npz uploaded once, the
KV cache in device memory written in place at the committed lengths, one CUDA graph per S replayed call after
call, and only the argmax ids copied back (the logits and the hidden state when asked for).

    engine = CudaNativeEngine(dir)      # native.npz read and checked as cpu-native reads it (native_folder.py),
                                        # its arrays uploaded as they are (float16 panels, int8 / int4 blocks)
    dec = engine.decoder(batch)         # a Decoder (base.py): the speculative round, the drafts, batches and the
                                        # text head run on it as on any other
    dec.ids(tokens)                     # one call: start and ids into the pinned parameter block, the graph of
                                        # this S launched (captured on first use), the ids read back

A call's kernels read the committed lengths from the parameter block on the device (cuda_step.cu), never from
the launch, so a graph captured once per S stays valid while the lengths move (accept, rewind) and is replayed
unchanged. What a graph does hold are addresses: the cache buffers (allocated at the engine's full max_context,
never grown) and the scratch (sized for `rows` token rows; a call with more rows reallocates it and drops every
graph, recaptured on next use). Calls longer than GRAPH_MAX_S tokens (a long prompt) run without a graph. An
inputs_embeds engine (a VLA policy's decoder) sends its call's rows through a pinned block as well (the folder's
table gives the rows of ids). `profile()` times one call kernel by kernel.

The device is `runtime` (cuda_lib.CudaRuntime over the compiled cuda_step.cu); the tests give the same decoder a
stand-in runtime that answers on the CPU through native_step.c (tests/cuda_standin.py), which checks the
bookkeeping here (the parameter block, buffer layouts, lengths after accept and rewind, graphs and when they
are dropped) against the CPU native step bit for bit; and cuda_step.cu itself runs on the CPU under an emulation of
CUDA (tests/cuda_emu/emu.h, tests/test_cuda_emulated.py).
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..kvcache import KVCache
from ..memory import Buffer
from .base import Capabilities, Decoder, EmbeddingTable
from .cuda_lib import CudaRuntime, _Io
from .native_folder import NativeFolder, device_arrays, model_struct, read_native

GRAPH_MAX_S = 64  # calls of up to this many tokens per sequence replay a CUDA graph; longer ones are enqueued
MIN_ROWS_S = 17  # the scratch holds at least this many tokens per sequence (a verify of γ max 16 + 1)
SPLIT_ROWS = 128  # attention: one split of a row's context per this many rows of the cache's capacity ...
MAX_SPLITS = 32  # ... and at most this many (cuda_step.cu's k_attn: one block per (row, head, split))
ALIGN = 256  # bytes: every scratch array starts on this boundary

_RUNTIMES: dict[int, object] = {}


def runtime(device_id: int = 0):
    """The process's runtime for GPU `device_id` (the library compiled and loaded once). Tests replace this
    function to run the decoder on a stand-in."""
    if device_id not in _RUNTIMES:
        _RUNTIMES[device_id] = CudaRuntime(device_id)
    return _RUNTIMES[device_id]


class CudaNativeEngine(EmbeddingTable):
    """An engine folder's native weights on the GPU, ready for `decoder()`."""

    provider = "cuda-native"

    def __init__(self, engine_dir: str | Path | None, check_hashes: bool = True, device_id: int = 0, rt=None, *,
                 folder: NativeFolder | None = None):
        """engine_dir's native weights, or `folder`'s (native_folder.in_memory: made where they run)."""
        f = folder if folder is not None else read_native(engine_dir, check_hashes, self.provider)
        self.dir, self.manifest, self.info, self.intermediate = f.dir, f.manifest, f.info, f.intermediate
        self.head_rows = f.head_rows  # the step's logits rows: the vocabulary rounded up to whole panels
        self.rt = rt if rt is not None else runtime(device_id)
        for k in ("inv_freq", "rope_scale"):
            f.arrays[k] = np.ascontiguousarray(f.arrays[k], np.float32)
        mem = self.rt.memory
        self.weights: dict[str, Buffer] = {}  # native.npz's arrays on the device, uploaded once
        for k in device_arrays(f):
            self.weights[k] = mem.zeros(f.arrays[k].shape, f.arrays[k].dtype)
            mem.write(self.weights[k], f.arrays[k])
        self.weight_bytes = sum(b.nbytes for b in self.weights.values())
        self.use_graphs = True  # the decoders' default: CUDA graphs per S (False: every call enqueued)
        self.kernel_s = 0.0  # GPU time in the kernels of every call of this engine's decoders
        self.model, self._tables = model_struct(f, lambda k: self.weights[k].ptr)
        # the host copies go; the per-layer tables es_model points to stay
        self._host = {k: f.arrays[k] for k in ("layer_rope", "layer_window")}

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None, graphs: bool | None = None) -> "CudaNativeDecoder":
        """A CudaNativeDecoder for `batch` sequences (`embedding` is never used: an inputs_embeds engine's ids
        are looked up in the folder's table); graphs=False enqueues every call (the device check compares),
        None follows the engine's `use_graphs` at every call."""
        return CudaNativeDecoder(self, batch, graphs)


@dataclass(frozen=True)
class ScratchLayout:
    """Where a decoder's per-call arrays lie in its one device buffer (byte offsets, each ALIGN-aligned), for
    `rows` token rows: cuda_step.cu's ecs_io names them."""
    rows: int
    nsplit: int
    offsets: dict  # name -> (offset, bytes)
    nbytes: int


def scratch_layout(E: int, H: int, Hkv: int, D: int, I: int, V: int, rows: int, nsplit: int) -> ScratchLayout:
    """The scratch for `rows` token rows: x, h, tmp (rows, E); qkv (rows, (H + 2 Hkv) D); q, att (rows, H D);
    mlp (rows, I); part (rows H nsplit, D + 2); logits (rows, V: the lm_head's padded rows) float32; params
    (B + rows, at most 2 rows) and next (rows) int64."""
    f = 4
    sizes = {"x": rows * E * f, "h": rows * E * f, "tmp": rows * E * f, "qkv": rows * (H + 2 * Hkv) * D * f,
             "q": rows * H * D * f, "att": rows * H * D * f, "mlp": rows * I * f,
             "part": rows * H * nsplit * (D + 2) * f, "logits": rows * V * f, "params": 2 * rows * 8,
             "next": rows * 8}
    offsets, at = {}, 0
    for name, n in sizes.items():
        offsets[name] = (at, n)
        at += -(-n // ALIGN) * ALIGN
    return ScratchLayout(rows, nsplit, offsets, at)


def splits_for(capacity: int) -> int:
    """Attention splits for a cache of `capacity` rows: one per SPLIT_ROWS, 1..MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-capacity // SPLIT_ROWS)))


class _Outputs:
    """The last call's outputs: ids on the host, logits and hidden state as device buffers (copied on demand)."""

    def __init__(self, ids: np.ndarray, logits: Buffer, hidden: Buffer | None):
        self.ids, self.logits, self.hidden = ids, logits, hidden


class CudaNativeDecoder(Decoder):
    """The Decoder (base.py) over cuda_step.cu: a call is one graph launch (or one enqueue) over every sequence,
    each at its own committed length."""

    def __init__(self, engine: CudaNativeEngine, batch: int = 1, graphs: bool | None = None):
        m, rt = engine.manifest, engine.rt
        cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context, "float32", rt.memory,
                        capacity=m.max_context)  # full size now: the graphs keep its addresses
        super().__init__(engine, batch, rt.memory, cache)
        self.caps = Capabilities(hidden=m.has_hidden, embeds=m.input_mode == "embeds")
        self.rt, self.use_graphs = rt, graphs  # None: the engine's `use_graphs`, read at every call
        self.graphs: dict[int, object] = {}  # S -> the captured graph of a call of S tokens per sequence
        self.captures = self.launches = self.enqueues = 0
        self.kernel_s = 0.0  # GPU time between the call's first and last kernel, summed over calls
        self._profile: dict | None = None  # set by profile() for one call
        self._stream = rt.stream()
        self._events = (rt.event(), rt.event())
        io = self._io = _Io()
        io.B, io.cap, io.nsplit = batch, cache.capacity, splits_for(cache.capacity)
        io.stream, io.ev0, io.ev1 = self._stream, *self._events
        self._generation = -1
        self._kv_tables()
        self.layout: ScratchLayout | None = None
        self._alloc(batch * MIN_ROWS_S)

    def _kv_tables(self) -> None:
        """io.kc / io.vc: layer l's key and value buffers (B, Hkv, cap, D), from the cache."""
        L, bufs = self.m.num_layers, self.cache.buffers
        self._kc = (ctypes.c_void_p * L)(*[bufs[2 * j].ptr for j in range(L)])
        self._vc = (ctypes.c_void_p * L)(*[bufs[2 * j + 1].ptr for j in range(L)])
        self._io.kc = ctypes.cast(self._kc, ctypes.POINTER(ctypes.c_void_p))
        self._io.vc = ctypes.cast(self._vc, ctypes.POINTER(ctypes.c_void_p))
        self._generation = self.cache.generation
        self._drop_graphs()

    def _alloc(self, rows: int) -> None:
        """Scratch, parameter block and ids for `rows` token rows; every graph dropped (they hold the old
        addresses)."""
        m, e = self.m, self.engine
        self._drop_graphs()
        lay = self.layout = scratch_layout(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, e.intermediate,
                                           e.head_rows, rows, self._io.nsplit)
        self._scratch = self.memory.zeros((lay.nbytes,), np.uint8)
        self._views: dict = {}  # S -> the outputs' buffers in this scratch
        base = self._scratch.ptr
        for name, (off, _) in lay.offsets.items():
            setattr(self._io, name, base + off)
        self._params, self._params_owner = self.rt.pinned(self.batch + rows, np.int64)
        self._next, self._next_owner = self.rt.pinned(rows, np.int64)
        self._io.params_host, self._io.next_host = self._params.ctypes.data, self._next.ctypes.data
        if self.m.input_mode == "embeds":  # the call's input rows, copied to x by the call's first nodes
            self._embeds, self._embeds_owner = self.rt.pinned(rows * m.hidden_size, np.float32)
            self._io.embeds_host = self._embeds.ctypes.data
        self._io.rows = rows

    def _drop_graphs(self) -> None:
        for g in self.graphs.values():
            self.rt.drop(g)
        self.graphs = {}

    def run(self, tokens, valid=None, embeds=None) -> None:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1 (see Decoder.run). Padding tokens
        (valid False) are computed like any token; their rows are never committed."""
        ids, rows = self._ids_or_rows(tokens, valid, embeds, "cuda-native")  # rows: an inputs_embeds engine's
        b, s = ids.shape
        if s < 1:
            raise ValueError(f"a call needs at least one token per sequence, got shape {ids.shape}")
        cache = self.cache
        cache.reserve(int(cache.lengths.max()) + s)  # past max_context: ValueError (the capacity is max_context)
        if cache.generation != self._generation:
            self._kv_tables()
        if b * s > self._io.rows:
            self._alloc(b * s)
        start = np.array(cache.lengths, np.int64)  # (B,)
        self._params[:b] = start
        self._params[b:b + b * s] = ids.reshape(-1)
        if rows is not None:
            self._embeds[:rows.size] = rows.reshape(-1)
        t0 = time.perf_counter()
        graphs = self.engine.use_graphs if self.use_graphs is None else self.use_graphs
        if self._profile is not None:  # profile(): this call without a graph, an event after every kernel
            self._profile.update(self.rt.profile(self.engine.model, self._io, s))
            self.enqueues += 1
        elif graphs and s <= GRAPH_MAX_S:
            graph = self.graphs.get(s)
            if graph is None:
                graph = self.graphs[s] = self.rt.capture(self.engine.model, self._io, s)
                self.captures += 1
            self.rt.launch(graph, self._io)
            self.launches += 1
        else:
            self.rt.enqueue(self.engine.model, self._io, s)
            self.enqueues += 1
        self.rt.sync(self._io)
        t1 = time.perf_counter()
        ms = max(self.rt.kernel_ms(self._io), 0.0) / 1e3
        self.kernel_s += ms
        self.engine.kernel_s += ms
        views = self._views.get(s)
        if views is None:  # the (B, S, head_rows) logits and (B, S, E) hidden state in the scratch, once per S
            m, mem, off = self.m, self.memory, self.layout.offsets
            views = self._views[s] = (mem.sub(self._scratch, off["logits"][0], (b, s, self.engine.head_rows),
                                              np.float32),
                                      mem.sub(self._scratch, off["h"][0], (b, s, m.hidden_size), np.float32))
        out = _Outputs(self._next[:b * s].reshape(b, s).copy(), *views)
        self._called(s, out, t0, t1, start, valid)

    def profile(self, tokens: np.ndarray) -> dict:
        """run(tokens) without a graph, with an event after every kernel: -> {kernel kind: {"ms", "kernels"}}, the
        GPU time of each kind (cuda_step.cu's ecs_profile). The call's rows are written as any call's; the caller
        commits or rewinds them."""
        self._profile = {}
        try:
            self.run(tokens)
            return self._profile
        finally:
            self._profile = None

    def _fetch_ids(self) -> np.ndarray:
        return self._last.ids

    def last_logits(self) -> np.ndarray:
        """(B, S, V) logits of the last call, on the host: the vocabulary's columns of the step's padded rows."""
        full = self.memory.to_host(self._last.logits)  # (B, S, head_rows)
        return full if self.engine.head_rows == self.m.vocab_size else full[..., :self.m.vocab_size]

    def __del__(self):
        try:
            self.rt.release(self._stream, self._events, list(self.graphs.values()))
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a failed __init__
            pass

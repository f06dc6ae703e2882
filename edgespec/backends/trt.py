"""Native TensorRT: a contract decoder's `model.plan` run through the TensorRT Python API and cuda-python.

    eng = TrtEngine("engines/demo-target")           # engine.json + model.plan (python -m edgespec.export.tensorrt)
    dec = eng.decoder(batch=1)                       # a TrtDecoder: the Decoder of backends/base.py
    ids = dec.ids(tokens)                            # (B, S) argmax ids; only these come back to the host

Why the KV cache is double-buffered. TensorRT does not allow an input and an output tensor to share memory
(nothing in TensorRT 10.3's API permits it, and the engine may read `past` after it started writing
`present`). So the cache is a KVCache(in_place=False): a call reads `cache.buffers` as `past`, writes
`cache.out_buffers` as `present` (the graph's ScatterND copies every bound row and sets the S new ones),
and `cache.wrote(S)` swaps the two sets. Each call therefore copies the bound rows on the device
(B*Hkv*P*D per layer, twice); rolling back is still lowering the committed length. TensorRT >= 10.15 has
IKVCacheUpdateLayer, whose output aliases the cache input by design (`engine.get_aliased_input_tensor`):
that is the path to a true in-place cache later. JetPack 6 ships TensorRT 10.3, so not yet.

Why the cache grows by doubling (MIN_ROWS rows, then powers of two up to manifest.max_context): a call binds
the cache's whole capacity P (attention and the ScatterND copy read every bound row), so P should follow the
live context, while CUDA graphs replay fixed shapes and addresses. Per (profile, S, parity) used by decode and
verify calls the decoder captures one graph on its own execution context (after one warm-up call) and later only
launches it; when the cache grows (a new capacity, new addresses) the graphs and their contexts are dropped and
captured again: once per doubling, so a call binds at most twice the rows it needs (or MIN_ROWS).
The execution contexts share one device scratch allocation (they all run in order on one stream).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import contract as C
from ..contract import EngineError, Manifest
from ..cuda import CudaMemory, check, cudart, device_info, gpu_available
from ..kvcache import KVCache
from .providers import PLAN_FILE, PROVIDERS, checked_folder, memory_for
from .base import Capabilities, Decoder, EmbeddingTable

PROVIDER = "tensorrt-native"
MIN_ROWS = 256  # the cache's first capacity (rows per sequence); it doubles from there as the context grows
BUILD_HINT = "build it on this device with `python -m edgespec.export.tensorrt {dir}` (or `edgespec export ... --tensorrt`)"
TENSORRT_HINT = ("install the `trt` extra on x86_64 (pip install 'edgespec[trt]': TensorRT and cuda-python for CUDA 13, "
                 "a driver >= 580; `trt-cu12` for CUDA 12); "
                "on Jetson (JetPack 6) use the system TensorRT: sudo apt install python3-libnvinfer, and create "
                "the venv with --system-site-packages (never pip install tensorrt on a Jetson)")

# TensorRT DataType names -> numpy dtype names (trt.nptype raises for BF16 / FP8 / INT4)
TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "UINT8": "uint8",
              "INT32": "int32", "INT64": "int64", "BOOL": "bool", "FP8": "float8", "INT4": "int4"}


def import_tensorrt():
    """The tensorrt module, or an EngineError saying how to install it."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise EngineError(f"native TensorRT needs the `tensorrt` Python package, which is not importable "
                          f"here ({e}); {TENSORRT_HINT}") from None
    return trt


def trt_dtype_name(dt) -> str:
    """A TensorRT DataType (or its name) -> the numpy dtype name engine.json uses."""
    name = getattr(dt, "name", None) or str(dt).rsplit(".", 1)[-1]
    return TRT_DTYPES.get(name, name.lower())


# -- optimization profiles (pure Python) --------------------------------------------------------------------

@dataclass
class PlanProfile:
    """One optimization profile of a plan: input name -> (min, opt, max) shapes."""
    index: int
    name: str  # decode / verify / prefill (from engine.json extra.tensorrt), else "profile{index}"
    shapes: dict

    def _dim(self, tensor: str, axis: int) -> tuple[int, int]:
        lo, _, hi = self.shapes[tensor]
        return int(lo[axis]), int(hi[axis])

    @property
    def seq(self) -> tuple[int, int]:  # (min, max) new tokens per call
        return self._dim(self._first, 1)

    @property
    def batch(self) -> tuple[int, int]:
        return self._dim(self._first, 0)

    @property
    def rows(self) -> tuple[int, int]:  # (min, max) bound cache rows P (attention_bias [B, 1, S, P])
        return self._dim(C.ATTENTION_BIAS, 3)

    @property
    def _first(self) -> str:
        return C.INPUT_IDS if C.INPUT_IDS in self.shapes else C.INPUTS_EMBEDS

    def fits(self, s: int, rows: int, batch: int = 1) -> bool:
        return all(lo <= x <= hi for x, (lo, hi) in ((s, self.seq), (rows, self.rows), (batch, self.batch)))


def select_profile(profiles: list[PlanProfile], s: int, rows: int, batch: int = 1) -> int:
    """Index of the profile for a call of S new tokens over `rows` bound cache rows: decode for S = 1,
    verify for small S, else the one with the narrowest seq range that fits (prefill). EngineError when
    none fits, saying which limit was passed and what to rebuild."""
    fit = [p for p in profiles if p.fits(s, rows, batch)]
    if fit:
        want = "decode" if s == 1 else "verify"
        best = min(fit, key=lambda p: (p.name != want, p.seq[1] - p.seq[0], p.index))
        return best.index
    if not profiles:
        raise EngineError("the plan has no optimization profiles")
    max_rows = max(p.rows[1] for p in profiles)
    max_seq = max(p.seq[1] for p in profiles)
    max_batch = max(p.batch[1] for p in profiles)
    if rows > max_rows:
        raise EngineError(f"context of {rows} rows is longer than the plan's profile (max {max_rows}); "
                          f"rebuild with a larger --max-context / profile")
    if s > max_seq:
        raise EngineError(f"a call of {s} new tokens is longer than the plan's profiles allow (max {max_seq}); "
                          f"feed the prompt in chunks of at most {max_seq} tokens or rebuild with a larger --prefill")
    if batch > max_batch:
        raise EngineError(f"batch {batch} is larger than the plan's profiles allow (max {max_batch}); "
                          f"rebuild with --batch {batch}")
    ranges = ", ".join(f"{p.name}: S {p.seq}, rows {p.rows}, batch {p.batch}" for p in profiles)
    raise EngineError(f"no profile of the plan covers S={s}, rows={rows}, batch={batch} ({ranges}); "
                      f"rebuild the plan with profiles that cover it")


def check_plan_io(m: Manifest, got_in: list[tuple], got_out: list[tuple]) -> list[str]:
    """Compare a plan's (name, dtype, shape) I/O with engine.json (TensorRT may list tensors in another
    order: they are put in the manifest's order first). Returns the differences (empty = consistent)."""
    def order(specs, got):
        rank = {t.name: i for i, t in enumerate(specs)}
        return sorted(got, key=lambda g: rank.get(g[0], len(rank)))
    return m.check_graph_io(order(m.inputs, got_in), order(m.outputs, got_out))


# -- the engine ---------------------------------------------------------------------------------------------

def _capturing_logger(trt):
    """A trt.ILogger that keeps the messages (to explain a failed deserialization) and prints errors."""
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.lines: list[str] = []

        def log(self, severity, msg):
            sev = trt.ILogger.Severity
            if severity in (sev.INTERNAL_ERROR, sev.ERROR, sev.WARNING):
                self.lines.append(str(msg))
            if severity in (sev.INTERNAL_ERROR, sev.ERROR):
                print(f"[TensorRT] {msg}", file=sys.stderr)
    return Logger()


class TrtEngine(EmbeddingTable):
    """A contract decoder's TensorRT plan, checked against its engine.json at load."""
    provider = PROVIDER

    def __init__(self, engine_dir: str | Path, check_hashes: bool = True, device_id: int = 0):
        self.dir, self.manifest = checked_folder(engine_dir, check_hashes)
        m, self.device_id = self.manifest, device_id
        if m.kind != "decoder":
            raise EngineError(f"{self.dir}: native TensorRT runs contract decoders (kind 'decoder'), got {m.kind!r}")
        info = m.extra.get("tensorrt") or {}
        self.plan_path = self.dir / info.get("plan", PLAN_FILE)
        if not self.plan_path.is_file():
            raise EngineError(f"{self.plan_path}: no TensorRT plan in {self.dir}; " + BUILD_HINT.format(dir=self.dir))
        trt = self.trt = import_tensorrt()
        ok, why = gpu_available(device_id)
        if not ok:
            raise EngineError(f"{self.plan_path}: native TensorRT needs an NVIDIA GPU: {why}")
        check(cudart().cudaSetDevice(device_id))
        self._logger = _capturing_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self.plan_path.read_bytes())  # None on failure
        if self.engine is None:
            raise EngineError(self._deserialize_error(info))
        got_in, got_out = self.io()
        problems = check_plan_io(m, got_in, got_out)
        if problems:
            raise EngineError(f"{self.plan_path}: the plan's inputs/outputs do not match {self.dir}/engine.json "
                              f"(rebuild the plan from this folder's model):\n  - " + "\n  - ".join(problems))
        self.profiles = self.read_profiles()

    def _deserialize_error(self, info: dict) -> str:
        try:
            dev = device_info(self.device_id)
            gpu = f"{dev['name']} (compute {dev['compute']})"
        except Exception as e:  # noqa: BLE001
            gpu = f"GPU {self.device_id} (properties unavailable: {e})"
        built = info.get("tensorrt_version")
        said = "\n    ".join(self._logger.lines[-5:]) or "(no log message)"
        return (f"{self.plan_path}: TensorRT {self.trt.__version__} on {gpu} could not load this plan"
                f"{f' (built with TensorRT {built})' if built else ''}. A plan only loads with the TensorRT version "
                f"and GPU that built it; rebuild it on this device: python -m edgespec.export.tensorrt {self.dir}\n"
                f"  TensorRT said:\n    {said}")

    def io(self) -> tuple[list[tuple], list[tuple]]:
        """(inputs, outputs) as (name, numpy dtype name, shape with dynamic dims as 'dynamic')."""
        trt, e = self.trt, self.engine
        ins, outs = [], []
        for i in range(e.num_io_tensors):
            name = e.get_tensor_name(i)
            shape = [d if d >= 0 else "dynamic" for d in tuple(e.get_tensor_shape(name))]
            entry = (name, trt_dtype_name(e.get_tensor_dtype(name)), shape)
            (ins if e.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outs).append(entry)
        return ins, outs

    def read_profiles(self) -> list[PlanProfile]:
        e = self.engine
        recorded = (self.manifest.extra.get("tensorrt") or {}).get("profiles") or []
        n = e.num_optimization_profiles
        names = [p.get("name", f"profile{k}") for k, p in enumerate(recorded)] if len(recorded) == n else \
            [f"profile{k}" for k in range(n)]
        out = []
        for k in range(n):
            shapes = {t.name: tuple(tuple(int(x) for x in d) for d in e.get_tensor_profile_shape(t.name, k))
                      for t in self.manifest.inputs}
            out.append(PlanProfile(k, names[k], shapes))
        return out

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None, cuda_graphs: bool = True) -> "TrtDecoder":
        """A TrtDecoder for `batch` sequences (what open_engine's callers ask every engine for). Its cache doubles
        as the context grows and it captures CUDA graphs per capacity on first use: keep it (Generator pools its
        decoders)."""
        return TrtDecoder(self, batch, embedding, cuda_graphs)

    def profile_for(self, s: int, rows: int, batch: int = 1) -> int:
        return select_profile(self.profiles, s, rows, batch)

    @property
    def scratch_bytes(self) -> int:
        """Device scratch one execution context needs (the largest over all profiles)."""
        e = self.engine
        size = getattr(e, "device_memory_size_v2", None)  # TensorRT >= 10.1; a property
        size = size() if callable(size) else size
        return int(size if size is not None else e.device_memory_size)


# -- the decoder --------------------------------------------------------------------------------------------

@dataclass
class _IO:
    """Device buffers for calls of one S (per S up to graph_max, else one shared set grown to fit)."""
    first: object  # memory.Buffer: input_ids (B, S) int64 or inputs_embeds (B, S, E) float32
    pos: object  # position_ids (B, S) int64
    bias: object  # attention_bias (B, 1, S, P) float32
    logits: object  # (B, S, V) float32
    ids: object  # next_ids (B, S) int64
    s: int  # the S these buffers hold (at most; views cut them to the call's S)


class _Graph:
    """An instantiated CUDA graph; destroyed with this object."""

    def __init__(self, exec_):
        self.exec, self._rt = exec_, cudart()

    def __del__(self):
        try:
            self._rt.cudaGraphExecDestroy(self.exec)
        except Exception:  # noqa: BLE001
            pass


class TrtDecoder(Decoder):
    """The Decoder (base.py) over a TensorRT plan; its last call's outputs are (_IO, S). The cache lives on the GPU,
    MIN_ROWS rows at first, doubling up to max_context as the context grows (the module docstring)."""

    def __init__(self, engine: TrtEngine, batch: int = 1, embedding: np.ndarray | None = None,
                 cuda_graphs: bool = True):
        m = engine.manifest
        memory = memory_for(PROVIDERS[PROVIDER], engine.device_id)
        cap = m.max_context
        max_rows = max(p.rows[1] for p in engine.profiles)
        if max_rows < cap:
            raise EngineError(f"{engine.plan_path}: context of {cap} rows (engine.json max_context) is longer than "
                              f"the plan's profile (max {max_rows}); rebuild with a larger --max-context / profile")
        cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, cap, m.cache_dtype, memory,
                        in_place=PROVIDERS[PROVIDER].in_place, chunk=MIN_ROWS, capacity=min(MIN_ROWS, cap),
                        doubling=True)  # each capacity: its own graphs
        super().__init__(engine, batch, memory, cache, embedding)
        self.caps = Capabilities(embeds=m.input_mode == "embeds")
        self.stream = self.memory.stream
        self.cuda_graphs = cuda_graphs
        self.graph_fallback_reason: str | None = None
        small = [p.seq[1] for p in engine.profiles if p.name in ("decode", "verify")]
        self.graph_max = max(small) if small else 1  # graphs for S <= this (decode and verify calls)
        self._scratch = self.memory.zeros((max(engine.scratch_bytes, 1),), np.uint8)
        self._io: dict = {}  # S (or "big") -> _IO
        self._contexts: dict = {}  # profile -> context for plain calls; (profile, S, parity) -> graph context
        self._graphs: dict = {}  # (profile, S, parity) -> _Graph, or None where capture failed
        self._generation = self.cache.generation

    # -- buffers and contexts ---------------------------------------------------------------------------
    def _io_for(self, s: int) -> _IO:
        key = s if s <= self.graph_max else "big"
        io = self._io.get(key)
        if io is None or io.s < s or io.bias.shape[3] != self.cache.capacity:
            n = s if key != "big" else 1 << (s - 1).bit_length()  # prefill: grow in powers of two
            b, m, p, z = self.batch, self.m, self.cache.capacity, self.memory.zeros
            first = z((b, n), np.int64) if m.input_mode == "ids" else z((b, n, m.hidden_size), np.float32)
            io = self._io[key] = _IO(first, z((b, n), np.int64), z((b, 1, n, p), np.float32),
                                     z((b, n, m.vocab_size), np.float32), z((b, n), np.int64), n)
        return io

    def _new_context(self, profile: int):
        trt, e = self.engine.trt, self.engine.engine
        strategy = getattr(getattr(trt, "ExecutionContextAllocationStrategy", None), "USER_MANAGED", None)
        ctx = e.create_execution_context(strategy) if strategy is not None else None
        if ctx is not None:  # all contexts share one scratch buffer: they run one at a time on one stream
            if hasattr(ctx, "set_device_memory"):
                ctx.set_device_memory(self._scratch.ptr, self._scratch.nbytes)
            else:
                ctx.device_memory = self._scratch.ptr
        else:
            ctx = e.create_execution_context()
        if ctx is None:
            raise RuntimeError(f"{self.engine.plan_path}: TensorRT could not create an execution context "
                               f"(out of GPU memory?)")
        # TensorRT says False (an out-of-range index raises) when it did not switch: the context would run the
        # call under another profile's shapes
        if not ctx.set_optimization_profile_async(profile, self.stream.handle):
            name = self.engine.profiles[profile].name
            raise EngineError(f"{self.engine.plan_path}: TensorRT refused optimization profile {profile} ({name!r}) "
                              f"for a new execution context; rebuild the plan on this device: python -m "
                              f"edgespec.export.tensorrt {self.engine.dir}")
        return ctx

    def _bind(self, ctx, io: _IO, s: int) -> None:
        """Shapes and addresses for a call of S tokens: past = cache.buffers, present = cache.out_buffers."""
        b, cache, m = self.batch, self.cache, self.m
        p = cache.capacity
        first = (b, s) if m.input_mode == "ids" else (b, s, m.hidden_size)
        shapes = {m.inputs[0].name: first, C.POSITION_IDS: (b, s), C.ATTENTION_BIAS: (b, 1, s, p)}
        addrs = {m.inputs[0].name: io.first.ptr, C.POSITION_IDS: io.pos.ptr, C.ATTENTION_BIAS: io.bias.ptr,
                 C.LOGITS: io.logits.ptr, C.NEXT_IDS: io.ids.ptr}
        for buf, out, (past, present) in zip(cache.buffers, cache.out_buffers, C.cache_names(m.num_layers)):
            shapes[past] = buf.shape  # (B, Hkv, P, D)
            addrs[past], addrs[present] = buf.ptr, out.ptr
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise EngineError(f"{self.engine.plan_path}: TensorRT refused shape {shape} for {name} "
                                  f"(outside profile {ctx.active_optimization_profile})")
        missing = ctx.infer_shapes()
        if missing:
            raise EngineError(f"{self.engine.plan_path}: input shapes left unspecified: {missing}")
        for name, ptr in addrs.items():
            if not ctx.set_tensor_address(name, ptr):
                raise EngineError(f"{self.engine.plan_path}: {name} is not an I/O tensor of the plan")

    def _execute(self, ctx) -> None:
        if not ctx.execute_async_v3(self.stream.handle):
            raise RuntimeError(f"{self.engine.plan_path}: TensorRT execute_async_v3 failed (see the log above)")

    def _capture(self, ctx):
        """Capture one execute of a warmed-up, bound context -> _Graph, or None (reason recorded)."""
        rt = cudart()
        ok, graph = False, None
        check(rt.cudaStreamBeginCapture(self.stream.obj, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            ok = ctx.execute_async_v3(self.stream.handle)
        finally:
            err, graph = rt.cudaStreamEndCapture(self.stream.obj)  # always end the capture
        if ok and err == rt.cudaError_t.cudaSuccess and graph is not None:
            try:
                exec_ = check(rt.cudaGraphInstantiate(graph, 0))
                return _Graph(exec_)
            except RuntimeError as e:
                self.graph_fallback_reason = f"cudaGraphInstantiate failed: {e}"
                rt.cudaGetLastError()
                return None
            finally:
                rt.cudaGraphDestroy(graph)
        if graph is not None and err == rt.cudaError_t.cudaSuccess:
            rt.cudaGraphDestroy(graph)
        rt.cudaGetLastError()  # clear the sticky capture error
        self.graph_fallback_reason = (f"CUDA graph capture failed (execute_async_v3 -> {ok}, cudaStreamEndCapture "
                                      f"-> {getattr(err, 'name', err)}); running without graphs")
        return None

    def _renew_if_grown(self) -> None:
        """After the cache grew (new buffers, a new capacity): the graphs and their contexts hold the old
        addresses and shapes, and the calls' bias buffers the old width: all dropped (made again on use)."""
        if self.cache.generation != self._generation:
            self._graphs.clear()
            self._contexts = {k: v for k, v in self._contexts.items() if isinstance(k, int)}
            self._io.clear()
            self._generation = self.cache.generation

    def _enqueue(self, profile: int, io: _IO, s: int) -> None:
        """Enqueue the engine for a call of S tokens: replay its graph, or capture one, or run plainly."""
        if self.cuda_graphs and s <= self.graph_max:
            key = (profile, s, self.cache.parity)
            if key in self._graphs:
                g = self._graphs[key]
                if g is not None:
                    check(cudart().cudaGraphLaunch(g.exec, self.stream.handle))
                    return
                ctx = self._contexts[key]  # capture failed: this context stays bound; run it plainly
                self._execute(ctx)
                return
            ctx = self._contexts[key] = self._new_context(profile)
            self._bind(ctx, io, s)
            self._execute(ctx)  # warm-up (flushes deferred updates) and this call's real result
            self.stream.synchronize()
            self._graphs[key] = self._capture(ctx)
            return
        ctx = self._contexts.get(profile)
        if ctx is None:
            ctx = self._contexts[profile] = self._new_context(profile)
        self._bind(ctx, io, s)
        self._execute(ctx)

    # -- calls ----------------------------------------------------------------------------------------
    def run(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None) -> None:
        """Decoder.run on the GPU: the S new rows land in the cache (in its other buffer set, which becomes
        the cache), the outputs stay on the device until ids() / last_logits() copy them back."""
        first, pos, bias = self._inputs(tokens, valid, embeds)  # host: (B, S[, E]), (B, S), (B, 1, S, P)
        s = first.shape[1]
        self._renew_if_grown()  # _inputs reserved the rows: the cache may have doubled
        profile = self.engine.profile_for(s, self.cache.capacity, self.batch)
        io = self._io_for(s)
        mem, view = self.memory, CudaMemory.view
        mem.copy_from_host_async(view(io.first, first.shape), first)
        mem.copy_from_host_async(view(io.pos, pos.shape), pos)
        mem.copy_from_host_async(view(io.bias, bias.shape), bias)
        t0 = time.perf_counter()
        self._enqueue(profile, io, s)
        self.stream.synchronize()
        self._called(s, (io, s), t0, time.perf_counter())

    def last_logits(self) -> np.ndarray:
        """(B, S, V) float32 logits of the last call: a host copy."""
        io, s = self._last
        return self.memory.to_host(CudaMemory.view(io.logits, (self.batch, s, self.m.vocab_size)))

    def _fetch_ids(self) -> np.ndarray:
        """(B, S) int64 next_ids of the last call: a host copy."""
        io, s = self._last
        return self.memory.to_host(CudaMemory.view(io.ids, (self.batch, s)))

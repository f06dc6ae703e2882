"""ONNX Runtime engines (`OrtEngine`: providers cpu, cuda, tensorrt-ep) and their decoder (`OrtDecoder`).

`OrtEngine.run(feeds)` is the slow, obvious path (numpy in, numpy out). The runtime decodes through
`OrtEngine.decoder()`: an OrtDecoder that binds the KV cache and the outputs in the engine's memory. The
TensorRT execution provider starts with explicit optimization profiles and an engine cache (profiles.py), so
it builds its engines once, not once per context length.


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
from pathlib import Path

import numpy as np

from .. import contract as C
from ..contract import EngineError, Manifest
from ..kvcache import KVCache
from ..masks import one_step_into, step_inputs, step_inputs_into
from ..memory import Buffer, HostMemory
from .providers import PROVIDERS, default_threads, memory_for, require_portable
from .base import Capabilities, Decoder, EmbeddingTable

ORT_PROVIDERS = tuple(n for n, p in PROVIDERS.items() if p.backend == "ort") + ("tensorrt",)
_ORT_TYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16",
              "tensor(int32)": "int32"}



def session_options(threads: int | None = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = default_threads(threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return so


ORT_ERROR_MODULE = "onnxruntime.capi.onnxruntime_pybind11_state"  # Fail, InvalidProtobuf, ...: no common base


def _session(model: Path, options, providers: list):
    """An InferenceSession of `model`; ONNX Runtime's load errors (a truncated or foreign file) become one
    EngineError naming the file, like every other way an engine folder can be wrong."""
    import onnxruntime as ort
    try:
        return ort.InferenceSession(str(model), sess_options=options, providers=providers)
    except Exception as e:
        if type(e).__module__ != ORT_ERROR_MODULE:
            raise
        raise EngineError(f"{model}: ONNX Runtime cannot load it ({type(e).__name__}: {e}); "
                          f"re-export the engine folder") from e


def plain_session(model: Path, provider: str, threads: int | None = None):
    """An ONNX Runtime session of a plain graph (a policy's encoder: no KV cache, no profiles): on CUDA for a
    provider whose buffers live on the GPU (the table's memory kind) when this onnxruntime has CUDA, else on
    the CPU."""
    import onnxruntime as ort
    gpu = PROVIDERS[provider].memory != "host" and "CUDAExecutionProvider" in ort.get_available_providers()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
    return _session(model, session_options(threads), providers)


class OrtEngine(EmbeddingTable):
    """One contract decoder in an ONNX Runtime session; checks the folder against its manifest at load.
    provider: cpu, cuda, or tensorrt / tensorrt-ep (ONNX Runtime's TensorRT execution provider)."""

    def __init__(self, engine_dir: str | Path, provider: str = "cpu", threads: int | None = None,
                 check_hashes: bool = True, provider_options: dict | None = None):
        import onnxruntime as ort

        from .. import compat

        self.dir = Path(engine_dir)
        if not self.dir.is_dir():
            raise EngineError(f"{self.dir}: no such engine folder")
        derived = compat.looks_like_optimum(self.dir)
        if not derived:
            self.manifest = Manifest.read(self.dir)
            problems = self.manifest.check_files(self.dir, hashes=check_hashes)
            if problems:
                raise EngineError(f"{self.dir}: engine folder does not match its manifest:\n  - "
                                  + "\n  - ".join(problems))
        self.spec = spec = PROVIDERS["tensorrt-ep"] if provider == "tensorrt" else PROVIDERS.get(provider)
        if spec is None or spec.backend != "ort":
            raise EngineError(f"ONNX Runtime runs providers {ORT_PROVIDERS}, got {provider!r} (open_engine takes "
                              f"every provider)")
        if spec.ort_name not in ort.get_available_providers():
            raise EngineError(f"provider {provider!r} is not available in this onnxruntime build "
                              f"(available: {ort.get_available_providers()}): {spec.install_hint}")
        if spec.portable_only and not derived:
            require_portable(self.dir, provider)
        if spec.name == "tensorrt-ep" and provider_options is None and not derived:
            from ..profiles import default_profiles, ort_trt_options
            provider_options = ort_trt_options(self.manifest, self.dir, default_profiles(self.manifest.max_context),
                                               fp16=self.manifest.precision != "fp32")
        self.provider_options = dict(provider_options or {})
        providers = [(spec.ort_name, self.provider_options)]
        if spec.name != "cpu":
            providers.append(("CPUExecutionProvider", {}))
        self.provider = provider
        model_file = "model.onnx" if derived else self.manifest.model_file
        self.session = _session(self.dir / model_file, session_options(threads), providers)
        if derived:
            self.manifest = compat.derive_manifest(self.dir, self.session)
        got_in = [(i.name, _ORT_TYPES.get(i.type, i.type), list(i.shape)) for i in self.session.get_inputs()]
        got_out = [(o.name, _ORT_TYPES.get(o.type, o.type), list(o.shape)) for o in self.session.get_outputs()]
        problems = self.manifest.check_graph_io(got_in, got_out)
        if problems:
            raise EngineError(f"{self.dir / self.manifest.model_file}: graph does not match {self.dir}/engine.json:"
                              "\n  - " + "\n  - ".join(problems))
        self.input_names = [i[0] for i in got_in]
        self.output_names = [o[0] for o in got_out]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Plain numpy call: feeds by contract name -> outputs by contract name."""
        outs = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, outs))

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None) -> "OrtDecoder":
        """An OrtDecoder (this engine bound to its own KV cache) for `batch` sequences."""
        return OrtDecoder(self, batch, embedding)


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


class OrtDecoder(Decoder):
    """An OrtEngine bound to its KV cache through IOBinding (the module docstring)."""

    def __init__(self, engine: OrtEngine, batch: int = 1, embedding: np.ndarray | None = None,
                 memory: HostMemory | None = None):
        m, spec = engine.manifest, engine.spec
        memory = memory or memory_for(spec)
        cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context, m.cache_dtype, memory,
                        in_place=spec.in_place)
        super().__init__(engine, batch, memory, cache, embedding)
        self.caps = Capabilities(hidden=m.has_hidden, embeds=m.input_mode == "embeds")
        self._bindings: dict[tuple, _Binding] = {}  # (S, parity) -> its binding

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

    def run(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None) -> None:
        """Decoder.run through this S's binding: the new rows land in the cache in place."""
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

        def one(tok: int, row: int) -> tuple[float, float, int]:
            ids_in[0, 0] = tok
            one_step_into(m, row, capacity, inputs)
            t0 = time.perf_counter()
            run(bind)
            return t0, time.perf_counter(), to_host(entry.ids).item(0)

        yield from self._steps_back_to_back(pending, n, start, one, entry)

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

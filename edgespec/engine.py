"""ONNX Runtime engines for contract decoders.

`OrtEngine.run(feeds)` is the slow, obvious path (numpy in, numpy out). The runtime decodes through
`OrtEngine.decoder()`: a `Decoder` (decoder.py) that binds the KV cache and the outputs in the engine's
memory. The TensorRT execution provider starts with explicit optimization profiles and an engine cache
(profiles.py), so it builds its engines once, not once per context length.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .contract import EngineError, Manifest

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
INSTALL_HINT = {
    "cuda": "install onnxruntime-gpu in place of onnxruntime (`pip install edgespec[gpu]` on x86; on a Jetson, "
            "NVIDIA's onnxruntime-gpu wheel for your JetPack)",
    "tensorrt": "install onnxruntime-gpu with TensorRT (see docs/gpu.md), or build a native plan "
                "(`python -m edgespec.export.tensorrt DIR`, `trt` extra) and load it with provider='tensorrt'",
}
_ORT_TYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16",
              "tensor(int32)": "int32"}


def default_provider() -> str:
    import onnxruntime as ort
    avail = ort.get_available_providers()
    return "cuda" if PROVIDERS["cuda"] in avail else "cpu"


ENGINE_PROVIDERS = ("cpu", "cpu-native", "cuda", "tensorrt", "tensorrt-ep", "tensorrt-native")
PLAN_FILE = "model.plan"


def plan_path(engine_dir: Path) -> Path | None:
    """The folder's TensorRT plan (built by export/tensorrt.py and recorded in engine.json), if any."""
    d = Path(engine_dir)
    try:
        info = Manifest.read(d).extra.get("tensorrt") or {}
    except EngineError:
        return None
    p = d / info.get("plan", PLAN_FILE)
    return p if info and p.is_file() else None


def open_engine(engine_dir: str | Path, provider: str | None = None, threads: int | None = None,
                check_hashes: bool = True):
    """An engine folder on a provider:
        cpu / cuda        ONNX Runtime with that execution provider
        tensorrt          the folder's native TensorRT plan if it has one, else ONNX Runtime's TensorRT EP
        tensorrt-ep       ONNX Runtime's TensorRT EP (profiles and an engine cache: profiles.py)
        tensorrt-native   the native plan (trt.py); an error if the folder has none
        cpu-native        the folder's float16 weights through native_step.c (native.py); an error if the
                          folder has none
    Every engine gives `.decoder(batch, embedding)` and `.manifest`."""
    provider = provider or default_provider()
    if provider not in ENGINE_PROVIDERS:
        raise EngineError(f"provider must be one of {ENGINE_PROVIDERS}, got {provider!r}")
    if provider.startswith("tensorrt"):
        _require_portable(Path(engine_dir), provider)
    if provider == "cpu-native":
        from .native import NativeEngine
        return NativeEngine(engine_dir, threads, check_hashes)
    if provider == "tensorrt-native" or (provider == "tensorrt" and plan_path(engine_dir) is not None):
        from .trt import TrtEngine
        return TrtEngine(engine_dir, check_hashes=check_hashes)
    return OrtEngine(engine_dir, "tensorrt" if provider == "tensorrt-ep" else provider, threads, check_hashes)


def has_native(engine_dir) -> bool:
    """Whether the folder carries native weights (provider 'cpu-native', native.py)."""
    try:
        return bool((Manifest.read(Path(engine_dir)).extra.get("native") or {}).get("file"))
    except EngineError:
        return False


def draft_provider(provider: str, draft_dir) -> str:
    """The draft's provider beside a target on `provider`: 'cpu-native' falls back to 'cpu' for a draft folder
    without native weights (an int8 draft: MatMulNBits), every other provider is the target's."""
    return "cpu" if provider == "cpu-native" and not has_native(draft_dir) else provider


def _require_portable(engine_dir: Path, provider: str) -> None:
    """TensorRT parses standard ONNX ops only: an ort-flavour folder is refused with what to do instead."""
    try:
        m = Manifest.read(engine_dir)
    except EngineError:
        return  # loading reports it
    if m.flavor != "portable":
        raise EngineError(f"{engine_dir}: a {m.flavor!r}-flavour engine (ONNX Runtime contrib ops) cannot run on "
                          f"provider {provider!r}; expected a 'portable' engine: re-export it with "
                          f"`edgespec export CHECKPOINT --out DIR --flavor portable`")


def session_options(threads: int | None = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or int(os.environ.get("EDGESPEC_THREADS", 0)) or os.cpu_count() or 1
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


class OrtEngine:
    """One contract decoder in an ONNX Runtime session; checks the folder against its manifest at load."""

    def __init__(self, engine_dir: str | Path, provider: str = "cpu", threads: int | None = None,
                 check_hashes: bool = True, provider_options: dict | None = None):
        import onnxruntime as ort

        from . import compat

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
        if provider not in PROVIDERS:
            raise EngineError(f"provider must be one of {sorted(PROVIDERS)}, got {provider!r}")
        if PROVIDERS[provider] not in ort.get_available_providers():
            raise EngineError(f"provider {provider!r} is not available in this onnxruntime build "
                              f"(available: {ort.get_available_providers()}): {INSTALL_HINT.get(provider, '')}")
        if provider == "tensorrt" and not derived:
            _require_portable(self.dir, provider)
        if provider == "tensorrt" and provider_options is None and not derived:
            from .profiles import default_profiles, ort_trt_options
            provider_options = ort_trt_options(self.manifest, self.dir, default_profiles(self.manifest.max_context),
                                               fp16=self.manifest.precision != "fp32")
        self.provider_options = dict(provider_options or {})
        providers = [(PROVIDERS[provider], self.provider_options)]
        if provider != "cpu":
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

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None):
        """A Decoder (this engine bound to its own KV cache) for `batch` sequences."""
        from .decoder import Decoder
        return Decoder(self, batch, embedding)

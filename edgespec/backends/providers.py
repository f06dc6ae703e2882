"""The provider table: for each provider its backend, where its buffers live and whether its cache is written in
place, and the folder checks that go with it. open_engine (backends/__init__.py) and every backend read it;
nothing else interprets a provider name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..contract import EngineError, Manifest


@dataclass(frozen=True)
class Provider:
    name: str
    backend: str  # "ort" | "native" | "trt" | "cuda_native": the module under backends/ that runs it
    memory: str  # "host" | "ort-cuda" (OrtValues) | "cuda" (cuda-python) | "cuda-step" (cuda_step.cu's own)
    in_place: bool  # the decoder binds one cache buffer as past and present
    ort_name: str | None = None  # ONNX Runtime's execution provider, for the ort backend
    portable_only: bool = False  # parses standard ONNX ops only (an ort-flavour folder is refused)
    shared_pool: bool = False  # a draft engine on it runs on the target's thread pool (one step at a time)
    install_hint: str = ""  # what to install when it is missing


PROVIDERS = {p.name: p for p in (
    Provider("cpu", "ort", "host", True, "CPUExecutionProvider"),
    Provider("cuda", "ort", "ort-cuda", True, "CUDAExecutionProvider",
             install_hint="install onnxruntime-gpu in place of onnxruntime (`pip install edgespec[gpu]` on x86 with a "
                          "CUDA 13 driver, `edgespec[gpu-cu12]` with a CUDA 12 one; on a Jetson, NVIDIA's "
                          "onnxruntime-gpu wheel for your JetPack)"),
    Provider("tensorrt-ep", "ort", "ort-cuda", False, "TensorrtExecutionProvider", portable_only=True,
             install_hint="install onnxruntime-gpu with TensorRT (see docs/gpu.md), or build a native plan "
                          "(`python -m edgespec.export.tensorrt DIR`, `trt` extra) and load it with "
                          "provider='tensorrt'"),
    Provider("tensorrt-native", "trt", "cuda", False, portable_only=True),
    Provider("tensorrt", "trt", "cuda", False, portable_only=True),  # tensorrt-ep when the folder has no plan
    Provider("cpu-native", "native", "host", True, shared_pool=True),
    Provider("cuda-native", "cuda_native", "cuda-step", True,
             install_hint="needs an NVIDIA GPU, its driver and the CUDA compiler nvcc (cuda_step.cu is compiled on "
                          "first use; no TensorRT, onnxruntime-gpu or cuda-python)"),
)}
ENGINE_PROVIDERS = tuple(PROVIDERS)  # the --provider choices
PLAN_FILE = "model.plan"  # a folder's TensorRT plan, unless engine.json's extra.tensorrt.plan says otherwise


def spec(provider: str) -> Provider:
    try:
        return PROVIDERS[provider]
    except KeyError:
        raise EngineError(f"provider must be one of {ENGINE_PROVIDERS}, got {provider!r}") from None


def default_threads(threads: int | None = None) -> int:
    """An engine's threads: the caller's, else $EDGESPEC_THREADS, else every core."""
    return threads or int(os.environ.get("EDGESPEC_THREADS", 0)) or os.cpu_count() or 1


def default_provider() -> str:
    """cuda where this onnxruntime has it, else cpu."""
    import onnxruntime as ort
    return "cuda" if PROVIDERS["cuda"].ort_name in ort.get_available_providers() else "cpu"


def memory_for(provider: "str | Provider", device_id: int = 0):
    """Where a provider's decoders keep their buffers (the table's memory kind)."""
    kind = (provider if isinstance(provider, Provider) else spec(provider)).memory
    if kind == "cuda-step":  # no shared memory object: each cuda-native engine allocates through its runtime
        raise EngineError("provider 'cuda-native' keeps its buffers in its own runtime's memory "
                          "(backends/cuda_native.py: runtime(device_id).memory)")
    if kind == "cuda":
        from ..cuda import CudaMemory
        return CudaMemory(device_id)
    from ..memory import HostMemory, OrtCudaMemory
    return OrtCudaMemory(device_id) if kind == "ort-cuda" else HostMemory()


def plan_path(engine_dir: Path) -> Path | None:
    """The folder's TensorRT plan (built by export/tensorrt.py and recorded in engine.json), if any."""
    d = Path(engine_dir)
    try:
        info = Manifest.read(d).extra.get("tensorrt") or {}
    except EngineError:
        return None
    p = d / info.get("plan", PLAN_FILE)
    return p if info and p.is_file() else None


def resolve(provider: str, engine_dir) -> Provider:
    """The table's row that runs `engine_dir` on `provider` ('tensorrt': the native plan if the folder has one,
    else ONNX Runtime's TensorRT EP)."""
    p = spec(provider)
    if p.name == "tensorrt" and plan_path(engine_dir) is None:
        return PROVIDERS["tensorrt-ep"]
    return p


def has_native(engine_dir) -> bool:
    """Whether the folder carries native weights (providers 'cpu-native' and 'cuda-native')."""
    try:
        return bool((Manifest.read(Path(engine_dir)).extra.get("native") or {}).get("file"))
    except EngineError:
        return False


def draft_provider(provider: str, draft_dir) -> str:
    """The draft's provider beside a target on `provider`: a native provider ('cpu-native', 'cuda-native') falls
    back to 'cpu' for a draft folder without native weights (an int8 draft: MatMulNBits), every other provider
    is the target's."""
    return "cpu" if spec(provider).backend in ("native", "cuda_native") and not has_native(draft_dir) else provider


def require_portable(engine_dir: Path, provider: str) -> None:
    """TensorRT parses standard ONNX ops only: an ort-flavour folder is refused with what to do instead."""
    try:
        m = Manifest.read(engine_dir)
    except EngineError:
        return  # loading reports it
    if m.flavor != "portable":
        raise EngineError(f"{engine_dir}: a {m.flavor!r}-flavour engine (ONNX Runtime contrib ops) cannot run on "
                          f"provider {provider!r}; expected a 'portable' engine: re-export it with "
                          f"`edgespec export CHECKPOINT --out DIR --flavor portable`")


def checked_folder(engine_dir, hashes: bool = True) -> tuple[Path, Manifest]:
    """(folder, its manifest) with the files beside it checked against the manifest: one EngineError naming
    what is wrong (the native and TensorRT engines load through this)."""
    d = Path(engine_dir)
    if not d.is_dir():
        raise EngineError(f"{d}: no such engine folder")
    m = Manifest.read(d)
    problems = m.check_files(d, hashes=hashes)
    if problems:
        raise EngineError(f"{d}: engine folder does not match its manifest:\n  - " + "\n  - ".join(problems))
    return d, m

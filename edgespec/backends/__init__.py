"""Backends: one module per way of running a contract engine, and the one table that says which runs where.

    open_engine(dir, provider)  -> an Engine (base.py) whose .decoder(batch) is that backend's Decoder

    provider          backend        memory     cache written in place
    cpu               ort.py         host       yes
    cuda              ort.py         ort-cuda   yes
    tensorrt-ep       ort.py         ort-cuda   no (TensorRT's I/O tensors never alias)
    tensorrt-native   trt.py         cuda       no
    tensorrt          trt.py when the folder has a plan, else as tensorrt-ep
    cpu-native        native.py      host       yes
    cuda-native       cuda_native.py cuda-step  yes (cuda_step.cu's device memory; one CUDA graph per S)

A remote target (remote.py, a vLLM server) is opened by `edgespec.load` from a URL, not by a provider name.
The table itself is providers.py; every other module asks it (`PROVIDERS`, `spec`) what a provider means.
"""
from __future__ import annotations

from pathlib import Path

from .providers import (ENGINE_PROVIDERS, PLAN_FILE, PROVIDERS, Provider, checked_folder, default_provider,
                        default_threads, draft_provider, has_native, memory_for, plan_path, require_portable,
                        resolve, spec)

__all__ = ["open_engine", "ENGINE_PROVIDERS", "PLAN_FILE", "PROVIDERS", "Provider", "checked_folder",
           "default_provider", "default_threads", "draft_provider", "has_native", "memory_for", "plan_path",
           "require_portable", "resolve", "spec"]


def open_engine(engine_dir: str | Path, provider: str | None = None, threads: int | None = None,
                check_hashes: bool = True):
    """An engine folder on a provider (the table above); every engine gives `.decoder(batch)`, `.manifest`,
    `.embedding`. An ort-flavour folder on a TensorRT provider is refused with what to do instead; a folder
    without native weights on cpu-native, or without a plan on tensorrt-native, too."""
    provider = provider or default_provider()
    p = resolve(provider, engine_dir)
    if p.portable_only:
        require_portable(Path(engine_dir), p.name)
    if p.backend == "native":
        from .native import NativeEngine
        return NativeEngine(engine_dir, threads, check_hashes)
    if p.backend == "cuda_native":
        from .cuda_native import CudaNativeEngine
        return CudaNativeEngine(engine_dir, check_hashes)
    if p.backend == "trt":
        from .trt import TrtEngine
        return TrtEngine(engine_dir, check_hashes=check_hashes)
    from .ort import OrtEngine
    return OrtEngine(engine_dir, provider, threads, check_hashes)  # "tensorrt" stays its name: the EP

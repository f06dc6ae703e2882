"""TensorRT optimization profiles for the contract decoder, and ONNX Runtime's TensorRT execution-provider
options built from them. Pure Python: the runtime uses them to start the TensorRT EP, the exporter to build
a native plan (export/tensorrt.py).

Three profiles cover the three kinds of call the runtime makes (S = new tokens, P = bound cache rows):

    profile   S (seq)            P (bound rows)   used for
    decode    1                  1 .. max_ctx     plain decoding, draft steps
    verify    2 .. γmax+1        2 .. max_ctx     one speculative verify pass
    prefill   1 .. prefill_max   1 .. max_ctx     prompts (chunked beyond prefill_max)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import contract as C
from .speculation import SpeculationConfig

PREFILL_MAX = 512


@dataclass
class ProfileSpec:
    name: str
    seq: tuple[int, int, int]  # min, opt, max new tokens
    past: tuple[int, int, int]  # min, opt, max bound cache rows
    batch: tuple[int, int, int] = (1, 1, 1)

    def __post_init__(self):
        for dim, (lo, opt, hi) in (("seq", self.seq), ("past", self.past), ("batch", self.batch)):
            if not 0 <= lo <= opt <= hi:
                raise ValueError(f"profile {self.name}: {dim} needs 0 <= min <= opt <= max, got {(lo, opt, hi)}")
        if self.seq[0] < 1 or self.batch[0] < 1:
            raise ValueError(f"profile {self.name}: seq and batch must be >= 1")


def default_profiles(max_context: int, gamma_max: int | None = None, prefill_max: int = PREFILL_MAX,
                     batch: int = 1, opt_rows: int | None = None,
                     spec: SpeculationConfig | None = None) -> list[ProfileSpec]:
    """The bound rows P always hold the S new tokens (P >= S): past's min is seq's min. Every size is capped
    at max_context. The verify profile covers the longest round `spec` can verify (its gamma_max, or a
    lookup round's lookup_gamma when longer), or gamma_max when given. opt_rows: the bound rows TensorRT tunes
    for (the native runtime always binds max_context rows; ONNX Runtime's TensorRT EP binds the growing
    cache, 256 by default)."""
    if gamma_max is None:
        spec = spec or SpeculationConfig()
        gamma_max = max(spec.gamma_max, spec.lookup_gamma)
    opt_past = min(opt_rows or 256, max_context)
    b = (1, 1, batch)
    prefill_max = min(prefill_max, max_context)
    gamma_max = min(gamma_max, max_context - 1)
    prefill_opt = min(128, prefill_max)
    return [ProfileSpec("decode", (1, 1, 1), (1, opt_past, max_context), b),
            ProfileSpec("verify", (2, min(5, gamma_max + 1), gamma_max + 1), (2, opt_past, max_context), b),
            ProfileSpec("prefill", (1, prefill_opt, prefill_max), (1, max(prefill_opt, opt_past), max_context), b)]


def profile_shapes(m: C.Manifest, p: ProfileSpec) -> dict[str, tuple[tuple, tuple, tuple]]:
    """Input name -> (min, opt, max) concrete shapes for one profile."""
    out = {}
    for k in range(3):
        dims = {C.BATCH: p.batch[k], C.SEQ: p.seq[k], C.PAST: p.past[k]}
        for t in m.inputs:
            shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
            out.setdefault(t.name, [None, None, None])[k] = shape
    return {name: tuple(v) for name, v in out.items()}


def ort_trt_options(m: C.Manifest, engine_dir: Path, profiles: list[ProfileSpec], fp16: bool = True) -> dict:
    """Provider options for onnxruntime's TensorrtExecutionProvider: engine cache and explicit
    min/opt/max shapes for every dynamic input, one profile per repetition of an input name."""
    mins, opts, maxs = [], [], []
    for p in profiles:
        for name, (lo, opt, hi) in profile_shapes(m, p).items():
            mins.append(f"{name}:{'x'.join(map(str, lo))}")
            opts.append(f"{name}:{'x'.join(map(str, opt))}")
            maxs.append(f"{name}:{'x'.join(map(str, hi))}")
    cache = Path(engine_dir) / "trt_cache"
    return {"trt_fp16_enable": fp16, "trt_engine_cache_enable": True, "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": True, "trt_timing_cache_path": str(cache),
            "trt_profile_min_shapes": ",".join(mins), "trt_profile_opt_shapes": ",".join(opts),
            "trt_profile_max_shapes": ",".join(maxs), "trt_builder_optimization_level": 3}

"""TensorRT: optimization profiles for the contract decoder, a native engine build, and the matching
ONNX Runtime TensorRT execution-provider options.

    python -m edgespec.export.tensorrt engines/demo-target [--gamma-max 8] [--prefill 512] [--batch 1]

Three profiles cover the three kinds of call the runtime makes (S = new tokens, P = bound cache rows):

    profile   S (seq)            P (bound rows)   used for
    decode    1                  1 .. max_ctx     plain decoding, draft steps
    verify    2 .. γmax+1        2 .. max_ctx     one speculative verify pass
    prefill   1 .. prefill_max   1 .. max_ctx     prompts (chunked beyond prefill_max)

The build writes model.plan beside model.onnx and records it in engine.json (extra.tensorrt). It needs
an NVIDIA GPU and the `trt` extra; the profile and option builders below are pure Python.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from edgespec import contract as C


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


def default_profiles(max_context: int, gamma_max: int = 8, prefill_max: int = 512, batch: int = 1) -> list[ProfileSpec]:
    """The bound rows P always hold the S new tokens (P >= S): past's min is seq's min."""
    opt_past = min(256, max_context)
    b = (1, 1, batch)
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


def build_engine(engine_dir: Path, profiles: list[ProfileSpec], fp16: bool = True, workspace_gib: float = 4.0) -> dict:
    """Parse model.onnx, build a TensorRT plan with the given profiles, write model.plan. Needs a GPU."""
    import tensorrt as trt

    engine_dir = Path(engine_dir)
    m = C.Manifest.read(engine_dir)
    if m.kind != "decoder":
        raise ValueError(f"{engine_dir}: only contract decoders (kind 'decoder') build to TensorRT, got {m.kind!r}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    minor = int(trt.__version__.split(".")[1])
    strongly_typed = (major, minor) >= (10, 12) and m.precision == "fp16"
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    if major < 10:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(engine_dir / m.model_file)):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {engine_dir / m.model_file}:\n" + "\n".join(errs))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if fp16 and not strongly_typed:  # TensorRT 10.3 (JetPack 6): weakly typed network + FP16 flag
        config.set_flag(trt.BuilderFlag.FP16)
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes(m, p).items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)
    t0 = time.time()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build {engine_dir / m.model_file} (see the log above)")
    (engine_dir / "model.plan").write_bytes(bytes(plan))
    info = {"plan": "model.plan", "tensorrt_version": trt.__version__, "fp16": fp16,
            "strongly_typed": strongly_typed, "build_seconds": round(time.time() - t0, 1),
            "profiles": [p.__dict__ for p in profiles]}
    m.extra["tensorrt"] = info
    m.write(engine_dir)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--gamma-max", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fp32", action="store_true", help="no FP16 flag")
    ap.add_argument("--print-ort-options", action="store_true", help="only print the ORT TensorRT EP options")
    args = ap.parse_args(argv)
    m = C.Manifest.read(args.engine_dir)
    profiles = default_profiles(m.max_context, args.gamma_max, args.prefill, args.batch)
    if args.print_ort_options:
        print(json.dumps(ort_trt_options(m, args.engine_dir, profiles, not args.fp32), indent=2))
        return 0
    print(json.dumps(build_engine(args.engine_dir, profiles, fp16=not args.fp32), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""TensorRT: a native engine build (model.plan) from a contract decoder, with the optimization profiles of
edgespec/profiles.py (also what ONNX Runtime's TensorRT execution provider is started with).

    python -m edgespec.export.tensorrt engines/demo-target [--gamma-max 8] [--lookup 3 --lookup-gamma 12] [--prefill 512] [--batch 1]

The build writes model.plan beside model.onnx and records it in engine.json (extra.tensorrt). It needs
an NVIDIA GPU and the `trt` extra. `edgespec.load(..., provider="tensorrt")` runs the plan natively.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgespec import contract as C
from edgespec.profiles import ProfileSpec, default_profiles, ort_trt_options, profile_shapes
from edgespec.speculation import from_args, speculation_flags


def build_engine(engine_dir: Path, profiles: list[ProfileSpec], fp16: bool = True, workspace_gib: float = 4.0) -> dict:
    """Parse model.onnx, build a TensorRT plan with the given profiles, write model.plan. Needs a GPU."""
    from edgespec.backends.trt import import_tensorrt

    engine_dir = Path(engine_dir)
    m = C.Manifest.read(engine_dir)
    if m.kind != "decoder":
        raise ValueError(f"{engine_dir}: only contract decoders (kind 'decoder') build to TensorRT, got {m.kind!r}")
    if m.flavor != "portable":  # ONNX Runtime's contrib ops (GroupQueryAttention, ...) are not TensorRT layers
        raise ValueError(f"{engine_dir} is a {m.flavor!r}-flavour graph (ONNX Runtime contrib ops); TensorRT builds "
                         f"the portable graph: re-export with `edgespec export ... --flavor portable`")
    trt = import_tensorrt()  # an EngineError that says what to install when tensorrt is missing
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
    speculation_flags(ap)  # the verify profile covers --gamma-max (or --lookup-gamma) + 1 tokens
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fp32", action="store_true", help="no FP16 flag")
    ap.add_argument("--print-ort-options", action="store_true", help="only print the ORT TensorRT EP options")
    args = ap.parse_args(argv)
    m = C.Manifest.read(args.engine_dir)
    # the native runtime (edgespec/backends/trt.py) binds a fixed max_context rows: tune the plan for that
    profiles = default_profiles(m.max_context, None, args.prefill, args.batch, opt_rows=m.max_context,
                                spec=from_args(args))
    if args.print_ort_options:
        print(json.dumps(ort_trt_options(m, args.engine_dir, profiles, not args.fp32), indent=2))
        return 0
    print(json.dumps(build_engine(args.engine_dir, profiles, fp16=not args.fp32), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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


# ONNX operators (default domain) that TensorRT 10's ONNX parser takes: the "Y" rows of onnx-tensorrt's
# docs/operators.md at its 10.1 release
TENSORRT_OPS = frozenset("""
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike Ceil
    Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace
    DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
    GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
    GroupNormalization GRU HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf
    IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool
    MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot
    Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd
    ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round ScaledTanh Scan Scatter
    ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign
    SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample
    Where Xor""".split())
TENSORRT_OPSETS = (9, 20)  # TensorRT 10.0 parses opsets 9..20
# inputs the parser needs as constants (an initializer or a Constant node): op -> input positions
CONSTANT_INPUTS = {"Slice": (3,), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
                   "ReduceMax": (1,), "ReduceMin": (1,), "TopK": (1,)}


def tensorrt_problems(model) -> list[str]:
    """What in an ONNX model (onnx.ModelProto, weights not needed) TensorRT's ONNX parser refuses: ops outside the
    default domain or TENSORRT_OPS, an opset outside TENSORRT_OPSETS, axes (or K) that are not constants.
    Empty: the graph is one TensorRT can parse, as far as a check without TensorRT can tell."""
    problems = []
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and not TENSORRT_OPSETS[0] <= imp.version <= TENSORRT_OPSETS[1]:
            problems.append(f"opset {imp.version} (TensorRT 10 parses {TENSORRT_OPSETS[0]}..{TENSORRT_OPSETS[1]})")
    constants = {t.name for t in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    seen = set()
    for n in model.graph.node:
        if n.domain not in ("", "ai.onnx"):
            key = f"{n.domain}.{n.op_type}"
            if key not in seen:
                problems.append(f"{key} (not a standard ONNX op)")
                seen.add(key)
            continue
        if n.op_type not in TENSORRT_OPS and n.op_type not in seen:
            problems.append(f"{n.op_type} (not an op TensorRT 10 parses)")
            seen.add(n.op_type)
        for i in CONSTANT_INPUTS.get(n.op_type, ()):
            if i < len(n.input) and n.input[i] and n.input[i] not in constants:
                problems.append(f"{n.op_type} node {n.name!r}: input {i} ({n.input[i]}) must be a constant")
    return problems


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
    import onnx
    problems = tensorrt_problems(onnx.load(str(engine_dir / m.model_file), load_external_data=False))
    if problems:
        raise ValueError(f"{engine_dir / m.model_file}: TensorRT cannot parse this graph: {'; '.join(problems[:6])}")
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

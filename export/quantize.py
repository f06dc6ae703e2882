"""Integer precisions of an exported fp32 graph, and the weight bytes a graph reads per decoded token.

    python -m edgespec.export.quantize engines/demo-target/model.onnx      # weight bytes per token, by kind

`edgespec export --dtype D` calls `quantize(D, fp32.onnx, out.onnx)`; the record it returns goes into
engine.json (extra.quantization). What each integer precision means:

  int4          weight-only, block-wise: every MatMul weight [K, N] becomes ONNX Runtime's MatMulNBits
  int8          (com.microsoft) with 4- or 8-bit blocks of BLOCK_SIZE values along K, one float scale and
                one zero point per block (asymmetric); int4 keeps the lm_head at 8 bits (WEIGHT_ONLY); the
                KV cache and the I/O stay float32. Made by onnxruntime.quantization's MatMulNBitsQuantizer
                (round to nearest), not by hand. A contrib op: ONNX Runtime runs it (CPU, CUDA), TensorRT
                does not.
  int8-dynamic  the earlier int8: quantize_dynamic, int8 weights per output channel, activations quantized
                to uint8 at run time (DynamicQuantizeLinear + MatMulInteger).

    MatMul(x [B,S,K], W [K,N] f32)  ──▶  MatMulNBits(x, W_q [N, ceil(K/bs), bs*bits/8] u8,
                                                        scales [N*ceil(K/bs)] f32, zero_points u8)

K need not be a multiple of the block size: the quantizer pads the last block with zeros and the kernel
takes the true K as an attribute (the tiny test models' K = 48 with 32-value blocks). The token embedding
(a Gather: one row read per token) stays float32; a tied lm_head is its own MatMul weight in the graph.

Weight bytes per token (`weight_bytes_per_token`): the initializers a decode step reads, counted once each:
whole tensors, except tables indexed by position or token id (the embedding, rotary caches: ROW_TABLES), of which
one row per token. They are the graph's stored bytes: a kernel may repack them at load (MLAS does), so this is
the streamed size up to that layout. The KV cache is not a weight: 2 x layers x kv heads x head dim x its dtype's
bytes more per token of context.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BLOCK_SIZE = 32  # values per block along K: divides every K of the bundled models (256..2816); 128 read 15%
#                 fewer bytes but cost the int4 demo target 2-4 points of top-1 agreement (docs/export.md)
ACCURACY_LEVEL = 4  # MatMulNBits compute: 4 = activations to int8 per block (MLAS int8 kernels). On this x86 CPU
#                     the 8-bit kernel at level 0 (float32 compute) ran ~10x slower than the fp32 graph.
ROW_TABLES = {"Gather": (0,), "GroupQueryAttention": (7, 8), "RotaryEmbedding": (2, 3)}  # (op: inputs) read
#   one row per token: the embedding table, the rotary cos / sin caches (com.microsoft input order)


@dataclass(frozen=True)
class WeightOnly:
    """Block-wise weight-only quantization of every MatMul weight through MatMulNBits; the output projection
    (lm_head: the MatMul that makes the logits) gets `head_bits`."""
    bits: int
    head_bits: int | None = None  # None: the same as bits
    block_size: int = BLOCK_SIZE
    symmetric: bool = False
    accuracy_level: int = ACCURACY_LEVEL

    def __post_init__(self):
        for name in ("bits", "head_bits"):
            v = getattr(self, name)
            if v not in (4, 8) and not (name == "head_bits" and v is None):
                raise ValueError(f"{name} must be 4 or 8 (what MatMulNBits runs on the CPU), got {v}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16 (MatMulNBits), got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4 (MatMulNBits), got {self.accuracy_level}")


# int4 keeps the lm_head at 8 bits: on the demo target +7% bytes per token, top-1 agreement 0.958 -> 0.976
WEIGHT_ONLY = {"int4": WeightOnly(bits=4, head_bits=8), "int8": WeightOnly(bits=8)}
DYNAMIC = ("int8-dynamic",)
INTEGER_PRECISIONS = tuple(WEIGHT_ONLY) + DYNAMIC


def quantize(precision: str, src: Path, dst: Path, settings: WeightOnly | None = None,
             external: bool = False) -> dict:
    """fp32 graph `src` -> integer-precision graph `dst`; returns the record engine.json keeps (with
    `external`, the weights go to a data file beside dst: the record's "external_data" names it)."""
    if precision in WEIGHT_ONLY:
        return weight_only(src, dst, settings or WEIGHT_ONLY[precision], external)
    if precision in DYNAMIC:
        return dynamic_int8(src, dst, external)
    raise ValueError(f"integer precision must be one of {INTEGER_PRECISIONS}, got {precision!r}")


CHUNK_BYTES = 256 << 20  # float32 weight bytes loaded per quantizer pass (one layer of a 3B model: ~0.4 GB)


def weight_only(src: Path, dst: Path, settings: WeightOnly, external: bool = False) -> dict:
    """Every MatMul with a constant [K, N] weight -> MatMulNBits (module docstring). The graph is read without
    its external weights; ONNX Runtime's quantizer then runs on a graph of its own per chunk of MatMuls (their
    nodes and weights only, CHUNK_BYTES of float32 at most) whose quantized nodes and weights replace the
    originals. A chunk's graph is dropped whole after its pass: a protobuf message keeps the memory of every
    field it ever held, so float32 weights loaded into the model itself would stay until the end."""
    import onnx
    from onnx import TensorProto, helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from .external import load_inline

    src = Path(src)
    model = onnx.load(str(src), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    matmuls = sum(n.op_type == "MatMul" for n in model.graph.node)
    seen: set[str] = set()
    for i, n in enumerate(nodes):  # each chunk's result is matched back by node name: each needs its own
        if not n.name or n.name in seen:
            n.name = f"{n.name or 'MatMul'}_weight_only_{i}"
        seen.add(n.name)
    head = output_projection(model) if settings.head_bits not in (None, settings.bits) else None
    by_name = {n.name: n for n in nodes}
    size = {n.name: 4 * int(np.prod(inits[n.input[1]].dims, dtype=np.int64)) for n in nodes}
    passes = []  # (bits, [node names]) in graph order, at most CHUNK_BYTES of float32 weights each
    for bits, names in ((settings.bits, [n.name for n in nodes if n.name != head]),
                        (settings.head_bits, [head] if head else [])):
        chunk, held = [], 0
        for name in names:
            if chunk and held + size[name] > CHUNK_BYTES:
                passes.append((bits, chunk))
                chunk, held = [], 0
            chunk.append(name)
            held += size[name]
        if chunk:
            passes.append((bits, chunk))
    replaced: dict[str, onnx.NodeProto] = {}  # original node name -> its MatMulNBits node
    new_inits: list[onnx.TensorProto] = []
    opsets = {o.domain: o.version for o in model.opset_import}
    with _quiet():
        for bits, chunk in passes:
            part = onnx.ModelProto()
            part.ir_version = model.ir_version
            part.opset_import.extend(model.opset_import)
            part.graph.name = "weight-only chunk"
            for name in chunk:
                n = by_name[name]
                part.graph.node.add().CopyFrom(n)
                t = part.graph.initializer.add()
                t.CopyFrom(inits[n.input[1]])
                load_inline(t, src.parent)
                part.graph.input.append(helper.make_tensor_value_info(n.input[0], TensorProto.FLOAT, None))
                part.graph.output.append(helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None))
            q = MatMulNBitsQuantizer(part, bits=bits, block_size=settings.block_size,
                                     is_symmetric=settings.symmetric, accuracy_level=settings.accuracy_level or None,
                                     op_types_to_quantize=("MatMul",))
            q.process()
            part = q.model.model
            made = {n.output[0]: n for n in part.graph.node}
            for name in chunk:
                out = made.get(by_name[name].output[0])
                if out is None or len(part.graph.node) != len(chunk):
                    raise ValueError(f"{src}: the quantizer did not turn MatMul {name!r} into one node (expected one "
                                     f"MatMulNBits per MatMul, got {[n.op_type for n in part.graph.node]})")
                replaced[name] = onnx.NodeProto()
                replaced[name].CopyFrom(out)
            for t in part.graph.initializer:  # copies: a reference into `part` would keep all of it alive
                new_inits.append(onnx.TensorProto())
                new_inits[-1].CopyFrom(t)
            for o in part.opset_import:
                opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
            model.ir_version = max(model.ir_version, part.ir_version)
            del part, q
    gone = {by_name[name].input[1] for name in replaced}
    kept_nodes = [replaced.get(n.name, n) for n in model.graph.node]
    kept_inits = [t for t in model.graph.initializer if t.name not in gone]
    del model.graph.node[:]
    model.graph.node.extend(kept_nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_inits + new_inits)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets.items())
    for t in model.graph.initializer:  # what stays as it was (the embedding, norms, rotary tables)
        load_inline(t, src.parent)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    if not nbits:
        raise ValueError(f"{src}: no MatMul with a constant weight to quantize (expected the exported decoder's "
                         f"projections, got {matmuls} MatMul nodes, none quantized)")
    from .external import save_model
    data = save_model(model, Path(dst), external)
    return {"method": "weight-only MatMulNBits (onnxruntime MatMulNBitsQuantizer, round to nearest)",
            **asdict(settings), "head": head, "quantized_matmuls": len(nbits),
            "activation_matmuls": matmuls - len(nbits),  # attention scores: no constant weight
            **({"external_data": data} if data else {})}


def dynamic_int8(src: Path, dst: Path, external: bool = False) -> dict:
    """Dynamic int8 quantization of the MatMul weights, per output channel (CPU / ARM)."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # DefaultTensorType: ONNX shape inference gives contrib ops' outputs (the ort flavour's) no type; all float32
    with _quiet():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul", "Gemm"], use_external_data_format=external,
                         extra_options={"DefaultTensorType": TensorProto.FLOAT})
    data = Path(dst).name + ".data"
    return {"method": "dynamic int8 (onnxruntime quantize_dynamic: int8 weights per output channel, activations "
                      "quantized at run time)", "bits": 8, "per_channel": True,
            **({"external_data": data} if external and (Path(dst).parent / data).is_file() else {})}


def output_projection(model) -> str | None:
    """Name of the MatMul (with a constant weight) that makes the `logits` output, through at most a few
    one-input nodes (a Cast, a Reshape); None when the graph has no such named node."""
    from edgespec.contract import LOGITS

    producer = {o: n for n in model.graph.node for o in n.output}
    consts = {t.name for t in model.graph.initializer}
    name = LOGITS
    for _ in range(4):
        node = producer.get(name)
        if node is None:
            return None
        if node.op_type == "MatMul":
            return node.name if node.name and node.input[1] in consts else None
        name = node.input[0]
    return None


@contextlib.contextmanager
def _quiet():
    """ONNX Runtime's quantizers log every node (INFO) and advice (WARNING) through the root logger."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime.quantization")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _kind(node, index: int, array: np.ndarray) -> str:
    """What a weight input is, for the by-kind breakdown."""
    if node is not None and node.op_type == "MatMulNBits":
        bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
        return {1: f"{bits}-bit blocks", 2: f"block scales ({array.dtype})", 3: "block zero points"}.get(
            index, str(array.dtype))
    return str(array.dtype)


def weight_bytes_per_token(model_path: str | Path) -> dict:
    """Bytes of weights one decode step reads (module docstring): {"total": n, "by_kind": {kind: n}}."""
    import onnx
    from onnx import helper

    model = onnx.load(str(model_path), load_external_data=False)  # sizes from the dims: no weight is read
    tensors = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:  # Constant nodes hold weights too in some exports
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            tensors[n.output[0]] = n.attribute[0].t
    read: dict[str, tuple[int, str]] = {}  # tensor -> (bytes per step, kind): the most any consumer reads
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name not in tensors:
                continue
            t = tensors[name]
            a = np.empty(0, helper.tensor_dtype_to_np_dtype(t.data_type))  # the dtype, for the kind
            dims = list(t.dims)
            size = int(np.prod(dims, dtype=np.int64)) * a.itemsize
            if i in ROW_TABLES.get(node.op_type, ()) and dims and dims[0]:
                size //= dims[0]  # one row per token
            if size >= read.get(name, (-1, ""))[0]:
                read[name] = (int(size), _kind(node, i, a))
    by_kind: dict[str, int] = {}
    for size, kind in read.values():
        by_kind[kind] = by_kind.get(kind, 0) + size
    return {"total": sum(by_kind.values()), "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="weight bytes a graph reads per decoded token, by kind")
    ap.add_argument("model", type=Path, help="an ONNX graph (an engine folder's model.onnx)")
    args = ap.parse_args(argv)
    print(json.dumps(weight_bytes_per_token(args.model), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Weights in an ONNX external data file, one tensor at a time, and the fp16 variant of an fp32 graph made
without loading its weights all at once.

ONNX's protobuf stops at 2 GB and `onnx.load` reads every weight into memory: a 3B-parameter fp32 graph is
11 GiB of tensors. The exporter therefore keeps weights in `<model>.data` beside the graph and touches them
here, one tensor at a time:

  DataWriter      appends arrays to a data file (offsets multiples of ALIGN) and returns the TensorProto that
                  points at each: the graph builder streams every weight through it as it is made.
  read_tensor     one initializer's array, from its raw data or from the data file (np.fromfile at its offset).
  load_inline     one external initializer's data into the proto (what onnx.load does for all of them).
  fp16_graph      the fp16 variant: ONNX Runtime's converter (onnxruntime.transformers.float16) decides what
                  becomes float16 and inserts the casts; it runs on the graph with each external weight
                  replaced by a one-element stand-in of the same name and type (the converter's decisions
                  depend on the graph, not on the values), then every weight the converter turned to float16
                  is converted by the converter's own rounding (convert_np_to_float16) as it is copied to the
                  new data file, and the rest are copied as they are. The result is the graph
                  `convert_float_to_float16` makes from the fully loaded model (tests/test_external.py checks
                  that the two compute the same logits, bit for bit).

The weight-only integer variants (quantize.weight_only) load their MatMul weights a few at a time with
`load_inline` and quantize them with ONNX Runtime's MatMulNBitsQuantizer chunk by chunk.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

EXTERNAL_MIN = 1024  # bytes: initializers at least this large go to the external data file
ALIGN = 64  # external data offsets are multiples of this


class DataWriter:
    """Appends arrays to the data file `path` (created empty); `tensor(name, arr)` -> the TensorProto that
    points at the bytes just written (arrays under EXTERNAL_MIN bytes stay inline in the proto)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self.bytes = 0

    def tensor(self, name: str, arr: np.ndarray):
        from onnx import TensorProto, helper, numpy_helper

        arr = np.asarray(arr)
        if arr.nbytes < EXTERNAL_MIN:
            return numpy_helper.from_array(arr, name)
        if self._file is None:
            raise ValueError(f"{self.path}: the data file is closed; {name!r} was not written")
        pad = (-self.bytes) % ALIGN
        self._file.write(b"\0" * pad)
        offset = self.bytes + pad
        np.ascontiguousarray(arr).tofile(self._file)
        self.bytes = offset + arr.nbytes
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def is_external(t) -> bool:
    from onnx import TensorProto
    return t.data_location == TensorProto.EXTERNAL


def read_tensor(t, base_dir: Path) -> np.ndarray:
    """Initializer `t`'s array; an external one read from its file under base_dir (ValueError when the file
    does not hold the bytes its shape and type need)."""
    from onnx import helper, numpy_helper

    if not is_external(t):
        return numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    path = Path(base_dir) / info["location"]
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    count = int(np.prod(t.dims, dtype=np.int64))
    offset = int(info.get("offset", 0))
    length = int(info.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize or not path.is_file() or offset + length > path.stat().st_size:
        raise ValueError(f"{path}: initializer {t.name!r} expects {count * dtype.itemsize} bytes of {dtype} "
                         f"at offset {offset}; the file holds {path.stat().st_size if path.is_file() else 'nothing'}"
                         f" (length recorded: {length})")
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(tuple(t.dims))


def load_inline(t, base_dir: Path) -> None:
    """An external initializer's data into the proto itself (raw_data), its external reference removed."""
    from onnx import TensorProto

    if not is_external(t):
        return
    arr = read_tensor(t, base_dir)
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT
    t.raw_data = np.ascontiguousarray(arr).tobytes()


def fp16_graph(src: Path, dst: Path, keep_io: list[str], external: bool) -> str | None:
    """fp32 graph `src` -> the fp16 graph `dst` (module docstring); with `external`, its weights go to
    dst.name + ".data" beside it. keep_io: graph inputs and outputs that stay float32 (the converter's
    keep_io_types). -> the data file's name, or None."""
    import onnx
    from onnx import TensorProto
    from onnxruntime.transformers.float16 import convert_float_to_float16, convert_np_to_float16

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=False)
    stand_ins: dict[str, onnx.TensorProto] = {}  # name -> the original (external) initializer
    for t in model.graph.initializer:
        if is_external(t) and t.data_type == TensorProto.FLOAT:
            original = onnx.TensorProto()
            original.CopyFrom(t)
            stand_ins[t.name] = original
            t.Clear()
            t.CopyFrom(onnx.numpy_helper.from_array(np.zeros(1, np.float32), original.name))
    unknown = [t.name for t in model.graph.initializer if is_external(t) and t.name not in stand_ins]
    if unknown:  # only float32 weights are written external by the builder
        raise ValueError(f"{src}: external initializers of a type other than float32: {unknown[:3]}")
    model = convert_float_to_float16(model, keep_io_types=keep_io, disable_shape_infer=external or bool(stand_ins))
    writer = DataWriter(dst.parent / (dst.name + ".data")) if external else None
    try:
        for t in model.graph.initializer:
            original = stand_ins.get(t.name)
            if original is None:
                continue
            arr = read_tensor(original, src.parent)
            if t.data_type == TensorProto.FLOAT16:  # the converter chose float16 for this weight
                arr = convert_np_to_float16(arr)
            elif t.data_type != TensorProto.FLOAT:
                raise ValueError(f"{src}: the fp16 converter gave {t.name!r} type {t.data_type}; expected "
                                 f"float16 or float32")
            t.CopyFrom(writer.tensor(t.name, arr) if writer else onnx.numpy_helper.from_array(arr, t.name))
            del arr
    finally:
        if writer is not None:
            writer.close()
    if writer is None and model.ByteSize() > 2 ** 31 - 1:
        raise ValueError(f"{dst}: the fp16 graph is {model.ByteSize() / 2**30:.1f} GiB inline, over ONNX's 2 GB "
                         f"protobuf limit; export with external data")
    onnx.save(model, str(dst))
    return writer.path.name if writer else None


__all__ = ["ALIGN", "EXTERNAL_MIN", "DataWriter", "fp16_graph", "is_external", "load_inline", "read_tensor"]


def save_model(model, path: Path, external: bool) -> str | None:
    """Save `model` to path; with `external`, its weights into path.name + ".data" beside it. -> that file's
    name, or None."""
    import onnx

    if not external:
        onnx.save(model, str(path))
        return None
    data = path.name + ".data"
    if (path.parent / data).exists():
        (path.parent / data).unlink()  # onnx appends to an existing file
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
              size_threshold=1024)
    return data

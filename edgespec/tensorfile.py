"""A float32 array in PyTorch's `torch.save` file format, written with numpy alone.

vLLM takes prompt embeddings as base64 of a `torch.save` file (remote.py sends the VLA prefix that way); the
runtime has no torch, so it writes the format itself: a stored (uncompressed) zip holding a protocol-2
pickle that calls `torch._utils._rebuild_tensor_v2` on one persistent storage, the storage's raw
little-endian bytes, and the byte order and version records. `torch.load(..., weights_only=True)` reads it
(tests/test_tensorfile.py checks that against torch).
"""
from __future__ import annotations

import io
import struct
import zipfile

import numpy as np


def _int(n: int) -> bytes:
    """A pickle opcode pushing the non-negative int n."""
    if n < 256:
        return b"K" + bytes([n])  # BININT1
    if n < 65536:
        return b"M" + struct.pack("<H", n)  # BININT2
    if n < 2 ** 31:
        return b"J" + struct.pack("<i", n)  # BININT
    raise ValueError(f"{n} elements: too large for one tensor file")


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"  # MARK ... TUPLE


def _pickle(shape: tuple[int, ...], numel: int) -> bytes:
    """_rebuild_tensor_v2(storage '0' (FloatStorage, cpu, numel), offset 0, shape, C-order strides, no grad,
    OrderedDict()) as protocol-2 opcodes."""
    strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    storage = _tuple([_str("storage"), b"ctorch\nFloatStorage\n", _str("0"), _str("cpu"), _int(numel)]) + b"Q"
    args = _tuple([storage, _int(0), _tuple([_int(d) for d in shape]), _tuple([_int(s) for s in strides]),
                   b"\x89", b"ccollections\nOrderedDict\n)R"])  # NEWFALSE; OrderedDict() by REDUCE
    return b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R."


def torch_bytes(x) -> bytes:
    """x (any shape, float32-castable and finite) -> the bytes `torch.save(torch.from_numpy(x))` would load as."""
    a = np.ascontiguousarray(np.asarray(x, dtype="<f4"))
    if not np.isfinite(a).all():
        raise ValueError("the array holds NaN or inf; refusing to send it as embeddings")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", _pickle(a.shape, a.size))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", a.tobytes())
        z.writestr("archive/version", "3\n")
    return buf.getvalue()

"""Buffers on the engine's device: the KV cache and the outputs a decoder binds.

    HostMemory     numpy arrays (the CPU provider)
    OrtCudaMemory  ONNX Runtime OrtValues in CUDA memory (the CUDA and TensorRT execution providers)

A `Buffer` has a device address (`ptr`), a shape and a dtype, which is all an IOBinding or a TensorRT
context needs. `to_host` copies a buffer back (on the CPU it is the array itself, no copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Buffer:
    shape: tuple  # e.g. (B, Hkv, T, D)
    dtype: np.dtype
    ptr: int  # device address of element 0
    handle: object  # what owns the memory: np.ndarray or OrtValue

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class HostMemory:
    """Zero-initialised numpy arrays; `to_host` returns the array itself."""
    device, device_id = "cpu", 0

    def zeros(self, shape, dtype) -> Buffer:
        a = np.zeros(shape, dtype)
        return Buffer(tuple(shape), a.dtype, a.ctypes.data, a)

    def to_host(self, buf: Buffer) -> np.ndarray:
        return buf.handle

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Copy a host array of buf's shape into buf."""
        np.copyto(buf.handle, host)

    def sub(self, buf: Buffer, offset: int, shape, dtype) -> Buffer:
        """An array of `shape` and `dtype` inside buf, `offset` bytes from its start (no copy; must fit)."""
        dtype, shape = np.dtype(dtype), tuple(int(x) for x in shape)
        n = int(np.prod(shape)) * dtype.itemsize
        if offset < 0 or offset + n > buf.nbytes:
            raise ValueError(f"{shape} {dtype} at byte {offset} does not fit in a buffer of {buf.nbytes} bytes")
        view = np.ascontiguousarray(buf.handle).reshape(-1).view(np.uint8)[offset:offset + n].view(dtype).reshape(shape)
        return Buffer(shape, dtype, buf.ptr + offset, view)

    def zero_rows(self, buf: Buffer, b: int, start: int, stop: int) -> None:
        """Zero rows start..stop-1 of sequence b in a (B, Hkv, T, D) buffer. Rare (after a failed call), so
        on a device it is a round trip through the host."""
        host = self.to_host(buf)
        host[b, :, start:stop] = 0
        self.write(buf, host)

    def grow(self, old: Buffer, rows: int, axis: int = 2) -> Buffer:
        """A zero buffer like `old` with `rows` along `axis`, holding old's contents at the front."""
        shape = list(old.shape)
        keep, shape[axis] = min(shape[axis], rows), rows
        new = self.zeros(shape, old.dtype)
        idx = (slice(None),) * axis + (slice(0, keep),)
        new.handle[idx] = old.handle[idx]
        return new


class OrtCudaMemory(HostMemory):
    """OrtValues in CUDA memory (device `device_id`), zero-initialised. Growing copies through the host:
    it happens once per KVCache chunk of new rows, not per step."""
    device = "cuda"

    def __init__(self, device_id: int = 0):
        import onnxruntime as ort
        self._ort, self.device_id = ort, device_id

    def zeros(self, shape, dtype) -> Buffer:
        ov = self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, "cuda",
                                                              self.device_id)
        ov.update_inplace(np.zeros(shape, dtype))
        return Buffer(tuple(shape), np.dtype(dtype), ov.data_ptr(), ov)

    def to_host(self, buf: Buffer) -> np.ndarray:
        return buf.handle.numpy()

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        buf.handle.update_inplace(np.ascontiguousarray(host, dtype=buf.dtype))

    def grow(self, old: Buffer, rows: int, axis: int = 2) -> Buffer:
        host = self.to_host(old)
        shape = list(old.shape)
        keep, shape[axis] = min(shape[axis], rows), rows
        grown = np.zeros(shape, old.dtype)
        idx = (slice(None),) * axis + (slice(0, keep),)
        grown[idx] = host[idx]
        new = self.zeros(shape, old.dtype)
        new.handle.update_inplace(grown)
        return new

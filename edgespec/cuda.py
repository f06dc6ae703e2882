"""A thin cuda-python layer: error checks, a stream, and CUDA device buffers for the native TensorRT path.

    ok, why = gpu_available()            # never raises: (False, reason) on a machine without a GPU / driver
    mem = CudaMemory(device_id=0)        # same interface as memory.HostMemory, buffers in device memory
    buf = mem.zeros((B, Hkv, T, D), np.float16)

cuda-python returns a tuple from every call: (err,) or (err, value). `check` turns a non-success err into a
RuntimeError naming the error. Two import layouts exist: `cuda.bindings.runtime` (cuda-python >= 12.6.1,
the only one in 13.x) and `cuda.cudart` (12.6.0 and older). All copies run on one non-blocking stream per
CudaMemory, so they are ordered with the engine calls the decoder enqueues on the same stream.
"""
from __future__ import annotations

import numpy as np

from .memory import Buffer, HostMemory

_CUDART = None  # the cuda-python runtime module, loaded on first use (tests may put a fake here)
CUDA_PYTHON_HINT = ("install cuda-python of your driver's CUDA major: the `trt` extra (cuda-python 13, a driver >= 580) "
                    "or `trt-cu12` (cuda-python 12: JetPack 6, older drivers)")


def cudart():
    """The cuda-python runtime module (ImportError with an install hint when cuda-python is missing)."""
    global _CUDART
    if _CUDART is None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            try:  # cuda-python < 12.6.1
                from cuda import cudart as rt
            except ImportError as e:
                raise ImportError(f"cuda-python is not installed ({e}); {CUDA_PYTHON_HINT}") from None
        _CUDART = rt
    return _CUDART


def check(ret):
    """ret: the tuple a cuda-python call returned. Raise on a non-success error; else the value(s)."""
    rt = cudart()
    err = ret[0]
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {_err_name(err)}: {error_string(err)}")
    if len(ret) == 1:
        return None
    return ret[1] if len(ret) == 2 else ret[1:]


def error_string(err) -> str:
    try:
        msg = cudart().cudaGetErrorString(err)[1]
        return msg.decode() if isinstance(msg, bytes) else str(msg)
    except Exception:  # noqa: BLE001 - a message must never hide the error it describes
        return "(no message)"


def _err_name(err) -> str:
    return getattr(err, "name", str(err))


def gpu_available(device_id: int = 0) -> tuple[bool, str]:
    """(True, "1 CUDA device(s); device 0: <name> (compute X.Y)") or (False, why). Never raises: catches a
    missing cuda-python, a RuntimeError from dlopen (cuda-python 12.6.0 without a driver) and error codes
    (12.9+ / 13.x without a driver return cudaErrorInsufficientDriver)."""
    try:
        rt = cudart()
    except ImportError as e:
        return False, str(e)
    try:
        ret = rt.cudaGetDeviceCount()
        if ret[0] != rt.cudaError_t.cudaSuccess:
            return False, f"no usable CUDA device: {_err_name(ret[0])}: {error_string(ret[0])}"
        if not ret[1]:
            return False, "no CUDA device found (cudaGetDeviceCount = 0)"
        if device_id >= ret[1]:
            return False, f"CUDA device {device_id} requested, {ret[1]} present"
        info = device_info(device_id)
        return True, f"{ret[1]} CUDA device(s); device {device_id}: {info['name']} (compute {info['compute']})"
    except Exception as e:  # noqa: BLE001 - e.g. "Failed to dlopen libcuda.so.1"
        return False, f"CUDA runtime unusable: {type(e).__name__}: {e}"


def device_info(device_id: int = 0) -> dict:
    """{'name', 'compute' ('8.7'), 'major', 'minor', 'total_mem', 'integrated'} of a device (raises on error)."""
    p = check(cudart().cudaGetDeviceProperties(device_id))
    name = p.name.decode(errors="replace").rstrip("\x00") if isinstance(p.name, bytes) else str(p.name)
    return {"name": name, "compute": f"{p.major}.{p.minor}", "major": int(p.major), "minor": int(p.minor),
            "total_mem": int(p.totalGlobalMem), "integrated": bool(p.integrated)}


class Stream:
    """A non-blocking CUDA stream (TensorRT warns that the default stream adds device-wide syncs).
    `handle` is the int TensorRT's execute_async_v3 and the copy calls take."""

    def __init__(self):
        rt = cudart()
        self._rt = rt
        self.obj = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self.handle = int(self.obj)  # cudaStream_t implements __int__ (not getPtr(): that is the handle's storage)

    def synchronize(self) -> None:
        check(self._rt.cudaStreamSynchronize(self.obj))

    def __del__(self):
        try:
            self._rt.cudaStreamDestroy(self.obj)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _DeviceAlloc:
    """Owns one cudaMalloc allocation; cudaFree on garbage collection."""

    def __init__(self, nbytes: int):
        self._rt = cudart()
        self.nbytes = nbytes
        self.ptr = int(check(self._rt.cudaMalloc(max(nbytes, 1))))  # cudaMalloc pointers are 256-byte aligned

    def __del__(self):
        try:
            self._rt.cudaFree(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class CudaMemory(HostMemory):
    """Zero-initialised buffers in CUDA memory of device `device_id`; every copy runs on `self.stream`.
    `to_host` / `write` synchronise that stream; `copy_from_host_async` does not (for the small per-call
    inputs: pageable host memory is staged before cudaMemcpyAsync returns, so the array may be reused)."""
    device = "cuda"

    def __init__(self, device_id: int = 0, stream: Stream | None = None):
        self.device_id = device_id
        check(cudart().cudaSetDevice(device_id))
        self.stream = stream or Stream()

    def zeros(self, shape, dtype) -> Buffer:
        dtype = np.dtype(dtype)
        shape = tuple(int(x) for x in shape)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        alloc = _DeviceAlloc(nbytes)
        if nbytes:
            check(cudart().cudaMemsetAsync(alloc.ptr, 0, nbytes, self.stream.handle))
            self.stream.synchronize()
        return Buffer(shape, dtype, alloc.ptr, alloc)

    def to_host(self, buf: Buffer) -> np.ndarray:
        """A new host array (buf.shape) holding buf's contents (waits for the stream's earlier work)."""
        rt = cudart()
        host = np.empty(buf.shape, buf.dtype)
        if host.nbytes:
            check(rt.cudaMemcpyAsync(host.ctypes.data, buf.ptr, host.nbytes,
                                     rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream.handle))
        self.stream.synchronize()
        return host

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        """Copy a host array of buf's shape into buf (synchronous)."""
        self.copy_from_host_async(buf, host)
        self.stream.synchronize()

    def copy_from_host_async(self, buf: Buffer, host: np.ndarray, stream: Stream | None = None) -> None:
        """Enqueue an H2D copy of `host` (buf's shape and dtype) into buf on `stream` (default: ours)."""
        rt = cudart()
        host = np.ascontiguousarray(host, dtype=buf.dtype)
        if host.shape != tuple(buf.shape):
            raise ValueError(f"host array {host.shape} does not match the device buffer {tuple(buf.shape)}")
        if host.nbytes:
            check(rt.cudaMemcpyAsync(buf.ptr, host.ctypes.data, host.nbytes,
                                     rt.cudaMemcpyKind.cudaMemcpyHostToDevice, (stream or self.stream).handle))

    def grow(self, old: Buffer, rows: int, axis: int = 2) -> Buffer:
        """A zero buffer like `old` with `rows` along `axis`, old's rows at the front, copied on the device.

        Viewed as (outer, rows, inner) with outer = prod(shape[:axis]) and inner = prod(shape[axis+1:]),
        each outer slab is contiguous: for a (B, Hkv, T, D) cache, outer = B*Hkv and a slab holds T*D
        elements. One cudaMemcpy2DAsync copies `outer` rows of keep*inner elements between pitches
        old_rows*inner and rows*inner (in bytes)."""
        rt = cudart()
        shape = list(old.shape)
        keep = min(shape[axis], rows)
        outer, inner = int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1:]))
        isz = np.dtype(old.dtype).itemsize
        spitch = shape[axis] * inner * isz
        shape[axis] = rows
        new = self.zeros(shape, old.dtype)
        if keep and outer and inner:
            check(rt.cudaMemcpy2DAsync(new.ptr, rows * inner * isz, old.ptr, spitch, keep * inner * isz, outer,
                                       rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream.handle))
            self.stream.synchronize()
        return new

    @staticmethod
    def view(buf: Buffer, shape) -> Buffer:
        """The front of `buf` seen as a dense array of `shape` (no copy; must fit)."""
        v = Buffer(tuple(int(x) for x in shape), buf.dtype, buf.ptr, buf.handle)
        if v.nbytes > buf.nbytes:
            raise ValueError(f"view {v.shape} does not fit in a buffer of {buf.shape}")
        return v

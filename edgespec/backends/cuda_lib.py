"""The CUDA step's library: edgespec/cuda_step.cu compiled on first use with nvcc for this machine's GPU into
$EDGESPEC_CACHE (default ~/.cache/edgespec)/cuda/, one file per source, nvcc and GPU architecture, loaded once
per process; and `CudaRuntime`, what cuda_native.py asks of a device (memory, streams, enqueued calls, graphs).

No cuda-python, CuPy or PyTorch: the library links the CUDA runtime statically (nvcc's default), so nvcc and a
driver are all it needs, on an x86 GPU machine as on a Jetson.

    EDGESPEC_CUDA_ARCH   the architecture to build for, e.g. 90 or sm_87 (default: the GPU nvidia-smi reports,
                         else nvcc's -arch=native)
    EDGESPEC_NVCC        the nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..contract import EngineError
from ..memory import Buffer, HostMemory
from .native_lib import _Model

SOURCE = Path(__file__).resolve().parents[1] / "cuda_step.cu"  # package data of edgespec (pyproject.toml)
ARCHS = ("87", "90", "110")  # Jetson Orin, H100 / H200, Jetson Thor: what CI compiles for where nvcc knows them
NVCC_HINT = ("install the CUDA toolkit's compiler (nvcc: on a Jetson it comes with JetPack; elsewhere "
             "`apt-get install cuda-nvcc-13-0` from NVIDIA's repository), or set EDGESPEC_NVCC")


def cache_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec") / "cuda"


def nvcc() -> str | None:
    """$EDGESPEC_NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc; None when there is none."""
    want = os.environ.get("EDGESPEC_NVCC")
    if want:
        return shutil.which(want)
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def nvcc_archs(compiler: str) -> list[str]:
    """The sm_XX architectures this nvcc compiles for (`nvcc --list-gpu-arch`: compute_XX), as "XX"."""
    r = subprocess.run([compiler, "--list-gpu-arch"], capture_output=True, text=True)
    return sorted({m.group(1) for m in re.finditer(r"compute_(\d+)", r.stdout)}, key=int)


def gpu_arch() -> str:
    """The architecture to build for: $EDGESPEC_CUDA_ARCH ("90", "sm_90", "9.0"), else the compute capability
    nvidia-smi reports for GPU 0, else "native" (nvcc asks the driver)."""
    want = os.environ.get("EDGESPEC_CUDA_ARCH", "").strip().lower().removeprefix("sm_")
    if want:
        arch = want.replace(".", "")
        if not arch.isdigit():
            raise EngineError(f"EDGESPEC_CUDA_ARCH must name an architecture like 90 or sm_87, got {want!r}")
        return arch
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
            first = r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""
            if re.fullmatch(r"\d+\.\d+", first):
                return first.replace(".", "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "native"


def build_command(compiler: str, arch: str, out: str) -> list[str]:
    """nvcc's command line for `arch` ("native" or digits: machine code for sm_XX and PTX for newer GPUs)."""
    target = ["-arch=native"] if arch == "native" else [f"-gencode=arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
    return [compiler, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *target, str(SOURCE), "-o", out]


def build_library(arch: str | None = None) -> Path:
    """Compile cuda_step.cu for `arch` (default: gpu_arch()) once per source, nvcc and architecture: -> its path."""
    compiler = nvcc()
    if compiler is None:
        raise EngineError(f"provider 'cuda-native' compiles {SOURCE.name} on first use and found no nvcc: {NVCC_HINT}")
    arch = arch or gpu_arch()
    version = subprocess.run([compiler, "--version"], capture_output=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version + arch.encode()).hexdigest()[:16]
    out = cache_dir() / f"edgespec_cuda-sm_{arch}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = build_command(compiler, arch, tmp)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise EngineError(f"provider 'cuda-native': compiling {SOURCE} failed ({' '.join(cmd)}):\n{r.stderr.strip()}")
    os.replace(tmp, out)  # atomic: a concurrent build writes the same bytes
    return out


class _Io(ctypes.Structure):
    """cuda_step.cu's ecs_io, field for field: one decoder's buffers (device addresses unless named host)."""
    _fields_ = [(n, ctypes.c_int64) for n in ("B", "rows", "cap", "nsplit")] + [
        ("kc", ctypes.POINTER(ctypes.c_void_p)), ("vc", ctypes.POINTER(ctypes.c_void_p))] + [
        (n, ctypes.c_void_p) for n in ("params_host", "params", "next_host", "next", "logits", "x", "h", "tmp", "qkv",
                                       "q", "att", "mlp", "part", "stream", "ev0", "ev1", "embeds_host")]


def load(path: Path):
    """A built library, loaded and checked against this module's structs."""
    lib = ctypes.CDLL(str(path))
    P, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    sigs = {"ecs_error": ([], ctypes.c_char_p), "ecs_model_layout": ([ctypes.POINTER(i64)], i64),
            "ecs_io_layout": ([], i64), "ecs_device": ([i32, ctypes.c_char_p, i32, P], i32),
            "ecs_malloc": ([i64], P), "ecs_host_alloc": ([i64], P), "ecs_free": ([P], i32),
            "ecs_host_free": ([P], i32), "ecs_copy": ([P, P, i64], i32), "ecs_memset": ([P, i64], i32),
            "ecs_stream_create": ([], P), "ecs_stream_destroy": ([P], i32), "ecs_stream_sync": ([P], i32),
            "ecs_event_create": ([], P), "ecs_event_destroy": ([P], i32),
            "ecs_kernel_ms": ([ctypes.POINTER(_Io)], ctypes.c_float),
            "ecs_enqueue": ([ctypes.POINTER(_Model), ctypes.POINTER(_Io), i64], i32),
            "ecs_capture": ([ctypes.POINTER(_Model), ctypes.POINTER(_Io), i64], P),
            "ecs_launch": ([P, P], i32), "ecs_graph_destroy": ([P], i32),
            "ecs_matmul": ([i32, P, i64, P, i64, i64, P, i32, i32, P, ctypes.c_float], i32),
            "ecs_profile_kinds": ([], ctypes.c_char_p),
            "ecs_profile": ([ctypes.POINTER(_Model), ctypes.POINTER(_Io), i64, P, P], i32)}
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    off = i64()
    size = lib.ecs_model_layout(ctypes.byref(off))
    if size != ctypes.sizeof(_Model) or off.value != _Model.inv_freq.offset:
        raise EngineError(f"{path}: es_model is {size} bytes (pointers from {off.value}) in CUDA, "
                          f"{ctypes.sizeof(_Model)} ({_Model.inv_freq.offset}) in native_lib.py: they must agree")
    if lib.ecs_io_layout() != ctypes.sizeof(_Io):
        raise EngineError(f"{path}: ecs_io is {lib.ecs_io_layout()} bytes in CUDA, {ctypes.sizeof(_Io)} in "
                          f"cuda_lib.py: they must agree")
    return lib


_LIBS: dict[Path, ctypes.CDLL] = {}


def library(arch: str | None = None):
    """The compiled step for this GPU, loaded once per process."""
    path = build_library(arch)
    if path not in _LIBS:
        _LIBS[path] = load(path)
    return _LIBS[path]


class _DeviceAlloc:
    """Owns one allocation of the library (device, or pinned host); freed on garbage collection."""

    def __init__(self, lib, nbytes: int, pinned: bool = False):
        self._free = lib.ecs_host_free if pinned else lib.ecs_free
        self.ptr = (lib.ecs_host_alloc if pinned else lib.ecs_malloc)(max(int(nbytes), 1))
        if not self.ptr:
            raise MemoryError(f"cuda-native: could not allocate {nbytes} bytes of {'pinned host' if pinned else 'device'} "
                              f"memory: {lib.ecs_error().decode()}")
        self.nbytes = int(nbytes)

    def __del__(self):
        try:
            self._free(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class StepMemory(HostMemory):
    """memory.HostMemory's interface over the library's device memory: the KV cache's buffers and the step's
    scratch (zero-initialised; to_host and write are synchronous copies)."""
    device = "cuda"

    def __init__(self, lib, device_id: int = 0):
        self.lib, self.device_id = lib, device_id

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise EngineError(f"cuda-native: {what} failed: {self.lib.ecs_error().decode()}")

    def zeros(self, shape, dtype) -> Buffer:
        dtype, shape = np.dtype(dtype), tuple(int(x) for x in shape)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        alloc = _DeviceAlloc(self.lib, nbytes)
        self._check(self.lib.ecs_memset(alloc.ptr, max(nbytes, 1)), "cudaMemset")
        return Buffer(shape, dtype, alloc.ptr, alloc)

    def to_host(self, buf: Buffer) -> np.ndarray:
        host = np.empty(buf.shape, buf.dtype)
        if host.nbytes:
            self._check(self.lib.ecs_copy(host.ctypes.data, buf.ptr, host.nbytes), "copy to the host")
        return host

    def write(self, buf: Buffer, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host, dtype=buf.dtype)
        if host.shape != tuple(buf.shape):
            raise ValueError(f"host array {host.shape} does not match the device buffer {tuple(buf.shape)}")
        if host.nbytes:
            self._check(self.lib.ecs_copy(buf.ptr, host.ctypes.data, host.nbytes), "copy to the device")

    def sub(self, buf: Buffer, offset: int, shape, dtype) -> Buffer:
        dtype, shape = np.dtype(dtype), tuple(int(x) for x in shape)
        if offset < 0 or offset + int(np.prod(shape)) * dtype.itemsize > buf.nbytes:
            raise ValueError(f"{shape} {dtype} at byte {offset} does not fit in a buffer of {buf.nbytes} bytes")
        return Buffer(shape, dtype, buf.ptr + offset, buf.handle)

    def grow(self, old: Buffer, rows: int, axis: int = 2) -> Buffer:
        raise EngineError("cuda-native allocates its KV cache at its full capacity (CUDA graphs keep its addresses)")


class CudaRuntime:
    """What cuda_native.py asks of the device, over the compiled library. The stand-in runtime of the tests
    (tests/cuda_standin.py) answers the same calls on the CPU."""

    def __init__(self, device_id: int = 0, arch: str | None = None, lib=None):
        self.lib = lib if lib is not None else library(arch)  # lib: a loaded build (the tests' emulated one)
        name, info = ctypes.create_string_buffer(256), np.zeros(6, np.int64)
        if self.lib.ecs_device(device_id, name, 256, info.ctypes.data) != 0:
            raise EngineError(f"provider 'cuda-native' needs an NVIDIA GPU and its driver: "
                              f"{self.lib.ecs_error().decode()}")
        self.device = {"name": name.value.decode(errors="replace"), "compute": f"{info[0]}.{info[1]}",
                       "total_mem": int(info[2]), "multiprocessors": int(info[3]), "integrated": bool(info[4]),
                       "l2_bytes": int(info[5])}
        self.memory = StepMemory(self.lib, device_id)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise EngineError(f"cuda-native: {what} failed: {self.lib.ecs_error().decode()}")

    def pinned(self, n: int, dtype) -> tuple[np.ndarray, object]:
        """(a host array of n elements in pinned memory, its owner)."""
        dtype = np.dtype(dtype)
        alloc = _DeviceAlloc(self.lib, n * dtype.itemsize, pinned=True)
        arr = np.ctypeslib.as_array((ctypes.c_byte * (n * dtype.itemsize)).from_address(alloc.ptr)).view(dtype)
        return arr, alloc

    def stream(self) -> int:
        s = self.lib.ecs_stream_create()
        if not s:
            raise EngineError(f"cuda-native: {self.lib.ecs_error().decode()}")
        return s

    def event(self) -> int:
        e = self.lib.ecs_event_create()
        if not e:
            raise EngineError(f"cuda-native: {self.lib.ecs_error().decode()}")
        return e

    def release(self, stream: int, events: tuple, graphs: list) -> None:
        for g in graphs:
            self.lib.ecs_graph_destroy(g)
        for e in events:
            self.lib.ecs_event_destroy(e)
        self.lib.ecs_stream_destroy(stream)

    def enqueue(self, model: _Model, io: _Io, s: int) -> None:
        self._check(self.lib.ecs_enqueue(ctypes.byref(model), ctypes.byref(io), s), f"a call of S = {s}")

    def capture(self, model: _Model, io: _Io, s: int) -> int:
        g = self.lib.ecs_capture(ctypes.byref(model), ctypes.byref(io), s)
        if not g:
            raise EngineError(f"cuda-native: capturing the graph of S = {s} failed: {self.lib.ecs_error().decode()}")
        return g

    def launch(self, graph: int, io: _Io) -> None:
        self._check(self.lib.ecs_launch(graph, io.stream), "a graph launch")

    def drop(self, graph: int) -> None:
        self.lib.ecs_graph_destroy(graph)

    def sync(self, io: _Io) -> None:
        self._check(self.lib.ecs_stream_sync(io.stream), "the call")

    def kernel_ms(self, io: _Io) -> float:
        return float(self.lib.ecs_kernel_ms(ctypes.byref(io)))

    def profile(self, model: _Model, io: _Io, s: int) -> dict:
        """One call of S tokens enqueued without a graph, an event after every kernel: {kind: {"ms", "kernels"}}
        (cuda_step.cu's kinds), the GPU time of each kind's kernels."""
        kinds = self.lib.ecs_profile_kinds().decode().split(",")
        ms, n = np.zeros(len(kinds), np.float32), np.zeros(len(kinds), np.int64)
        self._check(self.lib.ecs_profile(ctypes.byref(model), ctypes.byref(io), s, ms.ctypes.data, n.ctypes.data),
                    f"a profiled call of S = {s}")
        return {k: {"ms": float(ms[i]), "kernels": int(n[i])} for i, k in enumerate(kinds) if n[i]}

    def matmul(self, kind: int, x: np.ndarray, packed: np.ndarray, glu: bool = False, act: int = 0,
               norm: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
        """The matrix kernels alone (for the tests): x (T, K) float32 @ a packed matrix of `kind`
        (native_format.WEIGHT_KINDS' value) -> (T, N) float32, or (T, N / 2) act(gate) * up with glu; norm (K):
        the rows RMS-normed with these weights first."""
        from .native_format import PANEL, QB
        x = np.ascontiguousarray(x, np.float32)
        t, k = x.shape
        n = packed.shape[0] * PANEL
        if (packed.shape[1] if kind == 0 else packed.shape[1] * QB) != k:
            raise ValueError(f"x has {k} inputs, the matrix {packed.shape}")
        mem = self.memory
        bx, bw = mem.zeros(x.shape, np.float32), mem.zeros(packed.shape, packed.dtype)
        by = mem.zeros((t, n // 2 if glu else n), np.float32)
        mem.write(bx, x)
        mem.write(bw, packed)
        bn = None
        if norm is not None:
            bn = mem.zeros((k,), np.float32)
            mem.write(bn, np.asarray(norm, np.float32))
        self._check(self.lib.ecs_matmul(kind, bx.ptr, t, bw.ptr, k, n, by.ptr, int(glu), act,
                                        bn.ptr if bn is not None else None, eps), "ecs_matmul")
        return mem.to_host(by)

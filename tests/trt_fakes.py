"""CPU stand-ins for cuda-python's runtime and TensorRT, just enough to drive edgespec.cuda / edgespec.backends.trt.

FakeCudart: "device" memory is host memory (numpy arrays by address); copies are memmoves; a stream
capture records the enqueued work and a graph launch replays it. FakeTensorRT: a "plan" is a JSON file
naming an ONNX model and its profiles; an execution context reads its inputs from the bound addresses,
runs the model with ONNX Runtime on the CPU, writes the outputs to the bound addresses, and refuses
aliased input/output memory like TensorRT's contract demands. A captured execute replays the shapes
and addresses bound at capture time (as a CUDA graph does), not the ones bound later.
"""
from __future__ import annotations

import ctypes
import enum
import json
import types

import numpy as np


class _Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInsufficientDriver = 35
    cudaErrorStreamCaptureInvalidated = 901


class FakeCudart:
    cudaError_t = _Err
    cudaStreamNonBlocking = 1
    cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2,
                                           cudaMemcpyDeviceToDevice=3)
    cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1, cudaStreamCaptureModeGlobal=0)

    def __init__(self, devices: int = 1, no_driver: bool = False):
        self.devices, self.no_driver = devices, no_driver
        self.allocs: dict[int, np.ndarray] = {}
        self.capturing: list | None = None  # work recorded while a stream capture is open
        self.launches = 0
        self.copies_2d: list = []

    def _ok(self, *v):
        return (_Err.cudaSuccess, *v)

    def cudaGetErrorString(self, err):
        return self._ok({_Err.cudaErrorInsufficientDriver: b"CUDA driver version is insufficient for CUDA "
                                                            b"runtime version"}.get(err, b"invalid argument"))

    def cudaGetDeviceCount(self):
        return (_Err.cudaErrorInsufficientDriver, None) if self.no_driver else self._ok(self.devices)

    def cudaGetDeviceProperties(self, i):
        return self._ok(types.SimpleNamespace(name=b"Fake GPU", major=8, minor=7, totalGlobalMem=1 << 30,
                                              integrated=False))

    def cudaSetDevice(self, i):
        return self._ok()

    def cudaStreamCreateWithFlags(self, flags):
        return self._ok(7)

    def cudaStreamSynchronize(self, s):
        return self._ok()

    def cudaStreamDestroy(self, s):
        return self._ok()

    def cudaMalloc(self, n):
        a = np.zeros(n + 256, np.uint8)
        ptr = (a.ctypes.data + 255) // 256 * 256  # cudaMalloc pointers are 256-byte aligned
        self.allocs[ptr] = a
        return self._ok(ptr)

    def cudaFree(self, ptr):
        self.allocs.pop(ptr, None)
        return self._ok()

    def cudaMemsetAsync(self, ptr, value, n, stream):
        ctypes.memset(ptr, value, n)
        return self._ok()

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        return self._ok()

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        if width > min(dpitch, spitch):
            return (_Err.cudaErrorInvalidValue,)
        self.copies_2d.append((dpitch, spitch, width, height))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return self._ok()

    def cudaStreamBeginCapture(self, stream, mode):
        self.capturing = []
        return self._ok()

    def cudaStreamEndCapture(self, stream):
        work, self.capturing = self.capturing, None
        if work is None or any(w is None for w in work):
            return (_Err.cudaErrorStreamCaptureInvalidated, None)
        return self._ok(list(work))

    def cudaGraphInstantiate(self, graph, flags):
        return self._ok(list(graph))

    def cudaGraphLaunch(self, exec_, stream):
        self.launches += 1
        for fn in exec_:
            fn()
        return self._ok()

    def cudaGraphDestroy(self, g):
        return self._ok()

    def cudaGraphExecDestroy(self, g):
        return self._ok()

    def cudaGetLastError(self):
        return self._ok()


def _array(ptr: int, shape, dtype) -> np.ndarray:
    """A numpy view of `shape` / `dtype` at a fake device address."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = (ctypes.c_byte * (n * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=n).reshape(shape)


class _DT:
    def __init__(self, name):
        self.name = name


_NP_TO_TRT = {"float32": "FLOAT", "float16": "HALF", "int64": "INT64", "int32": "INT32"}


def make_fake_tensorrt(cudart: FakeCudart, fail_capture: bool = False, version: str = "10.3.0",
                       refuse_profile: bool = False):
    """A module-like object with the TensorRT API edgespec.backends.trt uses. refuse_profile: a context's
    set_optimization_profile_async returns False (TensorRT's way of saying it did not switch)."""
    import onnxruntime as ort

    trt = types.SimpleNamespace(__version__=version)

    class Severity(enum.Enum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    class ILogger:
        Severity = None  # set below

        def __init__(self):
            pass

    ILogger.Severity = Severity
    trt.ILogger = ILogger
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(STATIC=0, USER_MANAGED=2)
    stats = trt.stats = {"contexts": 0, "executes": 0}

    class Engine:
        def __init__(self, spec):
            self.model = spec["model"]
            self.sess = ort.InferenceSession(spec["model"], providers=["CPUExecutionProvider"])
            self.inputs = [(i.name, i.type) for i in self.sess.get_inputs()]
            self.outputs = [(o.name, o.type) for o in self.sess.get_outputs()]
            self.dtypes = {i.name: _ORT[i.type] for i in list(self.sess.get_inputs()) + list(self.sess.get_outputs())}
            self.shapes = {i.name: [d if isinstance(d, int) else -1 for d in i.shape]
                           for i in list(self.sess.get_inputs()) + list(self.sess.get_outputs())}
            self.profiles = spec["profiles"]  # [{input: [min, opt, max]}]
            self.rename = spec.get("rename", {})  # plan name -> reported name (mismatch tests)
            self.device_memory_size_v2 = 4096

        names = property(lambda self: [n for n, _ in self.inputs] + [n for n, _ in self.outputs])
        num_io_tensors = property(lambda self: len(self.names))
        num_optimization_profiles = property(lambda self: len(self.profiles))

        def get_tensor_name(self, i):
            # outputs first: TensorRT's order need not be the ONNX graph's
            n = ([n for n, _ in self.outputs] + [n for n, _ in self.inputs])[i]
            return self.rename.get(n, n)

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name in dict(self.inputs) else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return _DT(_NP_TO_TRT[self.dtypes.get(name, "float32")])

        def get_tensor_shape(self, name):
            return tuple(self.shapes.get(name, [-1]))

        def get_tensor_profile_shape(self, name, k):
            return [tuple(x) for x in self.profiles[k][name]]

        def create_execution_context(self, strategy=0):
            stats["contexts"] += 1
            return Context(self, strategy)

    class Context:
        def __init__(self, engine, strategy):
            self.e, self.strategy = engine, strategy
            self.active_optimization_profile = 0
            self.in_shapes, self.addrs, self.memory = {}, {}, None

        def set_device_memory(self, ptr, size):
            self.memory = (ptr, size)

        def set_optimization_profile_async(self, k, stream):
            if not 0 <= k < len(self.e.profiles):
                raise RuntimeError("Error in set optimization profile async.")
            if refuse_profile:
                return False
            self.active_optimization_profile = k
            return True

        def set_input_shape(self, name, shape):
            lo, _, hi = self.e.profiles[self.active_optimization_profile][name]
            if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)) or len(shape) != len(lo):
                return False
            self.in_shapes[name] = tuple(shape)
            return True

        def infer_shapes(self):
            return [n for n, _ in self.e.inputs if n not in self.in_shapes]

        def set_tensor_address(self, name, ptr):
            if name not in self.e.names:
                return False
            self.addrs[name] = ptr
            return True

        def execute_async_v3(self, stream):
            if self.strategy == 2 and self.memory is None:
                return False  # USER_MANAGED without device memory
            shapes, addrs = dict(self.in_shapes), dict(self.addrs)
            if cudart.capturing is not None:
                cudart.capturing.append(None if fail_capture else (lambda: self._run(shapes, addrs)))
                return not fail_capture
            self._run(shapes, addrs)
            return True

        def _run(self, shapes, addrs):
            stats["executes"] += 1
            e = self.e
            ins = {n for n, _ in e.inputs}
            outs = [n for n, _ in e.outputs]
            aliased = {addrs[o] for o in outs} & {addrs[i] for i in ins}
            assert not aliased, "TensorRT I/O tensors must not alias"
            feeds = {n: _array(addrs[n], shapes[n], e.dtypes[n]).copy() for n in ins}
            res = e.sess.run(outs, feeds)
            for n, v in zip(outs, res):
                dst = _array(addrs[n], v.shape, e.dtypes[n])
                dst[...] = v

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            try:
                spec = json.loads(bytes(data))
            except ValueError:
                self.logger.log(Severity.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                                "(Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed."
                                "Version tag does not match.)")
                return None
            return Engine(spec)

    trt.Runtime = Runtime
    return trt


_ORT = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int32)": "int32"}


def write_fake_plan(engine_dir, profiles: list, rename: dict | None = None) -> None:
    """model.plan for the fake TensorRT: the ONNX path and each profile's {input: [min, opt, max]}; recorded
    in engine.json (extra.tensorrt) like build_engine does. profiles: export.tensorrt ProfileSpec list."""
    from edgespec import contract as C
    from edgespec.export.tensorrt import profile_shapes
    m = C.Manifest.read(engine_dir)
    spec = {"model": str(engine_dir / m.model_file), "rename": rename or {},
            "profiles": [{k: [list(x) for x in v] for k, v in profile_shapes(m, p).items()} for p in profiles]}
    (engine_dir / "model.plan").write_text(json.dumps(spec))
    m.extra["tensorrt"] = {"plan": "model.plan", "tensorrt_version": "10.3.0",
                           "profiles": [p.__dict__ for p in profiles]}
    m.write(engine_dir)

"""A stand-in for cuda_lib.CudaRuntime that answers on the CPU, so the cuda-native decoder's host side runs and is
checked where there is no GPU.

"Device" memory is host memory (every allocation recorded); a call does what cuda_step.cu's ecs_enqueue does, in
the same three steps and from the same addresses: the parameter block copied from the pinned one, then
native_step.c's es_forward over the model struct and the buffers the decoder laid out (the keys and values of
sequence b, layer l at kc[l] + b Hkv cap D floats, the ids after the B starts, the logits, the final hidden state in
h, the ids into `next`), then `next` copied to the pinned ids. A captured graph is that call with the io block
as it was at capture (the addresses of then), replayed later as a real graph is: so a decoder that
forgets to recapture after moving a buffer replays stale addresses, and the stand-in refuses any address that is
no longer a live allocation.
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from edgespec.backends.cuda_lib import _Io
from edgespec.backends.native_lib import library
from edgespec.memory import Buffer, HostMemory


class TrackedMemory(HostMemory):
    """HostMemory that remembers its live allocations (address ranges)."""

    def __init__(self):
        self.live: dict[int, tuple[int, weakref.ref]] = {}

    def zeros(self, shape, dtype) -> Buffer:
        buf = super().zeros(shape, dtype)
        a = buf.handle
        self.live[a.ctypes.data] = (max(a.nbytes, 1), weakref.ref(a))
        return buf

    def grow(self, old, rows, axis=2):
        raise AssertionError("the cuda-native cache must never grow")

    def owns(self, ptr: int, nbytes: int = 1) -> bool:
        for base, (n, ref) in list(self.live.items()):
            if ref() is None:
                del self.live[base]
            elif base <= ptr and ptr + nbytes <= base + n:
                return True
        return False


class StandIn:
    """CudaRuntime's calls on the CPU (see the module docstring); `log` records ("capture" | "launch" | "enqueue", S)."""

    def __init__(self):
        self.cpu = library()
        self.memory = TrackedMemory()
        self.device = {"name": "stand-in (CPU)", "compute": "0.0", "total_mem": 0, "multiprocessors": 0,
                       "integrated": False, "l2_bytes": 0}
        self.log: list[tuple[str, int]] = []
        self._graphs: dict[int, tuple] = {}
        self._pinned: dict[int, weakref.ref] = {}
        self._n = 0

    def pinned(self, n, dtype):
        a = np.zeros(n, dtype)
        self._pinned[a.ctypes.data] = weakref.ref(a)
        return a, a

    def stream(self):
        self._n += 1
        return self._n

    def event(self):
        self._n += 1
        return self._n

    def release(self, stream, events, graphs):
        for g in graphs:
            self._graphs.pop(g, None)

    def enqueue(self, model, io, s):
        self.log.append(("enqueue", s))
        self._forward(model, _Io.from_buffer_copy(io), self._tables(model, io), s)

    def capture(self, model, io, s):
        self.log.append(("capture", s))
        self._n += 1
        self._graphs[self._n] = (model, _Io.from_buffer_copy(io), self._tables(model, io), s)
        return self._n

    def launch(self, graph, io):
        model, snap, tables, s = self._graphs[graph]
        self.log.append(("launch", s))
        if snap.stream != io.stream:
            raise AssertionError("a graph launched on another decoder's stream")
        self._forward(model, snap, tables, s)

    def profile(self, model, io, s):
        """A call without a graph; the stand-in has no kernels to time."""
        self.enqueue(model, io, s)
        return {}

    def drop(self, graph):
        del self._graphs[graph]

    def sync(self, io):
        pass

    def kernel_ms(self, io):
        return 0.0

    @staticmethod
    def _tables(model, io):
        """The per-layer key / value addresses as they are now (a graph holds them from its capture)."""
        L = model.L
        return [io.kc[i] for i in range(L)], [io.vc[i] for i in range(L)]

    def _forward(self, model, io, tables, s):
        B, T, cap = io.B, io.B * s, io.cap
        E, Hkv, D, V = model.E, model.Hkv, model.D, model.V
        mem = self.memory
        need = {"params": (B + T) * 8, "next": T * 8, "logits": T * V * 4, "h": T * E * 4}
        for name, n in need.items():
            if not mem.owns(getattr(io, name), n):
                raise AssertionError(f"io.{name}: {n} bytes at a freed or foreign address (a stale graph?)")
        if T > io.rows:
            raise AssertionError(f"a call of {T} rows on a scratch of {io.rows}")
        kc, vc = tables
        per_seq = Hkv * cap * D * 4
        for ptr in kc + vc:
            if not mem.owns(ptr, B * per_seq):
                raise AssertionError("a cache buffer at a freed address (a stale graph?)")
        for host in (io.params_host, io.next_host):
            if host not in self._pinned or self._pinned[host]() is None:
                raise AssertionError("a pinned block that was freed (a stale graph?)")
        ctypes.memmove(io.params, io.params_host, (B + T) * 8)
        start = np.ctypeslib.as_array((ctypes.c_int64 * B).from_address(io.params))
        if (start < 0).any() or (start + s > cap).any():
            raise AssertionError(f"rows {start.tolist()} + {s} outside the cache's {cap}: the kernels would write "
                                 f"out of bounds")
        L = model.L
        kt = (ctypes.c_void_p * (B * L))(*[kc[j] + b * per_seq for b in range(B) for j in range(L)])
        vt = (ctypes.c_void_p * (B * L))(*[vc[j] + b * per_seq for b in range(B) for j in range(L)])
        scratch = np.zeros(self.cpu.es_scratch_floats(ctypes.byref(model), T), np.float32)
        x_in = None
        if io.embeds_host:  # an inputs_embeds engine: the rows copied to x by the call (ecs_enqueue)
            if not mem.owns(io.x, T * E * 4) or io.embeds_host not in self._pinned:
                raise AssertionError("io.x or io.embeds_host: freed or foreign memory (a stale graph?)")
            ctypes.memmove(io.x, io.embeds_host, T * E * 4)
            x_in = io.x
        rc = self.cpu.es_forward(ctypes.byref(model), B, s, io.params + B * 8, x_in, io.params, kt, vt, cap, io.logits,
                                 io.next, io.h, scratch.ctypes.data, 1)
        if rc != 0:
            raise AssertionError(f"es_forward returned {rc}")
        ctypes.memmove(io.next_host, io.next, T * 8)

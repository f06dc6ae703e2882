"""A policy in its own process, behind the same callable the control loop takes.

The loop's inference worker is a thread. When the policy runs in that thread, its Python code (picking
tokens, the draft, binding engine inputs) holds the GIL between engine calls, and the loop thread waits for
the GIL whenever it wakes during one of those stretches, and under CPU load a preempted worker can hold
the GIL while a real-time loop thread waits (priority inversion). In a child process the policy has its own interpreter:
the worker thread only blocks on a pipe, which releases the GIL.

    from functools import partial
    policy = InferenceProcess(partial(edgespec.load_policy, "engines/vla-reacher", draft="head"))
    chunk = policy(obs)        # (H, D); policy.last_info is the child's policy.last_info
    policy.close()             # or use it as a context manager

The child runs with single-threaded BLAS (`single_threaded_env`). `factory` must be picklable (a
module-level function or a functools.partial of one): the child builds the policy itself, since engine
sessions cannot cross processes. An exception in the policy comes back as a RuntimeError naming it; a child
that dies turns the next call into a RuntimeError; the loop records both as faults. Observations cross the
pipe pickled.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Callable

import numpy as np


SINGLE_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class single_threaded_env:
    """While active, child processes started with "spawn" get single-threaded BLAS / OpenMP (numpy reads
    these variables at import, which in a spawned child happens after this environment is copied). A
    numpy BLAS pool of one thread per core spins between calls and, on a loaded CPU, stalls on preempted
    peers. The drafts' own products no longer use it (edgespec.drafts.mv); other numpy code that runs in the
    policy's process still could."""

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in SINGLE_THREAD_ENV}
        os.environ.update({k: "1" for k in SINGLE_THREAD_ENV})
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _serve(factory: Callable, conn, nice: int | None, cpus) -> None:
    if nice:
        os.nice(nice)
    if cpus is not None:  # before the policy is built: engine threads inherit it
        os.sched_setaffinity(0, cpus)
    try:
        policy = factory()
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"building the policy failed: {type(e).__name__}: {e}", {}))
        return
    conn.send(("ready", None, {}))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "quit":
            return
        try:
            out = policy(msg[1])
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}", {"raised": type(e).__name__}))
        else:
            conn.send(("ok", np.asarray(out), dict(getattr(policy, "last_info", {}) or {})))


class PolicyProcessError(RuntimeError):
    """The policy raised in the child process; type_name is its exception's class name."""

    def __init__(self, message: str, type_name: str):
        super().__init__(message)
        self.type_name = type_name


class InferenceProcess:
    def __init__(self, factory: Callable, start_timeout_s: float = 120.0, nice: int | None = None,
                 cpus=None):
        """nice: the child's nice increment (negative raises its priority; needs CAP_SYS_NICE). cpus: the CPUs
        the child may run on (e.g. all but the control loop's; LoopConfig.cpus), None: any."""
        if cpus is not None:
            cpus = frozenset(int(c) for c in cpus)
            have = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
            if not cpus or not cpus <= have:
                raise ValueError(f"cpus must be a non-empty subset of this process's CPUs {sorted(have)}, "
                                 f"got {sorted(cpus)}")
        self.cpus = cpus
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(factory, child, nice, cpus), daemon=True,
                                 name="edgespec-policy")
        with single_threaded_env():
            self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self.last_info: dict = {}
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"the policy process did not start within {start_timeout_s} s")
        kind, payload, _ = self._recv()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the policy process failed to start: {payload}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _recv(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the policy process died (exit code {self._proc.exitcode})") from e

    def __call__(self, obs: dict) -> np.ndarray:
        with self._lock:  # one call at a time: the pipe carries one request and its answer
            if not self._proc.is_alive():
                raise RuntimeError(f"the policy process is not running (exit code {self._proc.exitcode})")
            try:
                self._conn.send(("act", obs))
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(f"the policy process died (exit code {self._proc.exitcode})") from e
            kind, payload, info = self._recv()
        if kind == "error":
            self.last_info = {}  # nothing of an earlier call's numbers stays behind
            raise PolicyProcessError(f"policy process: {payload}", info.get("raised", "Exception"))
        self.last_info = info
        return payload

    def close(self, timeout_s: float = 2.0) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout_s)
        # hung in a call, it cannot answer "quit": SIGKILL cannot be refused, but a loaded machine may take a moment
        # to reap the child (and a join can return before is_alive() turns false): kill and wait until it is gone,
        # rather than return with it alive
        deadline = time.monotonic() + max(timeout_s, 10.0)
        while self._proc.is_alive() and time.monotonic() < deadline:
            self._proc.kill()
            self._proc.join(0.1)
        self._conn.close()

    def __enter__(self) -> "InferenceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

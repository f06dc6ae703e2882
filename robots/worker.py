"""The inference worker the control loop and the DDS node share: a thread that runs the policy off the
caller's clock, so a tick never waits for the model.

    worker = InferenceWorker(policy, on_done, check=partial(check_chunk, dims=2))
    worker.start()
    worker.submit(job, obs)         # per tick, when worker.busy_since is None; never blocks
    ...                             # on_done(Inference) runs in the worker thread as each call ends
    if worker.overdue(now, 2.0):    # the watchdog: a call running longer than 2 s is a hung policy
        worker.abandon()            # optional: its result, if it ever comes, is "late" and not used
    in_flight = worker.stop()       # (job, start) of a call still running, or None
    worker.join(2.0)

One call at a time: submit() hands over a job only while the worker is idle (busy_since is None), and the
worker stays busy from submit() until that call's result is handed to on_done() (or it is abandoned).
Each call's chunk goes through `check` (chunks.check_chunk by default): a policy that raises or returns a
bad chunk is an Inference with an error, never an exception in the caller.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .checks import check_chunk

Policy = Callable[[dict], Any]  # observation -> (H, D) chunk


@dataclass
class Inference:
    """One policy call. Times are the worker's clock."""
    job: Any  # what the caller handed over with the observation
    start: float  # the call started
    end: float  # it returned and its chunk was checked
    chunk: np.ndarray | None = None  # (H, D) float64, checked; None when the call failed
    error: str = ""  # why it failed ("policy raised ...", "policy returned a bad chunk: ...")
    outcome: str = "ok"  # "ok" | "raised" | "bad chunk" | "late" (abandoned before it returned)
    raised: str = ""  # the class name of what the policy raised (in a policy process too), else ""
    info: dict = field(default_factory=dict)  # the numbers in policy.last_info after the call


class InferenceWorker:
    """A daemon thread running `policy` on the job handed to it, one call at a time. Single use: start()
    once, stop() once. `lock` guards the hand-off; a caller that passes its own lock (an RLock) can call
    submit / abandon / busy_since while holding it, and on_done runs while the worker holds it."""

    def __init__(self, policy: Policy, on_done: Callable[[Inference], None],
                 check: Callable[[Any], np.ndarray] = check_chunk, clock: Callable[[], float] = time.perf_counter,
                 lock=None, thread_setup: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 name: str = "inference-worker"):
        """thread_setup: entered in the worker thread before its first call (e.g. realtime.sched_fifo)."""
        self.policy, self.on_done, self.check, self.clock = policy, on_done, check, clock
        self._cv = threading.Condition(lock if lock is not None else threading.RLock())
        self._handed: tuple | None = None  # (job, obs) not yet picked up
        self._current: tuple | None = None  # the submitted (job, obs) whose result has not landed
        self._running: tuple[Any, float] | None = None  # (job, start) of the call in flight
        self._stopped = False
        self.busy_since: float | None = None  # when the current job was submitted; None: idle
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(thread_setup,), name=name, daemon=True)

    def start(self) -> None:
        """Start the thread; returns once thread_setup has run in it."""
        self._thread.start()
        self._ready.wait()

    def submit(self, job, obs: dict, now: float | None = None) -> bool:
        """Hand over the observation (and the caller's `job` to come back with it); False when busy."""
        with self._cv:
            if self.busy_since is not None or self._stopped:
                return False
            self._handed = self._current = (job, obs)
            self.busy_since = self.clock() if now is None else now
            self._cv.notify()
        return True

    def overdue(self, now: float, limit_s: float) -> float | None:
        """How long the current job has been out, when that is more than `limit_s`; else None."""
        with self._cv:
            since = self.busy_since
        return None if since is None or now - since <= limit_s else now - since

    def abandon(self) -> None:
        """Give up on the current job: the worker is idle again (a new job waits until the abandoned call
        returns), and that call's result comes to on_done as "late"."""
        with self._cv:
            self._handed = self._current = self.busy_since = None

    def stop(self) -> tuple[Any, float] | None:
        """End the thread: nothing reaches on_done after this. Returns (job, start) of a call still in
        flight (the thread is left to finish it and then exits), else None."""
        with self._cv:
            self._stopped = True
            running, self._running = self._running, None
            self._handed = self._current = self.busy_since = None
            self._cv.notify_all()
        return running

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` s for the thread to exit after stop() (do not hold the lock meanwhile)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _serve(self, thread_setup) -> None:
        with contextlib.ExitStack() as setup:
            try:
                setup.enter_context(thread_setup())
            finally:
                self._ready.set()
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._handed is not None or self._stopped)
                    if self._stopped:
                        return
                    item, self._handed = self._handed, None
                    start = self.clock()
                    self._running = (item[0], start)
                done = self._call(*item, start=start)
                with self._cv:
                    if self._stopped:  # stop() took the call as in flight
                        return
                    self._running = None
                    if self._current is item:
                        self._current = self.busy_since = None
                    else:
                        done.outcome = "late"
                    self.on_done(done)

    def _call(self, job, obs: dict, start: float) -> Inference:
        try:
            out = self.policy(obs)
        except Exception as e:  # noqa: BLE001  (any policy failure is a fault the caller must survive)
            return Inference(job, start, self.clock(), error=f"policy raised {type(e).__name__}: {e}",
                             outcome="raised", raised=getattr(e, "type_name", type(e).__name__), info=self._info())
        try:
            chunk = self.check(out)
        except Exception as e:  # noqa: BLE001
            return Inference(job, start, self.clock(), error=f"policy returned a bad chunk: {e}",
                             outcome="bad chunk", info=self._info())
        return Inference(job, start, self.clock(), chunk=chunk, info=self._info())

    def _info(self) -> dict:
        info = getattr(self.policy, "last_info", None)
        return {k: v for k, v in info.items() if isinstance(v, (int, float, np.number))} \
            if isinstance(info, dict) else {}

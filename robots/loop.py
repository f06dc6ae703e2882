"""A fixed-rate control loop that never blocks on the model.

Each tick runs four named, timed sections: observe, infer (hand the latest observation to the inference
worker when the queue runs low; never waits for it), act (send the action due now, or hold / safe-stop),
wait (sleep to the next period). Faults (a policy that raises, a hung engine past the watchdog, NaN in
actions, a malformed observation) are recorded and end in hold-then-stop; the loop keeps its period.

    loop = ControlLoop(robot, policy, LoopConfig(hz=20))
    report = loop.run(seconds=10)
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .chunks import Chunk, ChunkQueue, HoldThenStop
from .robot import Robot

Policy = Callable[[dict], np.ndarray]  # observation -> (H, D) chunk of position targets


@dataclass
class LoopConfig:
    hz: float = 20.0
    hold_s: float = 0.5  # how long to hold the last position target on a dry queue
    request_threshold: int = 4  # ask for the next chunk when fewer actions than this are queued
    merge: str = "latest"
    watchdog_s: float = 2.0  # an inference running longer than this is a hung engine

    def __post_init__(self):
        if not 1 <= self.hz <= 1000:
            raise ValueError(f"hz must be in [1, 1000], got {self.hz}")
        if self.watchdog_s <= 0 or self.request_threshold < 0:
            raise ValueError(f"watchdog_s must be > 0 and request_threshold >= 0, "
                             f"got {self.watchdog_s} and {self.request_threshold}")

    @property
    def dt(self) -> float:
        return 1.0 / self.hz


@dataclass
class LoopReport:
    ticks: int = 0
    sent: int = 0
    held: int = 0
    stopped_ticks: int = 0
    starved: int = 0  # ticks with no fresh action (held or stopped)
    deadline_misses: int = 0
    faults: list = field(default_factory=list)
    sections_ms: dict = field(default_factory=lambda: {"observe": [], "infer": [], "act": [], "wait": []})
    tick_start_s: list = field(default_factory=list)
    inference_ms: list = field(default_factory=list)
    safe_stop_reason: str = ""
    queue_dropped_stale: int = 0  # chunk actions whose time had passed when they landed or came due


def summarize(rep: "LoopReport", dt: float) -> dict:
    """p50/p95/p99 per section, tick-period jitter against dt, deadline misses, starved ticks, inference."""
    from edgespec.profiling import percentiles
    periods = np.diff(rep.tick_start_s) if len(rep.tick_start_s) > 1 else np.array([])
    return {"ticks": rep.ticks, "hz": 1 / dt, "deadline_misses": rep.deadline_misses, "starved_ticks": rep.starved,
            "held_ticks": rep.held, "stopped_ticks": rep.stopped_ticks, "faults": list(rep.faults),
            "sections_ms": {k: percentiles(v) for k, v in rep.sections_ms.items()},
            "jitter_ms": percentiles(np.abs(periods - dt) * 1e3), "inference_ms": percentiles(rep.inference_ms),
            "safe_stop_reason": rep.safe_stop_reason}


class ControlLoop:
    def __init__(self, robot: Robot, policy: Policy, cfg: LoopConfig | None = None):
        self.robot, self.policy, self.cfg = robot, policy, cfg or LoopConfig()
        self.queue = ChunkQueue(self.cfg.dt, self.cfg.merge)
        self.safety = HoldThenStop(self.cfg.hold_s)
        self._lock = threading.Lock()
        self._job: tuple[float, dict] | None = None
        self._busy_since: float | None = None
        self._wake = threading.Event()
        self._quit = False
        self.report = LoopReport()

    # -- inference worker --------------------------------------------------------------------------
    def _worker(self, t_origin: float) -> None:
        while not self._quit:
            if not self._wake.wait(0.05):
                continue
            self._wake.clear()
            with self._lock:
                job = self._job
            if job is None:
                continue
            t0, obs = job
            try:
                chunk = Chunk(t0, self.policy(obs))  # refuses NaN/inf
                now = time.perf_counter() - t_origin
                with self._lock:
                    if self._job is job:  # not abandoned by the watchdog
                        self.queue.push(chunk, now)
                        self.report.inference_ms.append((now - t0) * 1e3)
            except Exception as e:  # noqa: BLE001  (any policy failure is a fault the loop must survive)
                with self._lock:
                    self.report.faults.append(f"policy raised {type(e).__name__}: {e}")
                    self.safety.latch(f"policy raised {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    if self._job is job:
                        self._job, self._busy_since = None, None

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, seconds: float) -> LoopReport:
        cfg, rep = self.cfg, self.report
        t_origin = time.perf_counter()
        first = self._observe(0.0)
        if first is not None:  # until the first chunk lands, hold where the robot stands
            self.safety.last_target = np.asarray(first["state"], dtype=np.float64).copy()
        worker = threading.Thread(target=self._worker, args=(t_origin,), daemon=True)
        worker.start()
        next_tick = 0.0
        try:
            while next_tick < seconds:
                t_tick = time.perf_counter() - t_origin
                rep.tick_start_s.append(t_tick)
                rep.ticks += 1
                s0 = time.perf_counter()
                obs = self._observe(t_tick)
                s1 = time.perf_counter()
                self._request(obs, t_tick)
                s2 = time.perf_counter()
                self._act(t_tick)
                s3 = time.perf_counter()
                next_tick += cfg.dt
                delay = next_tick - (time.perf_counter() - t_origin)
                if delay < 0:
                    rep.deadline_misses += 1
                    next_tick = time.perf_counter() - t_origin  # re-anchor rather than burst
                else:
                    time.sleep(delay)
                s4 = time.perf_counter()
                for name, a, b in (("observe", s0, s1), ("infer", s1, s2), ("act", s2, s3), ("wait", s3, s4)):
                    rep.sections_ms[name].append((b - a) * 1e3)
        finally:
            self._quit = True
            self._wake.set()
            worker.join(timeout=1.0)
        rep.safe_stop_reason = self.safety.reason
        rep.queue_dropped_stale = self.queue.dropped_stale
        return rep

    def _observe(self, now: float) -> dict | None:
        try:
            obs = self.robot.get_observation()
            state = np.asarray(obs.get("state"), dtype=np.float64)
            if state.ndim != 1 or not np.isfinite(state).all():
                raise ValueError(f"malformed state {obs.get('state')!r}")
            return obs
        except Exception as e:  # noqa: BLE001
            self.report.faults.append(f"t={now:.3f}s bad observation: {e}")
            return None

    def _request(self, obs: dict | None, now: float) -> None:
        with self._lock:
            if self._busy_since is not None and now - self._busy_since > self.cfg.watchdog_s:
                self.report.faults.append(f"t={now:.3f}s engine hung for more than {self.cfg.watchdog_s} s")
                self.safety.latch(f"engine hung for more than {self.cfg.watchdog_s} s")
                self._job, self._busy_since = None, None  # abandon it; a late result is dropped
            if obs is None or self.safety.stopped or self._busy_since is not None:
                return
            if self.queue.needs_more(self.cfg.request_threshold):
                self._job, self._busy_since = (now, obs), now
                self._wake.set()

    def _act(self, now: float) -> None:
        rep = self.report
        with self._lock:
            action = self.queue.pop(now)
        if action is not None and self.safety.on_action(action) is not None:
            self.robot.send_action(action)
            rep.sent += 1
            return
        rep.starved += 1
        mode, target = self.safety.on_empty(now)
        if mode == "hold":
            self.robot.send_action(target)  # a position target: holding it is safe to repeat
            rep.held += 1
        else:
            self.robot.safe_stop()
            rep.stopped_ticks += 1

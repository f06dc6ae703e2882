"""A fixed-rate control loop that never blocks on the model.

Each tick runs four named, timed sections: observe, infer (hand the latest observation to the inference
worker when the queue runs low; never waits for it), act (send the action due now, or hold / safe-stop),
wait (sleep to the next period).

Faults: a malformed observation (missing key, wrong shape, a state not finite as the engine's float32 sees
it: NaN, inf, or 1e39, finite in float64 but inf in float32), a stale one (its "timestamp"
has not advanced for `stale_obs_s`), a policy that raises or returns a bad chunk (NaN/inf, wrong shape),
and a hung engine (an inference past `watchdog_s`). Each is recorded with its loop time. While a fault is
active the loop sends no fresh action: it holds the last position target and, if the fault (or a dry
queue) lasts past `hold_s`, latches a safe stop that only `reset()` clears. Observation faults clear when a
good observation comes back; policy and engine faults stay until `reset()`. The loop keeps its period
throughout. A robot.safe_stop() that raises is recorded as a fault too; the loop keeps ticking, stopped.

`stop()` (from a signal handler or another thread) ends run() at the next tick: the loop latches its safe
stop, calls robot.safe_stop() once and returns the report (`stop_requested` says why). An exception escaping
run() also safe-stops the robot on the way out. `edgespec.robots.profile` turns the report into percentiles,
a Chrome trace and a timeline PNG.

    loop = ControlLoop(robot, policy, LoopConfig(hz=20))
    report = loop.run(seconds=10)
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .chunks import Chunk, ChunkQueue, HoldThenStop
from .robot import Robot

Policy = Callable[[dict], np.ndarray]  # observation -> (H, D) chunk of position targets
SECTIONS = ("observe", "infer", "act", "wait")


@dataclass
class LoopConfig:
    hz: float = 20.0
    hold_s: float = 0.5  # how long to hold the last position target on a dry queue or an active fault
    request_threshold: int = 4  # ask for the next chunk when fewer actions than this are queued
    merge: str = "latest"
    watchdog_s: float = 2.0  # an inference running longer than this is a hung engine
    stale_obs_s: float = 0.25  # an observation "timestamp" unchanged for longer than this is stale
    # The inference worker is a Python thread: while its host code runs it holds the GIL, and CPython hands
    # the GIL to a waiting thread only every sys.getswitchinterval() (default 5 ms) -- a tick that wakes then
    # would start up to 5 ms late. run() lowers the interval to this for its duration (None: leave it).
    gil_switch_s: float | None = 0.0005
    # SCHED_FIFO priority (1..99) for the loop thread during run(), as robot controllers run; needs
    # CAP_SYS_NICE (root, or `setcap`/rtprio limits). None: normal scheduling. The report says if it took.
    rt_priority: int | None = None
    # SCHED_FIFO for the inference worker thread too, one below the loop. Worth it when the policy runs in
    # another process (robots/inference.py): the worker then only waits on a pipe and briefly handles the
    # result, and at normal priority a loaded CPU can preempt it while it holds the GIL, which the
    # real-time loop thread then waits for (priority inversion).
    rt_worker: bool = False
    # Sleep until this long before each tick, then busy-wait to it: a thread that sleeps right up to its
    # deadline wakes late whenever the kernel or the hypervisor is slow to deliver the timer (see the
    # loop-rt results in bench/results). Costs up to spin_s of CPU per period.
    spin_s: float = 0.0
    # CPUs for the loop thread (and its inference worker) during run(), e.g. {0}: a core of its own, as robot
    # controllers isolate theirs (with the policy process and other work pinned elsewhere: InferenceProcess
    # cpus=). None: wherever the OS schedules. The report says what took (LoopReport.cpus).
    cpus: frozenset[int] | None = None
    # Python's cyclic garbage collector stops the thread that triggers it -- and, through the GIL, the loop
    # thread -- for as long as it walks the tracked objects: a full collection over a process holding a
    # simulator, engines and plotting walked them for ~25 ms here. run() collects once before tick 0, then
    # gc.freeze()s what exists (later collections walk only objects made during the run) and unfreezes at
    # the end. The report lists every collection during the run (LoopReport.gc_pauses) either way.
    gc_freeze: bool = True

    def __post_init__(self):
        if self.cpus is not None:
            self.cpus = frozenset(int(c) for c in self.cpus)
            if not self.cpus or min(self.cpus) < 0:
                raise ValueError(f"cpus must be None or a non-empty set of CPU numbers, got {sorted(self.cpus)}")
        if not 1 <= self.hz <= 1000:
            raise ValueError(f"hz must be in [1, 1000], got {self.hz}")
        if self.rt_priority is not None and not 1 <= self.rt_priority <= 99:
            raise ValueError(f"rt_priority must be None or in [1, 99], got {self.rt_priority}")
        if self.gil_switch_s is not None and not 1e-5 <= self.gil_switch_s <= 0.1:
            raise ValueError(f"gil_switch_s must be None or in [1e-5, 0.1] s, got {self.gil_switch_s}")
        if not 0.0 <= self.spin_s < self.dt:
            raise ValueError(f"spin_s must be in [0, period {self.dt:.4f} s), got {self.spin_s}")
        if self.watchdog_s <= 0 or self.request_threshold < 0 or self.stale_obs_s <= 0:
            raise ValueError(f"watchdog_s and stale_obs_s must be > 0 and request_threshold >= 0, got "
                             f"{self.watchdog_s}, {self.stale_obs_s} and {self.request_threshold}")

    @property
    def dt(self) -> float:
        return 1.0 / self.hz


@dataclass
class LoopReport:
    """What one run() did. Times `*_s` are on the loop clock (s since run start), durations `*_ms` in ms."""
    hz: float = 0.0
    realtime: str = "off"  # the loop thread's scheduling during the run
    realtime_worker: str = "off"  # the inference worker thread's (LoopConfig.rt_worker)
    cpus: str = "any"  # the loop thread's CPUs during the run (LoopConfig.cpus)
    gc_pauses: list = field(default_factory=list)  # (loop time s, generation, ms) per collection in the run
    ticks: int = 0
    sent: int = 0
    held: int = 0
    stopped_ticks: int = 0
    starved: int = 0  # ticks with no fresh action (held or stopped)
    deadline_misses: int = 0
    deadline_miss_ticks: list = field(default_factory=list)  # tick index of each miss
    tick_action: list = field(default_factory=list)  # per tick: "sent" | "held" | "stopped"
    faults: list = field(default_factory=list)  # "t=...s what happened", one per fault episode
    fault_s: list = field(default_factory=list)  # loop time of each fault, parallel to `faults`
    sections_ms: dict = field(default_factory=lambda: {k: [] for k in SECTIONS})  # name -> (ticks,) ms
    section_start_s: dict = field(default_factory=lambda: {k: [] for k in SECTIONS})  # name -> (ticks,) s
    inference_ms: list = field(default_factory=list)  # observation -> chunk landed, accepted chunks only
    inference_start_s: list = field(default_factory=list)  # per policy call, worker thread
    inference_end_s: list = field(default_factory=list)
    inference_outcome: list = field(default_factory=list)  # "ok" | "raised" | "bad chunk" | "late" | "unfinished"
    safe_stop_reason: str = ""
    safe_stop_s: float | None = None  # first stopped tick of this run
    safe_stop_failures: int = 0  # robot.safe_stop() calls that raised (each episode is also in `faults`)
    stop_requested: str = ""  # why stop() ended the run early ("" when it ran its full duration)
    queue_dropped_stale: int = 0  # chunk actions whose time had passed when they landed or came due
    sent_actions: list = field(default_factory=list)  # per send (fresh or held): what send_action says it got
    clipped: int = 0  # sent ticks where that differs from the commanded action (the robot's safety limits)
    max_clip: float = 0.0  # the largest |commanded - sent| over the run, in action units
    end_s: float | None = None  # when run() returned

    @property
    def tick_start_s(self) -> list:
        return self.section_start_s["observe"]


class ControlLoop:
    def __init__(self, robot: Robot, policy: Policy, cfg: LoopConfig | None = None):
        self.robot, self.policy, self.cfg = robot, policy, cfg or LoopConfig()
        self.safety = HoldThenStop(self.cfg.hold_s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._fault = ""  # latched policy / engine fault: no fresh actions until reset()
        self._obs_fault = ""  # the current observation fault; clears with the next good observation
        self._stamp, self._stamp_since = None, 0.0  # last observation timestamp, loop time it last changed
        self._job: tuple[float, dict] | None = None  # (observation time, observation) for the worker
        self._busy_since: float | None = None
        self._hung = False
        feats = getattr(robot, "observation_features", {}) or {}
        self._obs_shapes = {k: tuple(v) if isinstance(v, tuple) else None for k, v in feats.items()}
        self._obs_shapes.setdefault("state", None)
        acts = getattr(robot, "action_features", {}) or {}
        self._act_dim = (int(sum(np.prod(v) for v in acts.values()))
                         if acts and all(isinstance(v, tuple) for v in acts.values()) else None)
        self._inflight: tuple[LoopReport, float] | None = None  # (run's report, start) of the call in flight
        self._stop = threading.Event()  # stop() was called: run() ends at the next tick, until reset()
        self._stop_reason = ""
        self._stop_error = ""  # the last safe_stop() failure message, so a failing driver is logged once
        self.queue = ChunkQueue(self.cfg.dt, self.cfg.merge)
        self.report = LoopReport(hz=self.cfg.hz)

    def reset(self) -> None:
        """Clear a latched safe stop, a policy / engine fault and a stop() request: an explicit operator
        decision."""
        with self._lock:
            self.safety.reset()
            self._fault = ""
            self._stop.clear()
            self._stop_reason = ""

    def stop(self, reason: str = "stop requested") -> None:
        """Ask run() to end at its next tick (within one period) with the robot safe-stopped once.
        Safe from a signal handler or another thread: it only sets an Event (a stop before run() starts makes
        run() return after 0 ticks, still safe-stopping the robot)."""
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """True from stop() until reset()."""
        return self._stop.is_set()

    @property
    def stopped(self) -> bool:
        """True while the safe stop is latched: the loop sends no action until reset()."""
        return self.safety.stopped

    def _safe_stop(self, rep: LoopReport, now: float) -> None:
        """robot.safe_stop(); an exception from it is recorded (once per distinct message, counted every
        time), never raised: the loop must survive its robot's failing stop and keep sending nothing."""
        try:
            self.robot.safe_stop()
        except Exception as e:  # noqa: BLE001
            rep.safe_stop_failures += 1
            msg = f"robot.safe_stop() raised {type(e).__name__}: {e}"
            if msg != self._stop_error:
                with self._lock:
                    self._record_fault(rep, now, msg)
                self._stop_error = msg
        else:
            self._stop_error = ""

    def _record_fault(self, rep: LoopReport, now: float, msg: str) -> None:  # caller holds self._lock
        rep.faults.append(f"t={now:.3f}s {msg}")
        rep.fault_s.append(now)

    # -- inference worker --------------------------------------------------------------------------
    def _worker(self, t_origin: float, quit: threading.Event, rep: LoopReport) -> None:
        if self.cfg.cpus is not None:
            try:  # with the loop thread: it only hands observations over and takes chunks in
                os.sched_setaffinity(0, self.cfg.cpus)
            except (AttributeError, OSError):
                pass  # _pin reports it for the loop thread
        if self.cfg.rt_priority is not None and self.cfg.rt_worker:
            try:  # this thread only (Linux: 0 = the calling thread)
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(max(1, self.cfg.rt_priority - 1)))
                rep.realtime_worker = f"SCHED_FIFO {max(1, self.cfg.rt_priority - 1)}"
            except (AttributeError, OSError) as e:
                rep.realtime_worker = f"unavailable ({type(e).__name__}: {e})"
        while not quit.is_set():
            if not self._wake.wait(0.05):
                continue
            self._wake.clear()
            with self._lock:
                job = self._job
                if job is None:
                    continue
                start = time.perf_counter() - t_origin
                self._inflight = (rep, start)
            t0, obs = job
            chunk, fault, outcome = None, "", "ok"
            try:
                actions = self.policy(obs)
            except Exception as e:  # noqa: BLE001  (any policy failure is a fault the loop must survive)
                fault, outcome = f"policy raised {type(e).__name__}: {e}", "raised"
            else:
                try:
                    chunk = Chunk(t0, actions)  # (H, D); refuses NaN/inf
                    if self._act_dim is not None and chunk.actions.shape[1] != self._act_dim:
                        raise ValueError(f"chunk has {chunk.actions.shape[1]} action dims, robot takes {self._act_dim}")
                except Exception as e:  # noqa: BLE001
                    fault, outcome = f"policy returned a bad chunk: {e}", "bad chunk"
            now = time.perf_counter() - t_origin
            with self._lock:
                if self._inflight is not None and self._inflight[0] is rep:
                    self._inflight = None
                if rep.end_s is not None:  # the run is over and logged this call as unfinished
                    continue
                current = self._job is job
                rep.inference_start_s.append(start)
                rep.inference_end_s.append(now)
                rep.inference_outcome.append(outcome if current else "late")
                if not current:  # abandoned by the watchdog: the result is dropped
                    continue
                self._job, self._busy_since = None, None
                if fault:
                    self._record_fault(rep, now, fault)
                    self._fault = self._fault or fault
                else:
                    self.queue.push(chunk, now)
                    rep.inference_ms.append((now - t0) * 1e3)

    def _enter_realtime(self, rep: LoopReport):
        """SCHED_FIFO for the calling (loop) thread; returns what to restore, or None."""
        if self.cfg.rt_priority is None:
            rep.realtime = "off"
            return None
        try:
            old = (os.sched_getscheduler(0), os.sched_getparam(0))
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.cfg.rt_priority))
        except (AttributeError, OSError) as e:  # not Linux, or no CAP_SYS_NICE: run normally, say so
            rep.realtime = f"unavailable ({type(e).__name__}: {e})"
            return None
        rep.realtime = f"SCHED_FIFO {self.cfg.rt_priority}"
        return old

    @staticmethod
    def _gc_watch(rep: LoopReport, clock, t_origin: float):
        """A gc callback recording each collection's start (loop time), generation and duration."""
        started = [0.0]

        def watch(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = clock()
            else:
                rep.gc_pauses.append((started[0] - t_origin, info["generation"], (clock() - started[0]) * 1e3))
        return watch

    def _pin(self, rep: LoopReport):
        """Pin the calling (loop) thread to cfg.cpus; returns the affinity to restore, or None."""
        if self.cfg.cpus is None:
            return None
        try:
            old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cfg.cpus)
        except (AttributeError, OSError) as e:  # not Linux, or CPUs this process may not use
            rep.cpus = f"unavailable ({type(e).__name__}: {e})"
            return None
        rep.cpus = ",".join(map(str, sorted(self.cfg.cpus)))
        return old

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, seconds: float) -> LoopReport:
        """Run for `seconds` at cfg.hz; returns this run's report. A latched stop carries over until reset()."""
        cfg = self.cfg
        self.report = rep = LoopReport(hz=cfg.hz)
        self.queue = ChunkQueue(cfg.dt, cfg.merge)  # queued times belong to the previous run's clock
        self.safety.empty_since = None
        self._job, self._busy_since, self._hung = None, None, False
        self._obs_fault, self._stamp, self._stamp_since = "", None, 0.0
        self._stop_error = ""
        clock = time.perf_counter
        pinned = self._pin(rep)  # before the worker starts, which pins itself alike
        first = self._observe(0.0)
        if first is not None:  # until the first chunk lands, hold where the robot stands
            self.safety.last_target = self.robot.hold_position(first)
        if cfg.gc_freeze:  # before tick 0: this one collection is not in any period
            gc.collect()
            gc.freeze()
        t_origin = clock()  # tick 0 starts now: the first observation's cost is not a late first period
        switch = sys.getswitchinterval()
        if cfg.gil_switch_s is not None:
            sys.setswitchinterval(cfg.gil_switch_s)
        quit = threading.Event()
        worker = threading.Thread(target=self._worker, args=(t_origin, quit, rep), daemon=True)
        worker.start()
        sched = self._enter_realtime(rep)  # after the worker started: it keeps its own scheduling (rt_worker)
        dur, start = rep.sections_ms, rep.section_start_s
        next_tick = 0.0
        gc_watch = self._gc_watch(rep, clock, t_origin)
        gc.callbacks.append(gc_watch)
        try:
            while next_tick < seconds and not self._stop.is_set():
                s0 = clock()
                t_tick = s0 - t_origin
                obs = self._observe(t_tick)
                s1 = clock()
                self._request(obs, t_tick)
                s2 = clock()
                self._act(t_tick)
                s3 = clock()
                next_tick += cfg.dt
                delay = next_tick - (s3 - t_origin)
                if delay < 0:
                    rep.deadline_misses += 1
                    rep.deadline_miss_ticks.append(rep.ticks)
                    next_tick = s3 - t_origin  # re-anchor rather than burst
                else:
                    if delay > cfg.spin_s:
                        time.sleep(delay - cfg.spin_s)
                    deadline = t_origin + next_tick
                    while clock() < deadline:  # the last spin_s: busy-wait, no wake-up latency
                        pass
                s4 = clock()
                for name, a, b in (("observe", s0, s1), ("infer", s1, s2), ("act", s2, s3), ("wait", s3, s4)):
                    start[name].append(a - t_origin)
                    dur[name].append((b - a) * 1e3)
                rep.ticks += 1
            if self._stop.is_set():  # stop(): latch first, so nothing is sent after, then stop the robot once
                now = clock() - t_origin
                rep.stop_requested = self._stop_reason
                self.safety.latch(self.safety.reason or self._stop_reason)
                self._safe_stop(rep, now)
                if rep.safe_stop_s is None:
                    rep.safe_stop_s = now
        except BaseException:  # the loop itself died (a robot method it does not guard, KeyboardInterrupt)
            self.safety.latch(self.safety.reason or "control loop raised")
            self._safe_stop(rep, clock() - t_origin)
            raise
        finally:
            sys.setswitchinterval(switch)
            gc.callbacks.remove(gc_watch)
            if cfg.gc_freeze:
                gc.unfreeze()
            if sched is not None:
                os.sched_setscheduler(0, *sched)
            if pinned is not None:
                os.sched_setaffinity(0, pinned)
            quit.set()
            self._wake.set()
            with self._lock:
                rep.end_s = clock() - t_origin
                if self._inflight is not None and self._inflight[0] is rep:  # still computing: log it open
                    rep.inference_start_s.append(self._inflight[1])
                    rep.inference_end_s.append(rep.end_s)
                    rep.inference_outcome.append("unfinished")
                    self._inflight = None
            worker.join(timeout=0.0 if self._hung else cfg.watchdog_s)  # a hung call never returns in time
        rep.safe_stop_reason = self.safety.reason
        rep.queue_dropped_stale = self.queue.dropped_stale
        return rep

    def _observe(self, now: float) -> dict | None:
        """The observation, or None (and an observation fault) when it is malformed or stale."""
        problem = ""
        try:
            obs = self.robot.get_observation()
            for k, shape in self._obs_shapes.items():
                if k not in obs:
                    raise ValueError(f"missing key {k!r}")
                if shape is not None and np.shape(obs[k]) != shape:
                    raise ValueError(f"{k!r} has shape {np.shape(obs[k])}, expected {shape}")
            state = np.asarray(obs["state"], dtype=np.float64)
            if state.ndim != 1:
                raise ValueError(f"malformed state: expected a 1-D array, got shape {state.shape}")
            with np.errstate(over="ignore", invalid="ignore"):  # checked as the engine sees it: 1e39 -> inf
                bad = np.flatnonzero(~np.isfinite(state.astype(np.float32)))
            if bad.size:
                # only the bad entries: the message stays the same while the same sensor is broken, so
                # the episode is recorded once (the good entries change every tick)
                raise ValueError(f"malformed state: expected values finite in float32 (the engine's input "
                                 f"dtype, |x| <= {np.finfo(np.float32).max:.4g}), got {state[bad].tolist()} "
                                 f"at index {bad.tolist()} of {len(state)}")
            if (stamp := obs.get("timestamp")) is not None:  # robot clock (s), optional
                stamp = float(stamp)
                if stamp != self._stamp:
                    self._stamp, self._stamp_since = stamp, now
                elif now - self._stamp_since > self.cfg.stale_obs_s:
                    problem = (f"stale observation: timestamp {stamp} unchanged for more than "
                               f"{self.cfg.stale_obs_s} s")
        except Exception as e:  # noqa: BLE001
            problem = f"bad observation: {e}"
        if problem != self._obs_fault:  # log each episode once, not every tick
            if problem:
                with self._lock:
                    self._record_fault(self.report, now, problem)
            self._obs_fault = problem
        return None if problem else obs

    def _request(self, obs: dict | None, now: float) -> None:
        with self._lock:
            if self._busy_since is not None and now - self._busy_since > self.cfg.watchdog_s:
                msg = f"engine hung: inference running for more than {self.cfg.watchdog_s} s"
                self._record_fault(self.report, now, msg)
                self._fault = self._fault or msg
                self._job, self._busy_since, self._hung = None, None, True  # abandon it; a late result is dropped
            if obs is None or self._fault or self.safety.stopped or self._busy_since is not None:
                return
            if self.queue.needs_more(self.cfg.request_threshold):
                self._job, self._busy_since = (now, obs), now
                self._wake.set()

    def _send(self, action: np.ndarray, now: float) -> bool:
        """send_action, with a robot that raises recorded as a fault (the loop must not die with it); what
        the robot reports it got (after its own clipping) goes into the report."""
        try:
            got = self.robot.send_action(action)
        except Exception as e:  # noqa: BLE001
            msg = f"robot refused action {np.asarray(action).tolist()}: {type(e).__name__}: {e}"
            with self._lock:  # recorded even behind another fault: a refusal latches the stop at once (_act)
                self._record_fault(self.report, now, msg)
                self._fault = self._fault or msg
            return False
        rep = self.report
        got = np.asarray(action if got is None else got, dtype=np.float64)  # None: a robot that reports nothing
        rep.sent_actions.append(got.tolist())
        want = np.asarray(action, dtype=np.float64)
        clip = float(np.max(np.abs(got - want), initial=0.0)) if got.shape == want.shape else float("inf")
        if clip > 0:
            rep.clipped += 1
            rep.max_clip = max(rep.max_clip, clip)
        return True

    def _act(self, now: float) -> None:
        rep = self.report
        with self._lock:
            action = self.queue.pop(now)  # popped even during a fault, so the queue stays on time
            fault = self._fault or self._obs_fault
        if not fault and action is not None and self.safety.on_action(action) is not None:
            if self._send(action, now):
                rep.sent += 1
                rep.tick_action.append("sent")
                return
            fault = self._fault
        rep.starved += 1
        mode, target = self.safety.on_empty(now, fault or "queue empty")
        if mode == "hold" and self._send(target, now):  # a position target: holding it is safe to repeat
            rep.held += 1
            rep.tick_action.append("held")
        else:
            if mode == "hold":  # the robot refused even the hold target: stop now
                self.safety.latch(f"robot refused the hold target: {self._fault}")
            self._safe_stop(rep, now)
            rep.stopped_ticks += 1
            rep.tick_action.append("stopped")
            if rep.safe_stop_s is None:
                rep.safe_stop_s = now

"""A fixed-rate control loop that never blocks on the model.

Each tick runs four named, timed sections: observe, infer (hand the latest observation to the inference
worker when the queue runs low; never waits for it), act (send the action due now, or hold / safe-stop),
wait (sleep to the next period). For the run, run() pins the loop to its CPUs, puts it on SCHED_FIFO,
freezes the garbage collector and shortens the GIL switch interval, as LoopConfig asks (robots/realtime.py;
everything is restored when run() returns or raises). The inference worker is robots/worker.py's, the one
the DDS node uses too.

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

import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from .checks import ENGINE_MAX, check_chunk, not_finite_as_engine_input
from .chunks import Chunk, ChunkQueue, HoldThenStop
from .realtime import (FixedRate, SectionTimer, frozen_gc, gil_switch_interval, pinned_cpus, recording_gc_pauses,
                       sched_fifo)
from .robot import Robot
from .worker import Inference, InferenceWorker

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
    # sys.setswitchinterval during run() (None: leave it): the worker's Python code holds the GIL, and a
    # waking loop thread gets it only after the holder has run this long.
    gil_switch_s: float | None = 0.0005
    # SCHED_FIFO priority (1..99) for the loop thread during run(), as robot controllers run; needs
    # CAP_SYS_NICE. None: normal scheduling. LoopReport.realtime says what took.
    rt_priority: int | None = None
    # SCHED_FIFO one below the loop for the inference worker thread too (with rt_priority), so a loaded CPU
    # cannot preempt it while it holds the GIL the real-time loop thread waits for (priority inversion).
    # Worth it when the policy runs in another process (robots/inference.py) and the worker only waits.
    rt_worker: bool = False
    # Sleep until this long before each tick, then busy-wait to it: a thread that sleeps right up to its
    # deadline wakes late whenever the timer is delivered late. Costs up to spin_s of CPU per period.
    spin_s: float = 0.0
    # CPUs for the loop thread and its inference worker during run(), e.g. {0}: a core of its own, with the
    # policy process pinned elsewhere (InferenceProcess cpus=). None: any. LoopReport.cpus says what took.
    cpus: frozenset[int] | None = None
    # Collect once before tick 0 and gc.freeze() what exists, so a collection during the run (which stops
    # the loop thread through the GIL) walks only the objects made since. LoopReport.gc_pauses lists every
    # collection during the run either way.
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
    remote_fallbacks: int = 0  # remote target: verifies that ran on the policy's local target (last_info)
    remote_unavailable: int = 0  # remote target: policy calls that raised RemoteUnavailable (the loop held)
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
        self._lock = threading.RLock()  # shared with the inference worker: guards faults, queue and hand-off
        self._fault = ""  # latched policy / engine fault: no fresh actions until reset()
        self._obs_fault = ""  # the current observation fault; clears with the next good observation
        self._stamp, self._stamp_since = None, 0.0  # last observation timestamp, loop time it last changed
        self._worker: InferenceWorker | None = None  # the current run's
        self._hung = False  # the watchdog abandoned a call this run: do not wait for the worker at the end
        feats = getattr(robot, "observation_features", {}) or {}
        self._obs_shapes = {k: tuple(v) if isinstance(v, tuple) else None for k, v in feats.items()}
        self._obs_shapes.setdefault("state", None)
        acts = getattr(robot, "action_features", {}) or {}
        self._act_dim = (int(sum(np.prod(v) for v in acts.values()))
                         if acts and all(isinstance(v, tuple) for v in acts.values()) else None)
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

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, seconds: float) -> LoopReport:
        """Run for `seconds` at cfg.hz; returns this run's report. A latched stop carries over until reset()."""
        cfg, clock = self.cfg, time.perf_counter
        rep = self._new_run()
        with ExitStack() as setup:
            rep.cpus = setup.enter_context(pinned_cpus(cfg.cpus))  # before the worker starts: it inherits them
            first = self._observe(0.0)
            if first is not None:  # until the first chunk lands, hold where the robot stands
                self.safety.last_target = self.robot.hold_position(first)
            setup.enter_context(frozen_gc(cfg.gc_freeze))  # its one collection is before tick 0, in no period
            t_origin = clock()  # tick 0 starts now: the set-up above is not a late first period
            setup.enter_context(gil_switch_interval(cfg.gil_switch_s))
            setup.enter_context(self._inference_worker(rep, t_origin))
            rep.realtime = setup.enter_context(sched_fifo(cfg.rt_priority))  # the worker keeps its own (rt_worker)
            setup.enter_context(recording_gc_pauses(rep.gc_pauses, clock, t_origin))
            setup.enter_context(self._safe_stop_on_exception(rep, t_origin))

            rate = FixedRate(cfg.dt, t_origin, clock, spin_s=cfg.spin_s)
            timer = SectionTimer(rep.section_start_s, rep.sections_ms, clock, t_origin)
            while rate.next_s < seconds and not self._stop.is_set():
                now = timer.tick()
                with timer.section("observe"):
                    obs = self._observe(now)
                with timer.section("infer"):
                    self._request(obs, now)
                with timer.section("act"):
                    self._act(now)
                with timer.section("wait"):
                    on_time = rate.wait()
                if not on_time:  # the schedule restarts from here rather than bursting
                    rep.deadline_misses += 1
                    rep.deadline_miss_ticks.append(rep.ticks)
                rep.ticks += 1
            if self._stop.is_set():  # stop(): latch first, so nothing is sent after, then stop the robot once
                now = clock() - t_origin
                rep.stop_requested = self._stop_reason
                self.safety.latch(self.safety.reason or self._stop_reason)
                self._safe_stop(rep, now)
                if rep.safe_stop_s is None:
                    rep.safe_stop_s = now
        rep.safe_stop_reason = self.safety.reason
        rep.queue_dropped_stale = self.queue.dropped_stale
        return rep

    def _new_run(self) -> LoopReport:
        """A fresh report and queue (queued times belong to the previous run's clock); a latch stays."""
        self.report = LoopReport(hz=self.cfg.hz)
        self.queue = ChunkQueue(self.cfg.dt, self.cfg.merge)
        self.safety.empty_since = None
        self._hung = False
        self._obs_fault, self._stamp, self._stamp_since = "", None, 0.0
        self._stop_error = ""
        return self.report

    @contextmanager
    def _safe_stop_on_exception(self, rep: LoopReport, t_origin: float):
        """The loop itself died (a robot method it does not guard, KeyboardInterrupt): safe-stop, re-raise."""
        try:
            yield
        except BaseException:
            self.safety.latch(self.safety.reason or "control loop raised")
            self._safe_stop(rep, time.perf_counter() - t_origin)
            raise

    # -- inference worker --------------------------------------------------------------------------
    @contextmanager
    def _inference_worker(self, rep: LoopReport, t_origin: float):
        """This run's worker thread, on the loop clock. On exit it is stopped: a call still running is logged
        "unfinished", and a hung one is not waited for."""
        def clock():
            return time.perf_counter() - t_origin
        self._worker = worker = InferenceWorker(
            self.policy, partial(self._landed, rep), partial(check_chunk, dims=self._act_dim), clock,
            lock=self._lock, thread_setup=partial(self._worker_thread, rep), name="control-loop-infer")
        worker.start()
        try:
            yield worker
        finally:
            with self._lock:
                rep.end_s = clock()
                running = worker.stop()  # no result lands after this
                if running is not None:
                    rep.inference_start_s.append(running[1])
                    rep.inference_end_s.append(rep.end_s)
                    rep.inference_outcome.append("unfinished")
            worker.join(0.0 if self._hung else self.cfg.watchdog_s)

    @contextmanager
    def _worker_thread(self, rep: LoopReport):
        """In the worker thread: SCHED_FIFO one below the loop with cfg.rt_worker."""
        prio = self.cfg.rt_priority
        with sched_fifo(max(1, prio - 1) if prio is not None and self.cfg.rt_worker else None) as took:
            rep.realtime_worker = took
            yield

    def _landed(self, rep: LoopReport, done: Inference) -> None:
        """A policy call ended (worker thread, holding self._lock): queue its chunk or latch its fault."""
        rep.inference_start_s.append(done.start)
        rep.inference_end_s.append(done.end)
        rep.inference_outcome.append(done.outcome)
        rep.remote_fallbacks += int(done.info.get("fallbacks", 0))
        rep.remote_unavailable += done.raised == "RemoteUnavailable"
        if done.outcome == "late":  # abandoned by the watchdog: the result is dropped
            return
        if done.error:
            self._record_fault(rep, done.end, done.error)
            self._fault = self._fault or done.error
        else:
            t0 = done.job  # the observation's loop time
            self.queue.push(Chunk(t0, done.chunk), done.end)
            rep.inference_ms.append((done.end - t0) * 1e3)

    # -- the tick's sections -----------------------------------------------------------------------
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
            bad = not_finite_as_engine_input(state)
            if bad.size:
                # only the bad entries: the message stays the same while the same sensor is broken, so
                # the episode is recorded once (the good entries change every tick)
                raise ValueError(f"malformed state: expected values finite in float32 (the engine's input "
                                 f"dtype, |x| <= {ENGINE_MAX:.4g}), got {state[bad].tolist()} "
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
        """Hand the observation to the worker when the queue runs low; the watchdog abandons a hung call."""
        worker = self._worker
        with self._lock:
            if worker.overdue(now, self.cfg.watchdog_s) is not None:
                msg = f"engine hung: inference running for more than {self.cfg.watchdog_s} s"
                self._record_fault(self.report, now, msg)
                self._fault = self._fault or msg
                worker.abandon()  # a late result is dropped
                self._hung = True
            if obs is None or self._fault or self.safety.stopped or worker.busy_since is not None:
                return
            if self.queue.needs_more(self.cfg.request_threshold):
                worker.submit(now, obs, now)

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

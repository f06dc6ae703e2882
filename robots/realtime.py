"""What keeps a Python control loop on time: scheduling set-up as context managers, a fixed-rate clock and
a section timer.

Each context manager changes one process or thread setting for the duration of a `with`, yields what took
(for the loop's report) and restores the old setting on exit, exceptions included:

    with ExitStack() as setup:
        rep.cpus = setup.enter_context(pinned_cpus({0}))          # "0", "any" or "unavailable (...)"
        setup.enter_context(frozen_gc(True))
        setup.enter_context(gil_switch_interval(0.0005))
        rep.realtime = setup.enter_context(sched_fifo(10))        # "SCHED_FIFO 10", "off" or "unavailable (...)"
        setup.enter_context(recording_gc_pauses(rep.gc_pauses, time.perf_counter, t_origin))
        rate, timer = FixedRate(0.02, t_origin), SectionTimer(rep.section_start_s, rep.sections_ms, origin=t_origin)
        while rate.next_s < seconds:
            t = timer.tick()
            with timer.section("observe"):
                ...
            with timer.section("wait"):
                rate.wait()

Affinity and scheduling policy are per thread on Linux (pid 0 = the calling thread); a thread started
inside `pinned_cpus` inherits the CPUs, one started before `sched_fifo` keeps its normal scheduling.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator


def _unavailable(e: BaseException) -> str:
    return f"unavailable ({type(e).__name__}: {e})"


@contextmanager
def pinned_cpus(cpus) -> Iterator[str]:
    """Pin the calling thread to the CPU numbers `cpus` (None: leave it where the OS schedules it). Yields
    "0,1" (what took), "any" (None) or "unavailable (...)" (not Linux, or CPUs this process may not use:
    the thread runs unpinned)."""
    old = None
    if cpus is None:
        took = "any"
    else:
        try:
            old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as e:
            took, old = _unavailable(e), None
        else:
            took = ",".join(map(str, sorted(cpus)))
    try:
        yield took
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)


@contextmanager
def sched_fifo(priority: int | None) -> Iterator[str]:
    """SCHED_FIFO at `priority` (1..99) for the calling thread (None: leave it); needs CAP_SYS_NICE. Yields
    "SCHED_FIFO <priority>", "off" (None) or "unavailable (...)" (not Linux, or not permitted: the thread
    runs normally)."""
    old = None
    if priority is None:
        took = "off"
    else:
        try:
            old = (os.sched_getscheduler(0), os.sched_getparam(0))
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (AttributeError, OSError) as e:
            took, old = _unavailable(e), None
        else:
            took = f"SCHED_FIFO {priority}"
    try:
        yield took
    finally:
        if old is not None:
            os.sched_setscheduler(0, *old)


@contextmanager
def gil_switch_interval(seconds: float | None) -> Iterator[None]:
    """sys.setswitchinterval(seconds) (None: leave it). A thread waiting for the GIL gets it only after the
    holder has run this long, so a shorter interval lets a waking loop thread in sooner."""
    old = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@contextmanager
def frozen_gc(enabled: bool = True) -> Iterator[None]:
    """gc.collect() then gc.freeze() (enabled=False: leave the collector alone); gc.unfreeze() on exit. A
    collection stops every thread (through the GIL) while it walks the tracked objects; frozen objects are
    no longer walked, so collections during the `with` only walk what was made inside it."""
    if enabled:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if enabled:
            gc.unfreeze()


@contextmanager
def recording_gc_pauses(pauses: list, clock: Callable[[], float] = time.perf_counter,
                        origin: float = 0.0) -> Iterator[list]:
    """Append (start s since `origin`, generation, duration ms) to `pauses` for every garbage collection,
    in any thread, during the `with`; yields `pauses`."""
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            pauses.append((started[0] - origin, info["generation"], (clock() - started[0]) * 1e3))
    gc.callbacks.append(watch)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(watch)


class FixedRate:
    """Ticks every `period` s from `start` (a `clock()` time). wait() sleeps to the next tick. A tick that
    ends more than `late_s` past its deadline is a miss: the schedule restarts from now rather than bursting
    to catch up.

    spin_s: sleep until this long before each tick, then busy-wait to it (a sleeping thread wakes late
    whenever the timer is delivered late; spinning costs up to spin_s of CPU per period). sleep: how to
    sleep; one that returns True (threading.Event.wait) cuts the wait short."""

    def __init__(self, period: float, start: float, clock: Callable[[], float] = time.perf_counter,
                 spin_s: float = 0.0, late_s: float = 0.0, sleep: Callable[[float], object] = time.sleep):
        self.period, self.start, self.clock = period, start, clock
        self.spin_s, self.late_s, self.sleep = spin_s, late_s, sleep
        self.next_s = 0.0  # the next tick, s after start

    def wait(self) -> bool:
        """Sleep until the next tick; False (at once) when it is already more than late_s past: a miss."""
        self.next_s += self.period
        now = self.clock() - self.start
        delay = self.next_s - now
        if delay < -self.late_s:
            self.next_s = now
            return False
        if delay > self.spin_s and self.sleep(delay - self.spin_s):
            return True
        deadline = self.start + self.next_s
        while self.clock() < deadline:  # the last spin_s: busy-wait, no wake-up latency
            pass
        return True


class SectionTimer:
    """Times a tick's named sections into `starts[name]` (s since `origin`) and `durations_ms[name]` (ms),
    one entry per tick for every name in `starts`. A tick's entries are recorded when its last section
    ends, so a tick cut short by an exception records none and the lists stay the same length.

        t = timer.tick()
        with timer.section("observe"):
            obs = robot.get_observation()
    """

    def __init__(self, starts: dict, durations_ms: dict, clock: Callable[[], float] = time.perf_counter,
                 origin: float = 0.0):
        self.starts, self.durations_ms, self.clock, self.origin = starts, durations_ms, clock, origin
        self._done: list[tuple[str, float, float]] = []  # (name, start, end) clock times, this tick

    def tick(self) -> float:
        """Begin a tick; returns its start, s since origin."""
        self._done = []
        return self.clock() - self.origin

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        t0 = self.clock()
        yield
        self._done.append((name, t0, self.clock()))
        if len(self._done) == len(self.starts):
            for n, a, b in self._done:
                self.starts[n].append(a - self.origin)
                self.durations_ms[n].append((b - a) * 1e3)

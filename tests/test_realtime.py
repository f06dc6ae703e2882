"""robots/realtime.py: each set-up context manager says what took and restores the setting on exit, an
exception included; the fixed-rate clock and the section timer on a hand-driven clock (no sleeping)."""
import gc
import os
import sys
import threading

import pytest

from edgespec.robots.realtime import (FixedRate, SectionTimer, frozen_gc, gil_switch_interval, pinned_cpus,
                                      recording_gc_pauses, sched_fifo)


class Boom(Exception):
    pass


def in_thread(fn):
    """fn() in a throwaway thread (affinity and scheduling are per thread): its result or its exception."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_pinned_cpus_pins_then_restores_on_exception():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    with pytest.raises(Boom):
        with pinned_cpus({cpu}) as took:
            assert took == str(cpu) and os.sched_getaffinity(0) == {cpu}
            raise Boom
    assert os.sched_getaffinity(0) == before


def test_pinned_cpus_reports_what_did_not_take():
    before = os.sched_getaffinity(0)
    with pinned_cpus(None) as took:
        assert took == "any" and os.sched_getaffinity(0) == before
    with pinned_cpus({4096}) as took:  # a CPU this process may not use: reported, nothing changed
        assert took.startswith("unavailable (OSError") and os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before


def test_pinned_cpus_is_inherited_by_a_thread_started_inside():
    cpu = min(os.sched_getaffinity(0))
    with pinned_cpus({cpu}):
        assert in_thread(lambda: os.sched_getaffinity(0)) == {cpu}


def test_sched_fifo_takes_or_says_why_not_and_restores_on_exception():
    def probe():
        before = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
        with pytest.raises(Boom):
            with sched_fifo(5) as took:
                inside = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
                raise Boom
        return before, took, inside, (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
    before, took, inside, after = in_thread(probe)
    if took == "SCHED_FIFO 5":
        assert inside == (os.SCHED_FIFO, 5)
    else:  # no CAP_SYS_NICE here: said so, and the thread ran as it was
        assert took.startswith("unavailable (PermissionError") and inside == before
    assert after == before
    with sched_fifo(None) as took:
        assert took == "off"
    with sched_fifo(0) as took:  # SCHED_FIFO takes 1..99: refused by the kernel, reported, nothing changed
        assert took.startswith("unavailable (") and os.sched_getscheduler(0) == before[0]


def test_gil_switch_interval_is_restored_on_exception():
    before = sys.getswitchinterval()
    with pytest.raises(Boom):
        with gil_switch_interval(0.0005):
            assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
            raise Boom
    assert sys.getswitchinterval() == before
    with gil_switch_interval(None):
        assert sys.getswitchinterval() == before


def test_frozen_gc_unfreezes_on_exception():
    before = gc.get_freeze_count()
    with pytest.raises(Boom):
        with frozen_gc(True):
            assert gc.get_freeze_count() > before
            raise Boom
    assert gc.get_freeze_count() == before
    with frozen_gc(False):
        assert gc.get_freeze_count() == before


def test_gc_pauses_are_recorded_and_the_callback_removed_on_exception():
    callbacks, pauses = list(gc.callbacks), []
    ticks = iter(range(100))
    with pytest.raises(Boom):
        with recording_gc_pauses(pauses, clock=lambda: float(next(ticks)), origin=0.0):
            gc.collect()
            raise Boom
    assert gc.callbacks == callbacks
    assert pauses and pauses[-1][1] == 2 and pauses[-1][2] == 1e3  # generation 2, one clock step = 1 s
    n = len(pauses)
    gc.collect()
    assert len(pauses) == n  # nothing recorded after the `with`


class FakeClock:
    def __init__(self):
        self.t, self.slept = 0.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(round(s, 9))
        self.t += s


def test_fixed_rate_sleeps_to_each_tick_and_restarts_after_a_miss():
    clock = FakeClock()
    rate = FixedRate(0.1, 0.0, clock, sleep=clock.sleep)
    clock.t = 0.03  # a tick that took 30 ms
    assert rate.wait() and clock.slept == [0.07] and clock.t == pytest.approx(0.1)
    clock.t = 0.25  # this tick ran 50 ms past its deadline (0.2): a miss, no sleep, schedule from now
    assert not rate.wait() and rate.next_s == 0.25 and len(clock.slept) == 1
    clock.t = 0.26
    assert rate.wait() and clock.t == pytest.approx(0.35)


def test_fixed_rate_late_s_tolerates_a_late_tick_and_a_true_sleep_cuts_the_wait():
    clock = FakeClock()
    rate = FixedRate(0.1, 0.0, clock, late_s=0.1, sleep=clock.sleep)
    clock.t = 0.15  # 50 ms late, within late_s: not a miss, no sleep, the schedule keeps its phase
    assert rate.wait() and rate.next_s == pytest.approx(0.1) and not clock.slept
    stop = threading.Event()
    stop.set()
    rate = FixedRate(10.0, 0.0, clock, sleep=stop.wait)  # Event.wait returns True at once: no 10 s sleep
    assert rate.wait()


def test_section_timer_records_every_section_of_every_completed_tick():
    clock = FakeClock()
    names = ("observe", "infer", "act", "wait")
    starts, durations = {k: [] for k in names}, {k: [] for k in names}
    timer = SectionTimer(starts, durations, clock, origin=0.0)
    for tick in range(2):
        assert timer.tick() == clock.t
        for k, ms in zip(names, (1, 2, 3, 4)):
            with timer.section(k):
                clock.t += ms / 1e3
    assert durations == {k: [pytest.approx(ms)] * 2 for k, ms in zip(names, (1, 2, 3, 4))}
    assert starts["observe"] == [0.0, pytest.approx(0.010)] and starts["act"] == [pytest.approx(0.003),
                                                                                  pytest.approx(0.013)]
    timer.tick()  # a tick cut short by an exception records none of its sections
    with timer.section("observe"):
        clock.t += 0.001
    with pytest.raises(Boom):
        with timer.section("infer"):
            raise Boom
    assert all(len(v) == 2 for v in (*starts.values(), *durations.values()))

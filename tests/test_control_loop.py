"""The control loop with a mock robot and mock policies: it keeps running (and keeps its period) through
every fault, holds, then latches a safe stop that only reset() clears. Assertions are about what happened
and about counts with wide tolerances, never about how fast (these machines are shared)."""
import math
import time

import numpy as np
import pytest

from edgespec.robots.loop import ControlLoop, LoopConfig
from edgespec.robots.robot import MockRobot

HZ = 50


def chunked_policy(h=8, delay=0.0):
    def policy(obs):
        time.sleep(delay)
        return np.tile(obs["state"] + 0.01, (h, 1))
    return policy


def good_then(bad, good_calls=1, h=8):
    """A policy that returns `good_calls` healthy chunks, then calls bad(obs)."""
    calls = {"n": 0}

    def policy(obs):
        calls["n"] += 1
        return np.tile(obs["state"] + 0.01, (h, 1)) if calls["n"] <= good_calls else bad(obs)
    return policy


STALL_S = 0.2  # a tick interval this long means the box froze the whole process (seen on loaded CI)


def stalled(rep):
    starts = [0.0] + list(rep.tick_start_s)
    return not rep.ticks or max(np.diff(starts)) > STALL_S


def run(make_policy, seconds=0.6, make_robot=None, tries=3, **cfg):
    """Run a fresh robot + policy; rerun (up to `tries`) when the machine froze the process mid-run, since
    such a run tests the scheduler, not the loop. A loop that blocks itself stalls every try and fails."""
    for _ in range(tries):
        with (make_robot or (lambda: MockRobot(dims=2)))() as robot:
            rep = ControlLoop(robot, make_policy(), LoopConfig(hz=HZ, **cfg)).run(seconds)
        if not stalled(rep):
            break
    return robot, rep


def assert_kept_period(rep, seconds):
    """The loop kept its period: ~seconds * hz ticks (never more: no bursts), median interval ~ dt."""
    assert 0.6 * seconds * HZ <= rep.ticks <= math.ceil(seconds * HZ) + 1, rep.ticks
    assert 0.8 / HZ <= np.median(np.diff(rep.tick_start_s)) <= 1.5 / HZ
    assert len(rep.tick_action) == rep.ticks == len(rep.sections_ms["wait"])


def assert_held_then_stopped(rep, robot, fault):
    """After the fault: hold (no fresh action), then a latched stop to the end, and the report says why."""
    assert any(fault in f for f in rep.faults), rep.faults
    assert fault in rep.safe_stop_reason, rep.safe_stop_reason
    acts = rep.tick_action
    first_stop = acts.index("stopped")
    assert "held" in acts[:first_stop] and set(acts[first_stop:]) == {"stopped"}
    assert rep.stopped_ticks == len(acts) - first_stop and robot.stops == rep.stopped_ticks
    assert rep.safe_stop_s is not None and rep.safe_stop_s >= rep.fault_s[0]
    assert all(np.isfinite(a).all() for a in robot.sent)


def boom(obs):
    raise RuntimeError("engine exploded")


def test_healthy_policy_drives_the_robot():
    robot, rep = run(chunked_policy)
    assert_kept_period(rep, 0.6)
    assert rep.sent >= rep.ticks // 2 and not rep.faults
    assert rep.safe_stop_reason == "" and robot.stops == 0
    assert set(rep.sections_ms) == {"observe", "infer", "act", "wait"} and len(rep.sections_ms["act"]) == rep.ticks
    assert robot.state[0] > 0.05  # it moved


class Glitchy(MockRobot):
    """A MockRobot with a timestamp. Once a fresh action has moved it, its observation goes bad from the
    `after`-th call on, for `calls` calls."""

    def __init__(self, bad, after=3, calls=10**9):
        super().__init__(dims=2)
        self.observation_features = {"state": (2,), "timestamp": ()}
        self.bad, self.after, self.calls, self.n = bad, after, calls, 0

    def get_observation(self):
        obs = {"state": self.state.copy(), "timestamp": time.perf_counter()}
        self.n += self.state[0] > 0  # the policy's chunks add 0.01: counting starts once one landed
        return self.bad(obs) if self.after <= self.n < self.after + self.calls else obs


@pytest.mark.parametrize("bad,what", [
    (lambda o: {"timestamp": o["timestamp"]}, "missing key 'state'"),
    (lambda o: {**o, "state": np.zeros(3)}, "shape (3,)"),
    (lambda o: {**o, "state": np.zeros((2, 2))}, "shape (2, 2)"),
    (lambda o: {**o, "state": np.array([0.0, np.nan])}, "malformed state"),
    # finite in float64, inf once cast to the engine's float32: as bad as NaN
    (lambda o: {**o, "state": np.array([0.0, 1e39])}, "expected values finite in float32"),
    (lambda o: {**o, "state": np.array([-1e39, 0.0])}, "expected values finite in float32"),
    # one broken sensor beside one that keeps moving: still one fault episode
    (lambda o: {**o, "state": np.array([np.nan, o["timestamp"]])}, "got [nan] at index [0] of 2"),
])
def test_malformed_observation_holds_then_stops(bad, what):
    robot, rep = run(chunked_policy, 0.8, lambda: Glitchy(bad), hold_s=0.1)
    assert_kept_period(rep, 0.8)
    assert rep.sent > 0  # it ran fine before the sensor broke
    assert_held_then_stopped(rep, robot, "bad observation")
    assert what in rep.safe_stop_reason and len(rep.faults) == 1  # one fault episode, not one per tick


def test_one_bad_observation_holds_a_tick_and_recovers():
    robot, rep = run(chunked_policy, 0.6, lambda: Glitchy(lambda o: {}, calls=1), hold_s=0.3)
    assert_kept_period(rep, 0.6)
    assert len(rep.faults) == 1 and "missing key" in rep.faults[0]
    assert rep.safe_stop_reason == "" and rep.stopped_ticks == 0 and rep.held >= 1
    fault_tick = int(np.searchsorted(rep.tick_start_s, rep.fault_s[0]))
    assert rep.tick_action[fault_tick] == "held" and "sent" in rep.tick_action[fault_tick + 1:]


def test_stale_observation_holds_then_stops():
    def make_robot():
        frozen = {}

        def freeze(o):  # the driver keeps returning its last reading, timestamp and all
            frozen.setdefault("obs", o)
            return dict(frozen["obs"])
        return Glitchy(freeze)
    robot, rep = run(chunked_policy, 0.8, make_robot, hold_s=0.1, stale_obs_s=0.1)
    assert_kept_period(rep, 0.8)
    assert rep.sent > 0
    assert_held_then_stopped(rep, robot, "stale observation")


def test_policy_exception_holds_then_latches_a_stop():
    robot, rep = run(lambda: good_then(boom), 0.8, hold_s=0.1)
    assert_kept_period(rep, 0.8)
    assert rep.sent > 0 and "raised" in rep.inference_outcome
    assert_held_then_stopped(rep, robot, "policy raised RuntimeError: engine exploded")


def test_nan_actions_are_a_fault_not_a_command():
    robot, rep = run(lambda: good_then(lambda obs: np.full((4, 2), np.nan)), 0.8, hold_s=0.1)
    assert_kept_period(rep, 0.8)
    assert_held_then_stopped(rep, robot, "NaN")
    assert "policy returned a bad chunk" in rep.safe_stop_reason and "bad chunk" in rep.inference_outcome


def test_nan_from_the_first_call_never_reaches_the_robot():
    robot, rep = run(lambda: lambda obs: np.full((4, 2), np.nan), 0.3)
    assert any("NaN" in f for f in rep.faults) and rep.sent == 0
    assert all(np.isfinite(a).all() for a in robot.sent)


def test_wrong_action_dims_are_a_bad_chunk():
    robot, rep = run(lambda: lambda obs: np.zeros((4, 3)), 0.3, hold_s=0.05)
    assert rep.sent == 0 and "3 action dims, robot takes 2" in rep.safe_stop_reason


def test_hung_engine_trips_the_watchdog_then_holds_and_stops():
    def hang(obs):
        time.sleep(2.0)
        return np.tile(obs["state"], (8, 1))
    robot, rep = run(lambda: good_then(hang), 0.8, watchdog_s=0.1, hold_s=0.1)
    assert_kept_period(rep, 0.8)  # the loop kept ticking while the engine hung
    assert_held_then_stopped(rep, robot, "engine hung")
    assert rep.inference_outcome[-1] == "unfinished"  # run() returned without waiting for the hung call


def test_a_latched_stop_needs_an_explicit_reset():
    for _ in range(3):  # rerun if the machine froze the process (see run())
        with MockRobot(dims=2) as robot:
            loop = ControlLoop(robot, good_then(boom), LoopConfig(hz=HZ, hold_s=0.05))
            first = loop.run(0.5)
            loop.policy = chunked_policy()  # the policy is fixed, but nobody reset the latch
            second = loop.run(0.3)
            loop.reset()
            third = loop.run(0.4)
        if not any(map(stalled, (first, second, third))):
            break
    assert first.safe_stop_reason and first.stopped_ticks > 0
    assert second.sent == 0 and second.stopped_ticks == second.ticks and "engine exploded" in second.safe_stop_reason
    assert third.sent > 0 and third.safe_stop_reason == "" and not third.faults


def test_slow_engine_holds_the_last_position_between_chunks():
    robot, rep = run(lambda: chunked_policy(h=8, delay=0.06), 0.8, hold_s=1.0, request_threshold=1)
    assert rep.sent > 0 and rep.held > 0 and rep.stopped_ticks == 0  # starved ticks hold, never stop
    assert rep.queue_dropped_stale > 0  # ~ceil(60 ms / 20 ms) actions of each chunk were already past


def test_chunk_shorter_than_the_latency_is_all_stale():
    robot, rep = run(lambda: chunked_policy(h=2, delay=0.06), 0.5, hold_s=1.0)
    assert rep.sent == 0 and rep.held == rep.ticks and rep.queue_dropped_stale > 0


def test_malformed_first_observation_is_reported():
    class Broken(MockRobot):
        def get_observation(self):
            return {"state": "garbage"}
    robot, rep = run(chunked_policy, 0.2, Broken, hold_s=0.02)
    assert any("bad observation" in f for f in rep.faults) and rep.sent == 0 and rep.stopped_ticks == rep.ticks


def test_latency_profile_has_percentiles_for_every_section():
    from edgespec.robots.profile import loop_profile
    robot, rep = run(chunked_policy, 0.3)
    s = loop_profile(rep, 1 / HZ)
    assert set(s["sections_ms"]) == {"observe", "infer", "act", "wait"}
    assert s["jitter_ms"]["n"] == rep.ticks - 1 and s["inference_ms"]["n"] >= 1
    assert all(s["sections_ms"][k]["p99"] >= s["sections_ms"][k]["p50"] for k in s["sections_ms"])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="hz must be in"):
        LoopConfig(hz=0)
    with pytest.raises(ValueError, match="stale_obs_s"):
        LoopConfig(stale_obs_s=0)


class Refusing(MockRobot):
    """A robot whose driver rejects commands after a few (e.g. a joint limit fault)."""

    def __init__(self, ok=3):
        super().__init__(dims=2)
        self.ok = ok

    def send_action(self, action):
        if len(self.sent) >= self.ok:
            raise RuntimeError("driver fault: joint 1 over current")
        return super().send_action(action)


def test_a_robot_that_raises_is_a_fault_and_the_loop_stops_it():
    robot, rep = run(lambda: chunked_policy(), make_robot=lambda: Refusing(ok=3))
    assert_kept_period(rep, 0.6)
    assert any("driver fault" in f for f in rep.faults), rep.faults
    assert rep.tick_action[-1] == "stopped" and robot.stops >= 1 and len(robot.sent) == 3
    assert "driver fault" in rep.safe_stop_reason


def test_hold_target_before_the_first_chunk_is_the_positions_only():
    class PosVel(MockRobot):  # state = positions then velocities, as the reacher reports it
        def __init__(self, dims):
            super().__init__(dims)
            self.observation_features = {"state": (2 * dims,)}

        def get_observation(self):
            return {"state": np.concatenate([self.state, np.zeros(2)])}

    robot, rep = run(lambda: chunked_policy(delay=0.3), seconds=0.3, make_robot=lambda: PosVel(dims=2))
    assert rep.held >= 1 and all(a.shape == (2,) for a in robot.sent)


def test_gil_switch_interval_is_lowered_during_the_run_and_restored():
    import sys
    before, seen = sys.getswitchinterval(), []

    def policy(obs):
        seen.append(sys.getswitchinterval())
        return np.tile(obs["state"], (8, 1))

    with MockRobot(dims=2) as robot:
        ControlLoop(robot, policy, LoopConfig(hz=HZ, gil_switch_s=0.0005)).run(0.2)
    assert seen and all(abs(v - 0.0005) < 1e-9 for v in seen)
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="gil_switch_s"):
        LoopConfig(gil_switch_s=1.0)


def can_sched_fifo() -> bool:
    """Whether this process may put a thread on SCHED_FIFO: tried in a throwaway thread (Linux applies
    sched_setscheduler(0, ...) to the calling thread only), so the test thread keeps its scheduling."""
    import os
    import threading
    got = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            got.append(True)
        except (AttributeError, OSError):
            got.append(False)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


def test_realtime_scheduling_is_applied_or_reported_and_always_restored():
    import os
    before, worker_sched = os.sched_getscheduler(0), []

    def policy(obs):  # runs in the inference worker: it keeps normal scheduling
        worker_sched.append(os.sched_getscheduler(0))
        return np.tile(obs["state"], (8, 1))

    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ, rt_priority=10)).run(0.2)
    if can_sched_fifo():  # the report says what this process can actually do, nothing else
        assert rep.realtime == "SCHED_FIFO 10", rep.realtime
    else:
        assert rep.realtime.startswith("unavailable (PermissionError"), rep.realtime
    assert worker_sched and set(worker_sched) == {before}
    assert os.sched_getscheduler(0) == before
    with pytest.raises(ValueError, match="rt_priority"):
        LoopConfig(rt_priority=100)


def test_rt_worker_puts_the_worker_one_below_the_loop_or_says_why_not():
    import os
    got = []

    def policy(obs):
        got.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority))
        return np.tile(obs["state"], (8, 1))

    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ, rt_priority=10, rt_worker=True)).run(0.2)
    if not can_sched_fifo():  # no CAP_SYS_NICE here: reported, not silently skipped
        assert rep.realtime_worker.startswith("unavailable (PermissionError"), rep.realtime_worker
        assert rep.realtime.startswith("unavailable (PermissionError"), rep.realtime
        return
    assert rep.realtime == "SCHED_FIFO 10" and rep.realtime_worker == "SCHED_FIFO 9"
    assert got and set(got) == {(os.SCHED_FIFO, 9)}
    with MockRobot(dims=2) as robot:  # without rt_priority, rt_worker changes nothing
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ, rt_worker=True)).run(0.1)
    assert rep.realtime_worker == "off"


def test_spin_keeps_the_period_and_is_validated():
    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, lambda obs: np.tile(obs["state"], (8, 1)),
                          LoopConfig(hz=HZ, spin_s=0.002)).run(0.3)
    periods = np.diff(rep.tick_start_s)
    assert rep.ticks >= int(0.3 * HZ) - 1 and abs(np.median(periods) - 1 / HZ) < 1e-3
    with pytest.raises(ValueError, match=r"spin_s must be in \[0, period"):
        LoopConfig(hz=HZ, spin_s=1.0 / HZ)


def test_cpus_pin_the_loop_and_its_worker_for_the_run_only():
    import os
    before, seen = os.sched_getaffinity(0), []
    cpu = min(before)

    def policy(obs):  # runs in the inference worker thread
        seen.append(os.sched_getaffinity(0))
        return np.tile(obs["state"], (8, 1))

    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ, cpus={cpu})).run(0.2)
    assert rep.cpus == str(cpu) and seen and all(s == {cpu} for s in seen)
    assert os.sched_getaffinity(0) == before  # restored
    with MockRobot(dims=2) as robot:  # a CPU this process may not use: reported, the loop still runs
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ, cpus={4096})).run(0.1)
    assert rep.cpus.startswith("unavailable") and rep.ticks > 0 and rep.sent > 0
    with MockRobot(dims=2) as robot:
        assert ControlLoop(robot, policy, LoopConfig(hz=HZ)).run(0.05).cpus == "any"
    with pytest.raises(ValueError, match="cpus must be None or a non-empty set"):
        LoopConfig(cpus=set())


def test_gc_is_frozen_during_the_run_and_every_collection_is_reported():
    import gc
    frozen, before = [], gc.get_freeze_count()

    def policy(obs):  # a full collection in the worker: the report must show it
        frozen.append(gc.get_freeze_count())
        gc.collect()
        return np.tile(obs["state"], (8, 1))

    callbacks = list(gc.callbacks)
    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=HZ)).run(0.2)
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == before  # frozen in the run, not after
    assert gc.callbacks == callbacks
    assert any(g == 2 for _, g, _ in rep.gc_pauses) and all(ms >= 0 and 0 <= t <= rep.end_s
                                                           for t, _, ms in rep.gc_pauses)
    from edgespec.robots.profile import loop_profile
    assert loop_profile(rep)["gc_pauses_ms"]["n"] == len(rep.gc_pauses)
    frozen.clear()
    with MockRobot(dims=2) as robot:  # gc_freeze=False leaves the collector as it is
        ControlLoop(robot, policy, LoopConfig(hz=HZ, gc_freeze=False)).run(0.1)
    assert frozen and set(frozen) == {before}


def test_stop_ends_the_run_at_the_next_tick_with_one_safe_stop():
    import threading
    def stop_once_sending(loop, robot, stamp):  # from another thread, as a signal handler would
        while len(robot.sent) < 3 and time.perf_counter() - stamp[0] < 5.0:
            time.sleep(0.002)
        stamp[1] = time.perf_counter()
        loop.stop("SIGTERM")

    for _ in range(3):  # rerun if the machine froze the process (see run())
        with MockRobot(dims=2) as robot:
            loop = ControlLoop(robot, chunked_policy(), LoopConfig(hz=HZ, hold_s=5.0))
            stamp = [time.perf_counter(), None]  # (start, when stop() was called)
            # stop once actions flow: run()'s set-up (gc.collect over the whole test process) takes a
            # varying share of any fixed delay
            threading.Thread(target=stop_once_sending, args=(loop, robot, stamp), daemon=True).start()
            rep = loop.run(10.0)
            after = time.perf_counter() - stamp[1]  # from stop() to run() returning
        if not stalled(rep):
            break
    assert after < 0.5 and rep.ticks >= 3, (after, rep.ticks)  # the run ended within a few ticks of stop()
    assert rep.stop_requested == "SIGTERM" and rep.safe_stop_reason == "SIGTERM" and rep.safe_stop_s is not None
    assert robot.stops == 1 and rep.sent > 0 and rep.stopped_ticks == 0
    sent = len(robot.sent)
    again = loop.run(0.3)  # the stop is latched like any safe stop: nothing runs until reset()
    assert again.ticks == 0 and len(robot.sent) == sent and robot.stops == 2
    loop.reset()
    with robot:
        assert loop.run(0.3).sent > 0


def test_stop_before_run_runs_no_tick_and_still_stops_the_robot():
    with MockRobot(dims=2) as robot:
        loop = ControlLoop(robot, chunked_policy(), LoopConfig(hz=HZ))
        loop.stop("SIGINT")
        rep = loop.run(1.0)
    assert rep.ticks == 0 and robot.stops == 1 and not robot.sent and rep.stop_requested == "SIGINT"


class StopFails(MockRobot):
    """A robot whose safe_stop() raises (e.g. the driver lost the bus); counts the calls."""

    def __init__(self):
        super().__init__(dims=2)
        self.stop_calls = 0

    def safe_stop(self):
        self.stop_calls += 1
        raise OSError("CAN bus down")


def test_a_safe_stop_that_raises_is_a_fault_and_the_loop_keeps_sending_nothing():
    robot, rep = run(lambda: good_then(boom), 0.8, make_robot=StopFails, hold_s=0.1)
    assert_kept_period(rep, 0.8)  # the loop survived its robot's failing stop
    acts = rep.tick_action
    first_stop = acts.index("stopped")
    assert set(acts[first_stop:]) == {"stopped"} and rep.stopped_ticks == len(acts) - first_stop
    assert len(robot.sent) == acts[:first_stop].count("sent") + acts[:first_stop].count("held")  # none after
    assert robot.stop_calls == rep.safe_stop_failures == rep.stopped_ticks
    stop_faults = [f for f in rep.faults if "robot.safe_stop() raised OSError: CAN bus down" in f]
    assert len(stop_faults) == 1  # one entry per failure episode, not one per tick


def test_a_safe_stop_that_raises_on_stop_request_is_reported():
    with StopFails() as robot:
        loop = ControlLoop(robot, chunked_policy(), LoopConfig(hz=HZ))
        loop.stop("SIGTERM")
        rep = loop.run(1.0)
    assert robot.stop_calls == rep.safe_stop_failures == 1 and rep.stop_requested == "SIGTERM"
    assert any("CAN bus down" in f for f in rep.faults)


def test_an_exception_escaping_the_loop_still_safe_stops_the_robot():
    class Interrupted(MockRobot):  # KeyboardInterrupt is no Exception: the loop does not swallow it
        def get_observation(self):
            if self.sent:
                raise KeyboardInterrupt
            return super().get_observation()
    with Interrupted(dims=2) as robot:
        loop = ControlLoop(robot, chunked_policy(), LoopConfig(hz=HZ))
        with pytest.raises(KeyboardInterrupt):
            loop.run(2.0)
    assert robot.stops == 1 and loop.stopped


def test_a_robot_refusing_the_hold_behind_a_policy_fault_is_recorded_too():
    class RefusesHolds(MockRobot):  # fine until the policy fails; then its driver refuses the hold target
        def __init__(self):
            super().__init__(dims=2)
            self.policy_failed = False

        def send_action(self, action):
            if self.policy_failed:
                raise RuntimeError("driver fault: joint 1 over current")
            return super().send_action(action)
    robots = []

    def make_robot():
        robots.append(RefusesHolds())
        return robots[-1]

    def make_policy():
        def bad(obs):
            robots[-1].policy_failed = True
            raise RuntimeError("engine exploded")
        return good_then(bad)
    robot, rep = run(make_policy, 0.6, make_robot=make_robot, hold_s=0.3)
    assert any("engine exploded" in f for f in rep.faults) and any("driver fault" in f for f in rep.faults), rep.faults
    acts = rep.tick_action  # (a hold before the first chunk is fine: the robot took it)
    assert "robot refused the hold target" in rep.safe_stop_reason and "held" not in acts[acts.index("sent"):]


def test_what_the_robot_actually_sent_is_recorded():
    """send_action returns the action after the robot's own limits: the report keeps it, and counts the
    sends it changed (MockRobot clips to +-1; the policy asks for 2)."""
    from edgespec.robots.profile import loop_profile

    def too_far(obs):
        return np.full((8, 2), 2.0)
    with MockRobot(dims=2, limit=1.0) as robot:
        rep = ControlLoop(robot, too_far, LoopConfig(hz=HZ)).run(0.3)
    sent_fresh = rep.tick_action.count("sent")
    assert sent_fresh > 0 and rep.clipped >= sent_fresh and rep.max_clip == 1.0
    assert len(rep.sent_actions) == len(robot.sent) and rep.sent_actions[-1] == [1.0, 1.0]
    prof = loop_profile(rep)
    assert prof["clipped_by_robot"] == rep.clipped and prof["max_clip"] == 1.0

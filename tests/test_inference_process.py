"""InferenceProcess: a policy in a child process behind the loop's callable contract."""
from __future__ import annotations

import os
import time
from functools import partial

import numpy as np
import pytest

from edgespec.robots.inference import InferenceProcess
from edgespec.robots.loop import ControlLoop, LoopConfig
from edgespec.robots.robot import MockRobot


class Echo:
    """obs {"x": float} -> (2, 2) filled with x; x < 0 raises; x == 99 hangs."""

    def __init__(self, scale: float):
        self.scale, self.last_info, self.calls = scale, {}, 0

    def __call__(self, obs):
        self.calls += 1
        x = float(obs["x"])
        if x < 0:
            raise ValueError(f"negative x {x}")
        if x == 99:
            time.sleep(60)
        self.last_info = {"calls": self.calls, "pid": os.getpid()}
        return np.full((2, 2), x * self.scale)


def make_echo(scale: float = 1.0):
    return Echo(scale)


def make_broken():
    raise FileNotFoundError("no such policy folder")


def test_calls_cross_the_process_and_bring_back_last_info():
    with InferenceProcess(partial(make_echo, 2.0)) as pol:
        assert pol.pid != os.getpid()
        np.testing.assert_array_equal(pol({"x": 1.5}), np.full((2, 2), 3.0))
        pol({"x": 2.0})
        assert pol.last_info == {"calls": 2, "pid": pol.pid}


def test_a_raising_policy_is_a_runtime_error_and_the_process_survives():
    with InferenceProcess(make_echo) as pol:
        with pytest.raises(RuntimeError, match="policy process: ValueError: negative x -1.0"):
            pol({"x": -1.0})
        assert pol({"x": 4.0})[0, 0] == 4.0


class LosesItsServer(Echo):
    """Echo until x == 7, then the remote target's failure (what a policy with on_failure "raise" raises)."""

    def __call__(self, obs):
        if float(obs["x"]) == 7:
            from edgespec.remote import RemoteUnavailable
            raise RemoteUnavailable("http://127.0.0.1:9: the verify failed (connection x1)")
        return super().__call__(obs)


def make_loses_its_server():
    return LosesItsServer(1.0)


def test_what_the_child_raised_is_named_and_leaves_no_last_info():
    from edgespec.robots.worker import InferenceWorker
    with InferenceProcess(make_loses_its_server) as pol:
        pol({"x": 1.0})
        assert pol.last_info["calls"] == 1
        with pytest.raises(RuntimeError, match="RemoteUnavailable") as e:
            pol({"x": 7.0})
        assert e.value.type_name == "RemoteUnavailable" and pol.last_info == {}
        done = []
        worker = InferenceWorker(pol, done.append)
        worker.start()
        worker.submit("job", {"x": 7.0})
        t0 = time.monotonic()
        while not done and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        worker.stop()
        assert done and done[0].outcome == "raised" and done[0].raised == "RemoteUnavailable" and done[0].info == {}


def test_a_factory_that_fails_is_reported_at_start():
    with pytest.raises(RuntimeError, match="failed to start: building the policy failed: FileNotFoundError"):
        InferenceProcess(make_broken)


def test_a_dead_process_turns_the_next_call_into_an_error():
    pol = InferenceProcess(make_echo)
    try:
        pol._proc.kill()
        pol._proc.join(5)
        with pytest.raises(RuntimeError, match="not running|died"):
            pol({"x": 1.0})
    finally:
        pol.close()


def test_the_loop_survives_a_raising_process_policy_and_a_hung_one():
    robot = MockRobot(dims=2)
    with robot, InferenceProcess(make_echo) as pol:
        def policy(obs):  # the mock robot's observation, with a poisoned x
            return pol({"x": -1.0})
        rep = ControlLoop(robot, policy, LoopConfig(hz=50, hold_s=0.1)).run(0.3)
        assert rep.ticks >= 14 and rep.sent == 0
        assert any("policy process: ValueError" in f for f in rep.faults)
    with MockRobot(dims=2) as robot:
        pol = InferenceProcess(make_echo)
        try:
            rep = ControlLoop(robot, lambda obs: pol({"x": 99.0}),
                              LoopConfig(hz=50, hold_s=0.1, watchdog_s=0.2)).run(0.5)
            assert any("engine hung" in f for f in rep.faults) and rep.ticks >= 24
        finally:
            t = time.perf_counter()
            pol.close(timeout_s=0.5)  # the child cannot answer "quit" while it sleeps: killed
            assert time.perf_counter() - t < 10.0 and not pol._proc.is_alive()


def blas_env():
    return {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}


class EnvReport:
    last_info: dict = {}

    def __call__(self, obs):
        return np.zeros((1, 1))


def make_env_report():
    r = EnvReport()
    r.last_info = blas_env()
    return r


def test_the_child_gets_single_threaded_blas_and_the_parent_keeps_its_environment():
    before = blas_env()
    with InferenceProcess(make_env_report) as pol:
        pol({})
        assert pol.last_info == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    assert blas_env() == before


class AffinityReport:
    def __init__(self):
        self.last_info = {}

    def __call__(self, obs):
        self.last_info = {"cpus": sorted(os.sched_getaffinity(0))}
        return np.zeros((1, 1))


def test_cpus_pin_the_child_and_bad_sets_are_refused():
    cpu = min(os.sched_getaffinity(0))
    with InferenceProcess(AffinityReport, cpus=[cpu]) as pol:
        pol({})
        assert pol.last_info == {"cpus": [cpu]} and pol.cpus == {cpu}
    with pytest.raises(ValueError, match=r"cpus must be a non-empty subset of this process's CPUs .*got \[4096\]"):
        InferenceProcess(AffinityReport, cpus=[4096])

"""The control loop with a mock robot and mock policies: it keeps running through every fault and ends in
hold-then-stop. Assertions are about what happened, never about how fast (these machines are shared)."""
import time

import numpy as np
import pytest

from edgespec.robots.loop import ControlLoop, LoopConfig
from edgespec.robots.robot import MockRobot


def chunked_policy(h=8, delay=0.0):
    def policy(obs):
        time.sleep(delay)
        return np.tile(obs["state"] + 0.01, (h, 1))
    return policy


def run(policy, seconds=0.6, **cfg):
    with MockRobot(dims=2) as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=50, **cfg)).run(seconds)
    return robot, rep


def test_healthy_policy_drives_the_robot():
    robot, rep = run(chunked_policy())
    assert rep.ticks >= 20 and rep.sent >= rep.ticks // 2 and not rep.faults
    assert rep.safe_stop_reason == "" and robot.stops == 0
    assert set(rep.sections_ms) == {"observe", "infer", "act", "wait"} and len(rep.sections_ms["act"]) == rep.ticks
    assert robot.state[0] > 0.05  # it moved


def test_policy_exception_holds_then_latches_a_stop():
    calls = {"n": 0}

    def flaky(obs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("engine exploded")
        return np.tile(obs["state"], (4, 1))
    robot, rep = run(flaky, seconds=0.6, hold_s=0.05)
    assert any("engine exploded" in f for f in rep.faults)
    assert "policy raised RuntimeError" in rep.safe_stop_reason and rep.stopped_ticks > 0 and robot.stops > 0


def test_nan_actions_are_a_fault_not_a_command():
    robot, rep = run(lambda obs: np.full((4, 2), np.nan), seconds=0.3)
    assert any("NaN" in f for f in rep.faults) and rep.sent == 0
    assert all(np.isfinite(a).all() for a in robot.sent)


def test_hung_engine_trips_the_watchdog():
    robot, rep = run(chunked_policy(delay=5.0), seconds=0.5, watchdog_s=0.1)
    assert any("engine hung" in f for f in rep.faults) and "engine hung" in rep.safe_stop_reason
    assert rep.ticks >= 15  # the loop kept ticking while the engine hung


def test_slow_engine_holds_the_last_position_between_chunks():
    robot, rep = run(chunked_policy(h=8, delay=0.06), seconds=0.8, hold_s=1.0, request_threshold=1)
    assert rep.sent > 0 and rep.held > 0 and rep.stopped_ticks == 0  # starved ticks hold, never stop
    assert rep.queue_dropped_stale > 0  # ~ceil(60 ms / 20 ms) actions of each chunk were already past


def test_chunk_shorter_than_the_latency_is_all_stale():
    robot, rep = run(chunked_policy(h=2, delay=0.06), seconds=0.5, hold_s=1.0)
    assert rep.sent == 0 and rep.held == rep.ticks and rep.queue_dropped_stale > 0


def test_malformed_observation_is_reported():
    class Broken(MockRobot):
        def get_observation(self):
            return {"state": "garbage"}
    with Broken() as robot:
        rep = ControlLoop(robot, chunked_policy(), LoopConfig(hz=50, hold_s=0.02)).run(0.2)
    assert any("bad observation" in f for f in rep.faults) and rep.sent == 0


def test_latency_summary_has_percentiles_for_every_section():
    from edgespec.robots.loop import summarize
    robot, rep = run(chunked_policy(), seconds=0.3)
    s = summarize(rep, 1 / 50)
    assert set(s["sections_ms"]) == {"observe", "infer", "act", "wait"}
    assert s["jitter_ms"]["n"] == rep.ticks - 1 and s["inference_ms"]["n"] >= 1
    assert all(s["sections_ms"][k]["p99"] >= s["sections_ms"][k]["p50"] for k in s["sections_ms"])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="hz must be in"):
        LoopConfig(hz=0)

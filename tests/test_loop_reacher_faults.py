"""The control loop with the bundled VLA policy on the MuJoCo reacher, its sensor corrupted for a few ticks:
the loop must catch what the engine would choke on before the policy sees it, hold, and carry on."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mujoco", reason="the reacher needs the robots extra (mujoco)")

from edgespec.robots.loop import ControlLoop, LoopConfig  # noqa: E402
from edgespec.robots.reacher import ReacherRobot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reacher_policy():
    from edgespec.export.bundled import ensure_policy_engines
    from edgespec.policy import load_policy
    return load_policy(ensure_policy_engines(ROOT / "models", ROOT / "engines"), draft="head")


class Recording:
    """The policy, noting every state it was asked to act on."""

    def __init__(self, policy):
        self.policy, self.states = policy, []

    def __call__(self, obs):
        self.states.append(np.array(obs["state"]))
        return self.policy(obs)


class CorruptSensor(ReacherRobot):
    """The reacher whose state reads `value` in every entry for `calls` observations from the `first`-th
    on (counting from 1; the loop's first call is before tick 0). Notes the fingertip's distance to the
    named target at every observation."""

    def __init__(self, value, first, calls, **kw):
        super().__init__(**kw)
        self.value, self.first, self.calls, self.n = value, first, calls, 0
        self.dist: list[float] = []

    def get_observation(self):
        obs = super().get_observation()
        self.n += 1
        self.dist.append(self.env.distance())
        if self.first <= self.n < self.first + self.calls:
            obs = {**obs, "state": np.full_like(obs["state"], self.value)}
        return obs


@pytest.mark.parametrize("value", [1e39, np.nan])
def test_corrupt_state_for_five_ticks_is_a_fault_and_moves_nothing(reacher_policy, value):
    first, calls = 6, 5  # mid-reach (the fingertip is still ~7 cm out), 0.25 s of garbage at 20 Hz
    policy = Recording(reacher_policy)
    with CorruptSensor(value, first, calls, seed=1, color="red") as robot:
        rep = ControlLoop(robot, policy, LoopConfig(hz=20, hold_s=1.0)).run(2.0)
    # recorded once, as a malformed observation (not as whatever the engine made of it)
    assert len(rep.faults) == 1 and "bad observation: malformed state" in rep.faults[0], rep.faults
    # the policy never saw the bad state, so no action derived from it reached the robot
    with np.errstate(over="ignore"):
        assert policy.states and all(np.isfinite(s.astype(np.float32)).all() for s in policy.states)
    # held, then carried on: the fingertip never got farther from the target than when the sensor broke
    # (1 cm slack: the PD settling on the hold target), and ended the episode on it
    at_fault = robot.dist[first - 1]
    assert max(robot.dist[first - 1:]) <= at_fault + 0.01, (at_fault, robot.dist)
    assert rep.safe_stop_reason == "" and "held" in rep.tick_action and robot.dist[-1] < 0.02, robot.dist

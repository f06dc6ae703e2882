"""The three-target MuJoCo reacher: scene, rendering, IK expert, the Robot adapter.

Needs mujoco + gymnasium (the robots extra) and an offscreen GL (MUJOCO_GL=osmesa with Debian's
libosmesa6 on CPU machines; the test command installs both). These are declared dependencies: a missing
one fails here rather than skipping.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.robots.reacher import (COLORS, L1, L2, SUCCESS_RADIUS, ReacherRobot, ThreeTargetReacher,
                                     expert_chunk, ik)


@pytest.fixture(scope="module")
def env():
    e = ThreeTargetReacher()
    yield e
    e.close()


def fk(q):
    return np.array([L1 * np.cos(q[0]) + L2 * np.cos(q[0] + q[1]), L1 * np.sin(q[0]) + L2 * np.sin(q[0] + q[1])])


@pytest.mark.parametrize("seed", range(5))
def test_ik_puts_the_fingertip_on_the_target(seed):
    rng = np.random.default_rng(seed)
    rad, ang = rng.uniform(0.07, 0.2), rng.uniform(-np.pi, np.pi)
    target = np.array([rad * np.cos(ang), rad * np.sin(ang)])
    q = ik(target, rng.uniform(-2, 2, 2))
    np.testing.assert_allclose(fk(q), target, atol=1e-9)
    assert -np.pi < q[0] <= np.pi


def test_expert_chunk_moves_at_most_max_step_per_step_then_holds():
    q = np.array([0.0, 0.0, 0.0, 0.0])
    c = expert_chunk(q, np.array([0.0, 0.15]), horizon=8, max_step=0.4)
    assert c.shape == (8, 2)
    steps = np.abs(np.diff(np.vstack([q[:2], c]), axis=0))
    assert (steps <= 0.4 + 1e-12).all()
    np.testing.assert_allclose(fk(c[-1]), [0.0, 0.15], atol=1e-9)


def test_scene_has_three_separated_targets_and_renders_64x64(env):
    obs = env.reset(seed=3)
    assert set(env.targets) == set(COLORS)
    pts = list(env.targets.values())
    assert min(np.linalg.norm(a - b) for i, a in enumerate(pts) for b in pts[i + 1:]) >= 0.06
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (4,)
    assert env.color in obs["instruction"] and obs["instruction"].endswith("target")
    # the named target's colour is visible: its channel dominates somewhere in the image
    img = obs["image"].astype(int)
    ch = {"red": 0, "green": 1, "blue": 2}[env.color]
    dominant = (img[..., ch] - img.sum(-1) / 3)
    assert dominant.max() > 40


def test_reset_is_deterministic_per_seed(env):
    a = env.reset(seed=11)
    ta = {k: v.copy() for k, v in env.targets.items()}
    b = env.reset(seed=11)
    np.testing.assert_array_equal(a["image"], b["image"])
    assert all(np.array_equal(ta[k], env.targets[k]) for k in ta)


def test_scripted_expert_succeeds(env):
    succ = []
    for seed in range(10):
        env.reset(seed=seed)
        done = False
        while not done:
            _, reward, done, info = env.step(env.expert(8)[0])
        succ.append(info["success"])
        assert reward == pytest.approx(-info["distance"])
    assert np.mean(succ) >= 0.9, succ


def test_bad_action_and_colour_are_refused(env):
    env.reset(seed=0)
    with pytest.raises(ValueError, match="2 finite joint targets"):
        env.step(np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="color must be one of"):
        env.reset(seed=0, color="purple")


def test_robot_adapter_clips_and_reports_what_it_sent():
    with ReacherRobot(seed=2, color="blue", max_step=0.3) as robot:
        q = robot.get_observation()["state"][:2]
        sent = robot.send_action(q + np.array([2.0, -2.0]))
        np.testing.assert_allclose(sent, q + np.array([0.3, -0.3]))
        sent = robot.send_action(np.array([0.0, 5.0]))
        assert sent[1] <= 3.0
        with pytest.raises(ValueError, match="NaN"):
            robot.send_action(np.array([0.0, np.inf]))
        robot.safe_stop()
        assert robot.stops == 1 and robot.steps == 2
        assert "blue" in robot.instruction
    with pytest.raises(RuntimeError, match="not connected"):
        robot.get_observation()


def test_expert_reaches_within_the_success_radius_through_the_robot():
    with ReacherRobot(seed=5, color="red") as robot:
        for _ in range(40):
            robot.send_action(robot.env.expert(8)[0])
        assert robot.distances[-1] <= SUCCESS_RADIUS

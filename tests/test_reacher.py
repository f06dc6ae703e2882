"""The three-target MuJoCo reacher: scene, rendering, IK expert, the Robot adapter.

Needs mujoco + gymnasium (the robots extra) and an offscreen GL (MUJOCO_GL=osmesa with Debian's
libosmesa6 on CPU machines; the test command installs both). These are declared dependencies: a missing
one fails here rather than skipping.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.robots.reacher import (COLORS, REACH, SUCCESS_RADIUS, ReacherRobot, ThreeTargetReacher,
                                     expert_chunk, fk, ik, wrap)


@pytest.fixture(scope="module")
def env():
    e = ThreeTargetReacher()
    yield e
    e.close()


@pytest.mark.parametrize("seed", range(5))
def test_ik_puts_the_fingertip_on_the_target(seed):
    rng = np.random.default_rng(seed)
    rad, ang = rng.uniform(0.07, 0.2), rng.uniform(-np.pi, np.pi)
    target = np.array([rad * np.cos(ang), rad * np.sin(ang)])
    q_now = rng.uniform(-6, 6, 2)
    q = ik(target, q_now)
    np.testing.assert_allclose(fk(q), target, atol=1e-9)
    assert abs(q[0] - q_now[0]) <= np.pi + 1e-12  # joint0 is unlimited: the short way round


def test_expert_chunk_moves_at_most_max_step_per_step_then_holds():
    tip = np.array([0.2, 0.0])
    c = expert_chunk(tip, np.array([0.0, 0.15]), horizon=12, max_step=0.03)
    assert c.shape == (12, 2)
    steps = np.linalg.norm(np.diff(np.vstack([tip, c]), axis=0), axis=1)
    assert (steps <= 0.03 + 1e-12).all()
    np.testing.assert_allclose(c[-1], [0.0, 0.15], atol=1e-12)  # 0.25 m away: there after 9 steps, then held
    np.testing.assert_allclose(c[-3:], np.tile([0.0, 0.15], (3, 1)), atol=1e-12)
    assert np.allclose(wrap(np.array([3 * np.pi / 2])), [-np.pi / 2])


def test_scene_has_three_separated_targets_and_renders_64x64(env):
    obs = env.reset(seed=3)
    assert set(env.targets) == set(COLORS)
    pts = list(env.targets.values())
    assert min(np.linalg.norm(a - b) for i, a in enumerate(pts) for b in pts[i + 1:]) >= 0.06
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].shape == (6,)
    np.testing.assert_allclose(obs["state"][4:], env.fingertip())
    np.testing.assert_allclose(fk(obs["state"][:2]), env.fingertip(), atol=1e-6)
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
    assert np.mean(succ) == 1.0, succ  # 100/100 over seeds 0..99 when measured


def test_bad_action_and_colour_are_refused(env):
    env.reset(seed=0)
    with pytest.raises(ValueError, match="finite fingertip target"):
        env.step(np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="color must be one of"):
        env.reset(seed=0, color="purple")


def test_robot_adapter_clips_and_reports_what_it_sent():
    with ReacherRobot(seed=2, color="blue", max_step=0.05) as robot:
        obs = robot.get_observation()
        tip = obs["state"][4:]
        np.testing.assert_allclose(robot.hold_position(obs), tip)
        sent = robot.send_action(tip + np.array([0.3, 0.0]))  # too far in one step: 0.05 m towards it
        np.testing.assert_allclose(sent, tip + np.array([0.05, 0.0]))
        far = robot.send_action(np.array([1.0, 0.0]))  # outside the reach, and far
        assert np.linalg.norm(far) <= REACH + 1e-12
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

"""Embodiments: joint states by name -> the policy's state in its order, its actions -> joint targets (the
reacher's IK chained through the chunk), and the lookup from what a policy folder declares."""
import json
from pathlib import Path

import numpy as np
import pytest

from edgespec.robots.embodiment import (JointEmbodiment, ReacherEmbodiment, embodiment_for, make_embodiment)
from edgespec.robots.reacher import L1, L2, fk

ROOT = Path(__file__).resolve().parents[1]
REACHER_STATE = ["joint0.position", "joint1.position", "joint0.velocity", "joint1.velocity", "fingertip.x",
                 "fingertip.y"]


class Declared:
    """A policy object carrying only its parsed policy.json (Policy.meta)."""

    def __init__(self, meta):
        self.meta = meta


def test_generic_joints_default_is_positions_then_velocities_and_joint_targets_pass_through():
    emb = JointEmbodiment(["a", "b"])
    assert emb.state_names == ("a.position", "b.position", "a.velocity", "b.velocity")
    assert emb.state([1.0, 2.0], [3.0, 4.0]).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert emb.command_joints == ("a", "b") and emb.needs_velocity
    chunk = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(emb.joint_targets(chunk, np.zeros(2)), chunk)


def test_generic_joints_follow_the_policys_declared_order():
    emb = make_embodiment("joints", ["b.velocity", "a.position"], "joint_position", ["b.position", "a.position"])
    assert emb.joint_names == ("b", "a") and emb.command_joints == ("b", "a")
    assert emb.state([1.0, 2.0], [3.0, 4.0]).tolist() == [3.0, 2.0]  # b.velocity, a.position
    assert not make_embodiment("joints", ["a.position"], "joint_position", ["a.position"]).needs_velocity


def test_reacher_state_adds_the_fingertip_in_the_policys_order():
    q, qd = np.array([0.3, -1.1]), np.array([0.5, -0.25])
    emb = ReacherEmbodiment(REACHER_STATE)
    np.testing.assert_allclose(emb.state(q, qd), np.concatenate([q, qd, fk(q)]), rtol=0, atol=0)
    shuffled = ReacherEmbodiment(["fingertip.y", "joint1.velocity", "joint0.position"])
    np.testing.assert_allclose(shuffled.state(q, qd), [fk(q)[1], qd[1], q[0]], rtol=0, atol=0)
    # fk against the geometry: straight arm along x
    np.testing.assert_allclose(fk(np.zeros(2)), [L1 + L2, 0.0], atol=1e-15)


def test_reacher_ik_chain_reaches_each_target_and_keeps_the_elbow_continuous():
    q_now = np.array([2.9, 1.2])  # near the +/-pi seam and elbow-positive
    tips = np.array([fk(q_now + [0.1 * k, -0.05 * k]) for k in range(1, 9)])  # (8, 2) a smooth path
    q = ReacherEmbodiment(REACHER_STATE).joint_targets(tips, q_now)
    assert q.shape == (8, 2) and np.isfinite(q).all()
    np.testing.assert_allclose([fk(row) for row in q], tips, atol=1e-9)  # each step lands on its target
    steps = np.abs(np.diff(np.vstack([q_now, q]), axis=0))
    assert steps.max() < 0.2, steps  # no elbow flip, no 2*pi jump of joint0 across the seam
    assert (q[:, 1] > 0).all()


def test_reacher_ik_seeds_each_step_from_the_previous_one_not_from_the_current_pose():
    # the path swings the elbow through straight (q1 = 0) to the other side; chaining keeps following it
    q_now = np.array([0.0, 0.3])
    q_path = np.array([[0.0, 0.3 - 0.1 * k] for k in range(1, 7)])  # q1: 0.2, 0.1, 0.0, -0.1, -0.2, -0.3
    tips = np.array([fk(r) for r in q_path])
    q = ReacherEmbodiment(REACHER_STATE).joint_targets(tips, q_now)
    np.testing.assert_allclose([fk(r) for r in q], tips, atol=1e-9)
    # each step's elbow is the solution nearer the previous step's, so the chunk follows the path through
    # straight; seeded from the current pose every step would keep the elbow positive (q1 = +0.1, +0.2, ...)
    np.testing.assert_allclose(q, q_path, atol=1e-6)


def test_reacher_joint_position_actions_pass_through_in_joint_order():
    emb = make_embodiment("three-target-reacher", REACHER_STATE, "joint_position",
                          ["joint1.position", "joint0.position"])
    np.testing.assert_array_equal(emb.joint_targets(np.array([[1.0, 2.0]]), np.zeros(2)), [[2.0, 1.0]])


@pytest.mark.parametrize("args, match", [
    (("four-legged-dog", REACHER_STATE, "cartesian_position", ["fingertip.x", "fingertip.y"]),
     "unknown embodiment 'four-legged-dog': this node knows \\['joints', 'three-target-reacher'\\]"),
    (("three-target-reacher", REACHER_STATE + ["elbow.torque"], "cartesian_position", ["fingertip.x", "fingertip.y"]),
     "the policy asks for \\['elbow.torque'\\]"),
    (("three-target-reacher", REACHER_STATE, "cartesian_position", ["fingertip.x", "fingertip.z"]),
     "expects action names \\['fingertip.x', 'fingertip.y'\\] \\(any order\\), got"),
    (("three-target-reacher", REACHER_STATE, "joint_velocity", ["fingertip.x", "fingertip.y"]),
     "action_kind: expected one of"),
    (("joints", ["a.position", "fingertip.x"], "joint_position", ["a.position"]), "cannot produce \\['fingertip.x'\\]"),
    (("joints", ["a.position"], "cartesian_position", ["a.position"]), "takes joint_position actions"),
])
def test_unknown_embodiments_and_unproducible_names_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        make_embodiment(*args)


def test_the_bundled_policy_declares_the_reacher(bundled_policy_dir):
    for folder in (ROOT / "models" / "vla-reacher", bundled_policy_dir):
        path = folder / "policy.json"
        emb = embodiment_for(Declared(json.loads(path.read_text())))
        assert isinstance(emb, ReacherEmbodiment) and emb.state_names == tuple(REACHER_STATE)
        assert emb.command_joints == ("joint0", "joint1") and emb.action_kind == "cartesian_position"
    assert embodiment_for(lambda obs: None) is None  # a plain callable declares nothing
    with pytest.raises(ValueError, match="no state_names"):
        embodiment_for(Declared({"embodiment": "three-target-reacher"}))

"""Embodiments: how a policy's own state and action vectors map onto a robot's ROS joints.

A ROS robot speaks joints; a policy speaks the named vectors its policy.json declares:

    ROS side (by joint name)                             policy side (in the policy's order)
    sensor_msgs/JointState  name[], position[],   --->   state (S,): state_names, e.g. joint0.position,
                            velocity[]                    joint0.velocity, fingertip.x (units: state_units)
    trajectory_msgs/JointTrajectory joint_names[], <---  actions (H, A): action_names, of action_kind
                            points[k].positions[]         "joint_position" or "cartesian_position"
                            (joint position targets)

An `Embodiment` does both conversions for one kind of robot:

    emb.joint_names                  the joints it reads from a JointState (found there by name)
    emb.state(position, velocity)    (J,), (J,) in joint_names order -> (S,) in state_names order
    emb.joint_targets(actions, position)   (H, A) actions, (J,) current positions -> (H, C) joint position
                                     targets for emb.command_joints (the JointTrajectory's joint_names)

`JointEmbodiment` ("joints") is the generic one: state names `<joint>.position` / `<joint>.velocity`,
actions `<joint>.position` (joint position targets, passed through). `ReacherEmbodiment`
("three-target-reacher") adds the fingertip: state `fingertip.x` / `fingertip.y` by forward kinematics
of joint0, joint1, and Cartesian fingertip targets turned into joint targets by two-link IK, chained
through the chunk (each step's elbow solution is the one nearer the previous step's).

`embodiment_for(policy)` looks the policy's declared "embodiment" up in `EMBODIMENTS`; it raises
ValueError for an unknown embodiment or for state / action names the embodiment cannot produce.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from edgespec.policy_contract import ACTION_KINDS  # what policy.json may declare

from .reacher import fk, ik

POSITION, VELOCITY = "position", "velocity"


def _split(name: str) -> tuple[str, str]:
    """'joint0.position' -> ('joint0', 'position')."""
    joint, _, quantity = name.rpartition(".")
    return joint, quantity


def _ordered_union(*seqs) -> tuple[str, ...]:
    out: list[str] = []
    for seq in seqs:
        out += [x for x in seq if x not in out]
    return tuple(out)


class Embodiment(ABC):
    name: str
    joint_names: tuple[str, ...]  # joints read from a JointState, by name
    command_joints: tuple[str, ...]  # joints of the published JointTrajectory, in its order
    state_names: tuple[str, ...]  # the policy's state, in its order
    action_names: tuple[str, ...]  # the policy's action dimensions, in its order

    @property
    def needs_velocity(self) -> bool:
        """True when the policy's state holds a velocity (a JointState without velocities is then rejected)."""
        return any(_split(n)[1] == VELOCITY for n in self.state_names)

    @abstractmethod
    def state(self, position: np.ndarray, velocity: np.ndarray) -> np.ndarray:
        """(J,) positions, (J,) velocities in joint_names order -> (S,) float64 policy state."""

    @abstractmethod
    def joint_targets(self, actions: np.ndarray, position: np.ndarray) -> np.ndarray:
        """(H, A) policy actions, (J,) current joint positions -> (H, C) joint position targets."""

    def describe(self) -> str:
        return (f"{self.name}: state [{', '.join(self.state_names)}] -> actions [{', '.join(self.action_names)}]"
                f" -> joints [{', '.join(self.command_joints)}]")


class JointEmbodiment(Embodiment):
    """Policies whose state is joint positions / velocities and whose actions are joint position targets.
    The default (old node behaviour) over joints j1..jn: state [j.position..., j.velocity...], actions
    [j.position...]."""

    name = "joints"

    def __init__(self, joint_names: Sequence[str] = (), state_names: Sequence[str] | None = None,
                 action_names: Sequence[str] | None = None):
        joints = tuple(joint_names)
        if state_names is None:
            state_names = [f"{j}.{POSITION}" for j in joints] + [f"{j}.{VELOCITY}" for j in joints]
        if action_names is None:
            action_names = [f"{j}.{POSITION}" for j in joints]
        self.state_names, self.action_names = tuple(state_names), tuple(action_names)
        bad = [n for n in self.state_names if _split(n)[1] not in (POSITION, VELOCITY) or not _split(n)[0]]
        if bad:
            raise ValueError(f"embodiment 'joints' builds state names <joint>.position / <joint>.velocity; "
                             f"cannot produce {bad}")
        bad = [n for n in self.action_names if _split(n)[1] != POSITION or not _split(n)[0]]
        if bad or not self.action_names:
            raise ValueError(f"embodiment 'joints' takes joint position actions named <joint>.position; "
                             f"got {list(self.action_names)}")
        self.command_joints = tuple(_split(n)[0] for n in self.action_names)
        if len(set(self.command_joints)) != len(self.command_joints):
            raise ValueError(f"action names must name distinct joints, got {list(self.action_names)}")
        self.joint_names = _ordered_union(joints, self.command_joints, (_split(n)[0] for n in self.state_names))
        col = {j: i for i, j in enumerate(self.joint_names)}
        # state k = (position or velocity array, column)
        self._state_idx = [(_split(n)[1] == VELOCITY, col[_split(n)[0]]) for n in self.state_names]

    def state(self, position, velocity):
        src = (np.asarray(position, np.float64), np.asarray(velocity, np.float64))
        return np.array([src[is_vel][i] for is_vel, i in self._state_idx], np.float64)

    def joint_targets(self, actions, position):
        return np.asarray(actions, np.float64)  # action k is command_joints[k]'s position target


class ReacherEmbodiment(Embodiment):
    """The three-target reacher (robots/reacher.py): joints joint0 (shoulder), joint1 (elbow); state may
    hold their positions (rad), velocities (rad/s) and the fingertip position fingertip.x / .y (m, forward
    kinematics); actions are fingertip position targets (m, cartesian_position) turned into joint targets
    by IK, or joint0 / joint1 position targets (joint_position), passed through."""

    name = "three-target-reacher"
    JOINTS = ("joint0", "joint1")
    TIP = ("fingertip.x", "fingertip.y")

    def __init__(self, state_names: Sequence[str], action_kind: str = "cartesian_position",
                 action_names: Sequence[str] = TIP):
        self.joint_names = self.command_joints = self.JOINTS
        self.state_names, self.action_names = tuple(state_names), tuple(action_names)
        produced = [f"{j}.{q}" for q in (POSITION, VELOCITY) for j in self.JOINTS] + list(self.TIP)
        bad = [n for n in self.state_names if n not in produced]
        if bad:
            raise ValueError(f"embodiment {self.name!r} produces state names {produced}; the policy asks for {bad}")
        self._state_idx = [produced.index(n) for n in self.state_names]
        want = {"cartesian_position": self.TIP, "joint_position": tuple(f"{j}.{POSITION}" for j in self.JOINTS)}
        if action_kind not in want:
            raise ValueError(f"action_kind: expected one of {list(want)}, got {action_kind!r}")
        if sorted(self.action_names) != sorted(want[action_kind]):
            raise ValueError(f"embodiment {self.name!r} with {action_kind} actions expects action names "
                             f"{list(want[action_kind])} (any order), got {list(self.action_names)}")
        self.action_kind = action_kind
        self._action_idx = [self.action_names.index(n) for n in want[action_kind]]  # -> canonical order

    def state(self, position, velocity):
        q, qd = np.asarray(position, np.float64), np.asarray(velocity, np.float64)
        full = np.concatenate([q, qd, fk(q)])  # the `produced` order
        return full[self._state_idx]

    def joint_targets(self, actions, position):
        a = np.asarray(actions, np.float64)[:, self._action_idx]  # (H, 2) canonical order
        if self.action_kind == "joint_position":
            return a
        out, q = np.empty_like(a), np.asarray(position, np.float64)
        for k, xy in enumerate(a):  # chain: step k's elbow solution is the one nearer step k - 1's
            q = out[k] = ik(xy, q)
        return out


def _declared(policy, key: str):
    """A policy.json field: the Policy attribute when it has one, else its parsed policy.json (`meta`)."""
    value = getattr(policy, key, None)
    if value is None:
        value = (getattr(policy, "meta", None) or {}).get(key)
    return value


def make_embodiment(name: str, state_names: Sequence[str], action_kind: str = "joint_position",
                    action_names: Sequence[str] = ()) -> Embodiment:
    """The embodiment `name` for a policy with these state / action semantics; ValueError when there is no
    such embodiment or it cannot produce the policy's state or consume its actions."""
    if name not in EMBODIMENTS:
        raise ValueError(f"unknown embodiment {name!r}: this node knows {sorted(EMBODIMENTS)}")
    if action_kind not in ACTION_KINDS:
        raise ValueError(f"action_kind: expected one of {list(ACTION_KINDS)}, got {action_kind!r}")
    if name == JointEmbodiment.name:
        if action_kind != "joint_position":
            raise ValueError(f"embodiment 'joints' takes joint_position actions, got {action_kind!r}")
        return JointEmbodiment((), state_names, action_names)
    return EMBODIMENTS[name](state_names, action_kind, action_names)


def embodiment_for(policy) -> Embodiment | None:
    """The embodiment a policy declares (policy.embodiment or its policy.json's "embodiment", with its
    state_names, action_kind, action_names); None for a policy that declares none (a plain callable)."""
    name = _declared(policy, "embodiment")
    if name is None:
        return None
    state_names, action_names = _declared(policy, "state_names"), _declared(policy, "action_names")
    if not state_names or not action_names:
        raise ValueError(f"the policy declares embodiment {name!r} but no state_names / action_names "
                         f"(got {state_names!r} / {action_names!r})")
    emb = make_embodiment(name, state_names, _declared(policy, "action_kind") or "joint_position", action_names)
    for key, have in (("state_dim", emb.state_names), ("dims", emb.action_names)):
        want = getattr(policy, key, None)
        if want is not None and int(want) != len(have):
            raise ValueError(f"the policy's {key} is {want} but it names {len(have)}: {list(have)}")
    return emb


EMBODIMENTS = {JointEmbodiment.name: JointEmbodiment, ReacherEmbodiment.name: ReacherEmbodiment}

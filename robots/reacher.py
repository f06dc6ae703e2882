"""A three-target reacher: gymnasium's MuJoCo Reacher-v5 with a red, a green and a blue target and an
instruction naming one ("reach the red target"), position-controlled, rendered offscreen to 64x64 RGB.

Changes from Reacher-v5 (its reacher.xml is the base, edited at load):
- three coloured targets instead of one, placed apart in the reachable annulus;
- the two torque motors become PD position actuators; the action is a fingertip position target (x, y)
  in metres, turned into joint targets by two-link inverse kinematics (the elbow solution nearer the
  current pose) -- end-effector targets, as VLA policies usually emit, and a position a control loop can
  hold on a dry queue;
- frame_skip 5 at timestep 0.01 -> 20 Hz control; episodes of 40 steps (2 s);
- a top-down camera over the arena; a dark fingertip so it is not mistaken for the green target.

Observation: {"image": (64, 64, 3) uint8, "state": (6,) float64 [q0, q1, qd0, qd1, x, y] (joint angles,
velocities, fingertip position), "instruction": str}.
Success: fingertip within 0.02 of the named target at the end of the episode.

`expert_chunk` is the scripted expert: a chunk of H fingertip waypoints on the straight line to the named
target, at most `max_step` metres apart, then holding it; IK + PD track them.

Rendering needs MUJOCO_GL=osmesa (Debian's libosmesa6) on a CPU machine, or egl on a GPU; this module
sets osmesa when MUJOCO_GL is unset, and LP_NUM_THREADS=0 (render in the calling thread) when that is unset.
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("MUJOCO_GL", "osmesa")
# osmesa's llvmpipe otherwise starts a rasteriser thread per core: for a 64x64 image they cost more than they
# save, and they take the cores the policy decodes on
os.environ.setdefault("LP_NUM_THREADS", "0")

COLORS = {"red": "0.9 0.1 0.1 1", "green": "0.1 0.75 0.1 1", "blue": "0.15 0.25 0.95 1"}
TEMPLATES = ("reach the {} target", "go to the {} target", "touch the {} target")
L1, L2 = 0.1, 0.11  # link0 length; joint1 to fingertip (reacher.xml)
SUCCESS_RADIUS = 0.02
CONTROL_DT = 0.05
EPISODE_STEPS = 40
IMAGE_SIZE = 64


def reacher_xml() -> str:
    """Reacher-v5's model with three coloured targets and position actuators."""
    import gymnasium
    src = Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets" / "reacher.xml"
    root = ET.fromstring(src.read_text())
    world = root.find("worldbody")
    world.remove(world.find("body[@name='target']"))
    for geom in root.iter("geom"):
        if geom.get("name") == "fingertip":
            geom.set("rgba", "0.1 0.1 0.1 1")
    for i, (name, rgba) in enumerate(COLORS.items()):
        body = ET.SubElement(world, "body", name=f"target_{name}", pos="0 0 .01")
        for axis, a in (("x", "1 0 0"), ("y", "0 1 0")):
            ET.SubElement(body, "joint", name=f"target_{name}_{axis}", type="slide", axis=a, armature="0",
                          damping="0", limited="true", range="-.27 .27", stiffness="0")
        ET.SubElement(body, "geom", name=f"target_{name}", type="sphere", size=".016", rgba=rgba,
                      conaffinity="0", contype="0")
    act = root.find("actuator")
    for m in list(act):
        act.remove(m)
    for joint in ("joint0", "joint1"):
        ET.SubElement(act, "position", joint=joint, kp="400", kv="40", forcelimited="true",
                      forcerange="-200 200")
    return ET.tostring(root, encoding="unicode")


def instruction_for(color: str, template: int = 0) -> str:
    return TEMPLATES[template].format(color)


def wrap(a):
    return (np.asarray(a) + np.pi) % (2 * np.pi) - np.pi


def ik(target_xy: np.ndarray, q_now: np.ndarray) -> np.ndarray:
    """Two-link inverse kinematics: joint angles putting the fingertip on target_xy (clipped to the
    reachable annulus), the elbow solution nearer to q_now; q0 is taken the short way round from q_now[0]
    (joint0 is unlimited)."""
    x, y = float(target_xy[0]), float(target_xy[1])
    c1 = np.clip((x * x + y * y - L1 * L1 - L2 * L2) / (2 * L1 * L2), -1.0, 1.0)
    best = None
    for q1 in (np.arccos(c1), -np.arccos(c1)):
        q0 = np.arctan2(y, x) - np.arctan2(L2 * np.sin(q1), L1 + L2 * np.cos(q1))
        d0 = float(wrap(q0 - q_now[0]))
        cost = abs(d0) + abs(q1 - q_now[1])
        if best is None or cost < best[0]:
            best = (cost, np.array([q_now[0] + d0, q1]))
    return best[1]


def fk(q: np.ndarray) -> np.ndarray:
    """Fingertip (x, y) of joint angles q (2,)."""
    return np.array([L1 * np.cos(q[0]) + L2 * np.cos(q[0] + q[1]), L1 * np.sin(q[0]) + L2 * np.sin(q[0] + q[1])])


def expert_chunk(tip_now: np.ndarray, target_xy: np.ndarray, horizon: int, max_step: float = 0.03) -> np.ndarray:
    """(horizon, 2) fingertip waypoints: along the straight line from tip_now to the target, at most max_step
    metres per step, then holding the target."""
    delta = np.asarray(target_xy, dtype=np.float64) - tip_now
    dist = float(np.linalg.norm(delta))
    k = np.arange(1, horizon + 1)[:, None] * max_step  # (H, 1)
    if dist < 1e-12:
        return np.tile(tip_now, (horizon, 1))
    return tip_now + delta / dist * np.minimum(dist, k)


REACH = L1 + L2


@dataclass
class ReacherConfig:
    image_size: int = IMAGE_SIZE
    episode_steps: int = EPISODE_STEPS
    min_target_gap: float = 0.06

    def __post_init__(self):
        if self.image_size < 16 or self.episode_steps < 1:
            raise ValueError(f"image_size must be >= 16 and episode_steps >= 1, got {self.image_size}, "
                             f"{self.episode_steps}")


class ThreeTargetReacher:
    """The task. reset(seed) -> obs; step(action) -> obs, reward, done, info. Reward: minus the
    fingertip's distance to the named target (Reacher-v5's distance term)."""

    def __init__(self, cfg: ReacherConfig | None = None):
        import tempfile
        self.cfg = cfg or ReacherConfig()
        with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
            f.write(reacher_xml())
            path = f.name
        try:
            self._env = _Env(path, self.cfg.image_size)
        finally:
            os.unlink(path)
        self.model, self.data = self._env.model, self._env.data
        self.rng = np.random.default_rng(0)
        self.targets: dict[str, np.ndarray] = {}
        self.color, self.instruction, self.t = "red", "", 0

    # -- episode ------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None, color: str | None = None, template: int | None = None) -> dict:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        r = self.rng
        pts: list[np.ndarray] = []
        while len(pts) < 3:
            rad, ang = r.uniform(0.07, 0.19), r.uniform(-np.pi, np.pi)
            p = np.array([rad * np.cos(ang), rad * np.sin(ang)])
            if all(np.linalg.norm(p - o) >= self.cfg.min_target_gap for o in pts):
                pts.append(p)
        self.targets = dict(zip(COLORS, pts))
        self.color = color if color is not None else str(r.choice(list(COLORS)))
        if self.color not in COLORS:
            raise ValueError(f"color must be one of {list(COLORS)}, got {self.color!r}")
        self.instruction = instruction_for(self.color, int(r.integers(len(TEMPLATES))) if template is None
                                           else template)
        qpos = np.zeros(self.model.nq)
        qpos[0], qpos[1] = r.uniform(-np.pi, np.pi), r.uniform(-2.0, 2.0)
        qpos[2:] = np.concatenate(pts)
        self._env.set_state(qpos, np.zeros(self.model.nv))
        self.data.ctrl[:] = qpos[:2]
        self.t = 0
        return self.observe()

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, dict]:
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (2,) or not np.isfinite(a).all():
            raise ValueError(f"action must be a finite fingertip target (x, y) in metres, got {a!r}")
        q = ik(a, self.data.qpos[:2])
        self._env.do_simulation(q, self._env.frame_skip)
        self.t += 1
        dist = self.distance()
        info = {"distance": dist, "success": dist <= SUCCESS_RADIUS}
        return self.observe(), -dist, self.t >= self.cfg.episode_steps, info

    def observe(self) -> dict:
        return {"image": self.render(), "state": self.state(), "instruction": self.instruction}

    # -- queries ------------------------------------------------------------------------------------
    def state(self) -> np.ndarray:
        """(6,) joint angles, joint velocities, fingertip (x, y)."""
        return np.concatenate([self.data.qpos[:2], self.data.qvel[:2], self.fingertip()]).astype(np.float64)

    def fingertip(self) -> np.ndarray:
        return self._env.get_body_com("fingertip")[:2].copy()

    def distance(self) -> float:
        return float(np.linalg.norm(self.fingertip() - self.targets[self.color]))

    def render(self) -> np.ndarray:
        return np.ascontiguousarray(self._env.render())  # (S, S, 3) uint8

    def expert(self, horizon: int) -> np.ndarray:
        return expert_chunk(self.fingertip(), self.targets[self.color], horizon)

    def close(self) -> None:
        self._env.close()


def _Env(path: str, size: int):
    from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
    from gymnasium.spaces import Box

    class _Reacher(MujocoEnv):
        metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1 / CONTROL_DT))}

        def __init__(self):
            MujocoEnv.__init__(self, path, frame_skip=int(round(CONTROL_DT / 0.01)),
                               observation_space=Box(-np.inf, np.inf, (4,), np.float64),
                               render_mode="rgb_array", width=size, height=size,
                               default_camera_config={"distance": 0.75, "elevation": -90.0, "azimuth": 90.0,
                                                      "lookat": np.array([0.0, 0.0, 0.0])})

        def reset_model(self):
            return np.zeros(4)

    return _Reacher()


from .robot import Robot  # noqa: E402


class ReacherRobot(Robot):
    """The three-target reacher as a Robot for the control loop. Actions are fingertip position targets
    (x, y) in metres. Physics advances one control period (0.05 s) per send_action, in lockstep with a 20 Hz
    loop; safe_stop() commands the current joint angles. Safety clipping: the target is pulled inside the
    reachable disc (radius L1 + L2) and at most `max_step` metres from the current fingertip."""

    def __init__(self, seed: int = 0, color: str | None = None, max_step: float = 0.06,
                 cfg: ReacherConfig | None = None):
        if max_step <= 0:
            raise ValueError(f"max_step must be > 0, got {max_step}")
        self.seed, self.color, self.max_step, self.cfg = seed, color, max_step, cfg or ReacherConfig()
        s = self.cfg.image_size
        self.observation_features = {"image": (s, s, 3), "state": (6,)}
        self.action_features = {"fingertip": (2,)}
        self.env: ThreeTargetReacher | None = None
        self.steps = self.stops = 0
        self.distances: list[float] = []

    def connect(self) -> None:
        if self.env is None:
            self.env = ThreeTargetReacher(self.cfg)
        self.env.reset(seed=self.seed, color=self.color)

    def _need(self) -> ThreeTargetReacher:
        if self.env is None:
            raise RuntimeError("ReacherRobot is not connected: use it as a context manager or call connect()")
        return self.env

    @property
    def instruction(self) -> str:
        return self._need().instruction

    def get_observation(self) -> dict:
        return self._need().observe()

    def hold_position(self, obs: dict) -> np.ndarray:
        """The action that holds the robot where it stands: its fingertip position."""
        return np.asarray(obs["state"], dtype=np.float64)[4:6].copy()

    def send_action(self, action: np.ndarray) -> np.ndarray:
        env = self._need()
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (2,):
            raise ValueError(f"action must be a fingertip target (x, y) in metres, got shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"action contains NaN or inf: {a.tolist()}")
        r = float(np.linalg.norm(a))
        if r > REACH:
            a = a * (REACH / r)
        tip = env.fingertip()
        step = a - tip
        n = float(np.linalg.norm(step))
        if n > self.max_step:
            a = tip + step * (self.max_step / n)
        env.step(a)
        self.steps += 1
        self.distances.append(env.distance())
        return a

    def safe_stop(self) -> None:
        env = self._need()
        env.data.ctrl[:] = env.data.qpos[:2]
        self.stops += 1

    def disconnect(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

"""`edgespec robot node` end to end, as a separate process: the REAL bundled policy (engines/vla-reacher)
behind the node, driven from a DDS participant in this process that uses its own message definitions (below,
written from the ROS 2 .msg files, not imported from robots.ros_msgs); SIGINT / SIGTERM make a safe stop.

The node is started as `edgespec robot node` through edgespec.cli.main (there is no `python -m edgespec`)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from cyclonedds.domain import DomainParticipant
from cyclonedds.idl import IdlStruct
from cyclonedds.idl import annotations as annotate
from cyclonedds.idl import types as t
from cyclonedds.pub import DataWriter
from cyclonedds.sub import DataReader
from cyclonedds.topic import Topic
from cyclonedds.core import Policy as QosPolicy, Qos
from cyclonedds.util import duration

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "reach the red target"
CLI = "import sys; from edgespec.cli import main; sys.exit(main(sys.argv[1:]))"


# ---------------------------------------------------------------- the robot side's own ROS 2 types

@dataclass
@annotate.final
class Time(IdlStruct, typename="builtin_interfaces::msg::dds_::Time_"):
    sec: t.int32 = 0
    nanosec: t.uint32 = 0


@dataclass
@annotate.final
class Duration(IdlStruct, typename="builtin_interfaces::msg::dds_::Duration_"):
    sec: t.int32 = 0
    nanosec: t.uint32 = 0


@dataclass
@annotate.final
class Header(IdlStruct, typename="std_msgs::msg::dds_::Header_"):
    stamp: Time = field(default_factory=Time)
    frame_id: str = ""


@dataclass
@annotate.final
class String(IdlStruct, typename="std_msgs::msg::dds_::String_"):
    data: str = ""


@dataclass
@annotate.final
class JointState(IdlStruct, typename="sensor_msgs::msg::dds_::JointState_"):
    header: Header = field(default_factory=Header)
    name: t.sequence[str] = field(default_factory=list)
    position: t.sequence[t.float64] = field(default_factory=list)
    velocity: t.sequence[t.float64] = field(default_factory=list)
    effort: t.sequence[t.float64] = field(default_factory=list)


@dataclass
@annotate.final
class Image(IdlStruct, typename="sensor_msgs::msg::dds_::Image_"):
    header: Header = field(default_factory=Header)
    height: t.uint32 = 0
    width: t.uint32 = 0
    encoding: str = ""
    is_bigendian: t.uint8 = 0
    step: t.uint32 = 0
    data: t.sequence[t.uint8] = field(default_factory=list)


@dataclass
@annotate.final
class JointTrajectoryPoint(IdlStruct, typename="trajectory_msgs::msg::dds_::JointTrajectoryPoint_"):
    positions: t.sequence[t.float64] = field(default_factory=list)
    velocities: t.sequence[t.float64] = field(default_factory=list)
    accelerations: t.sequence[t.float64] = field(default_factory=list)
    effort: t.sequence[t.float64] = field(default_factory=list)
    time_from_start: Duration = field(default_factory=Duration)


@dataclass
@annotate.final
class JointTrajectory(IdlStruct, typename="trajectory_msgs::msg::dds_::JointTrajectory_"):
    header: Header = field(default_factory=Header)
    joint_names: t.sequence[str] = field(default_factory=list)
    points: t.sequence[JointTrajectoryPoint] = field(default_factory=list)


QOS = Qos(QosPolicy.Reliability.Reliable(duration(milliseconds=100)), QosPolicy.Durability.Volatile,
          QosPolicy.History.KeepLast(10))  # ROS 2's default


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module", autouse=True)
def loopback():
    from edgespec.robots.node import use_loopback
    old = use_loopback()  # this process and the node's (it inherits the environment; --loopback too)
    yield
    if old is None:
        os.environ.pop("CYCLONEDDS_URI", None)
    else:
        os.environ["CYCLONEDDS_URI"] = old


def free_domain() -> int:
    return int.from_bytes(os.urandom(2), "little") % 60 + 171  # 171..230: apart from test_ros2_node's 100..170


def start(argv: list[str], timeout: float = 60.0) -> subprocess.Popen:
    """A process running `argv` (python args), returned once its stderr says the node is serving (killed and
    an AssertionError after `timeout` s). Its stderr is drained by a thread into proc.err_lines."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ), cwd=ROOT)
    proc.err_lines, serving = [], threading.Event()

    def drain():
        for line in proc.stderr:
            proc.err_lines.append(line)
            if "serving on domain" in line:
                serving.set()
    threading.Thread(target=drain, daemon=True).start()
    end = time.monotonic() + timeout
    while not serving.wait(0.05) and proc.poll() is None and time.monotonic() < end:
        pass
    if not serving.is_set():
        proc.kill()
        proc.wait()
        raise AssertionError(f"the node never served (rc {proc.returncode}):\n{''.join(proc.err_lines)}")
    return proc


def finish(proc: subprocess.Popen, sig=None, timeout=20.0) -> tuple[int, dict, str]:
    """Send `sig` (if any), wait for the exit -> (exit code, the JSON summary on stdout, stderr)."""
    if sig is not None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)  # stdout holds only the summary: it fits the pipe
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the node did not exit within {timeout} s:\n{''.join(proc.err_lines)}") from None
    out = proc.stdout.read()
    time.sleep(0.1)  # the drain thread reads the rest of stderr
    at = out.find("{")
    return proc.returncode, (json.loads(out[at:]) if at >= 0 else {}), "".join(proc.err_lines)


# ---------------------------------------------------------------- the real policy through the node

def test_real_policy_through_the_node_in_another_process_then_sigterm_safe_stop(bundled_policy_dir):
    from edgespec.policy import load_policy
    from edgespec.robots.reacher import ThreeTargetReacher, fk, ik

    # one observation of the reacher: after a step, so the joints move (non-zero velocities)
    env = ThreeTargetReacher()
    try:
        env.reset(seed=3, color="red", template=0)
        obs, *_ = env.step(env.fingertip() + [0.02, 0.0])
    finally:
        env.close()
    q, qd, image = obs["state"][:2], obs["state"][2:4], obs["image"]
    # what the node must build from joint0 / joint1 alone: the fingertip by forward kinematics, which is the
    # simulator's fingertip (MuJoCo's body position is from the start of the last physics substep: ~1e-5 m off)
    state = np.concatenate([q, qd, fk(q)])
    np.testing.assert_allclose(state, obs["state"], atol=1e-4)
    policy = load_policy(bundled_policy_dir)
    actions = policy.act(image, state, INSTRUCTION)  # (H, 2) fingertip targets, metres
    expected, prev = [], q
    for xy in actions:  # IK chained through the chunk
        prev = ik(xy, prev)
        expected.append(prev)
    expected = np.array(expected)

    domain = free_domain()
    proc = start(["-c", CLI, "robot", "node", "--policy", str(bundled_policy_dir), "--inference", "thread", "--loopback",
                  "--domain", str(domain), "--hz", "20"])
    try:
        dp = DomainParticipant(domain)
        js = DataWriter(dp, Topic(dp, "rt/joint_states", JointState), QOS)
        img = DataWriter(dp, Topic(dp, "rt/image", Image), QOS)
        instr = DataWriter(dp, Topic(dp, "rt/instruction", String), QOS)
        reader = DataReader(dp, Topic(dp, "rt/action_chunk", JointTrajectory), QOS)
        # a different joint order than the policy's, plus a joint the policy knows nothing of
        joints = JointState(name=["gripper", "joint1", "joint0"], position=[0.7, float(q[1]), float(q[0])],
                            velocity=[-3.0, float(qd[1]), float(qd[0])])
        frame = Image(height=64, width=64, encoding="rgb8", step=64 * 3, data=image.tobytes())
        chunks, end = [], time.monotonic() + 40
        while not chunks and time.monotonic() < end:
            instr.write(String(INSTRUCTION))
            img.write(frame)
            js.write(joints)
            chunks = [m for m in reader.take(N=10) if m.points]
            time.sleep(0.05)
        assert chunks, "no chunk from the node within 40 s"
        msg = chunks[-1]
        got = np.array([p.positions for p in msg.points])
        assert list(msg.joint_names) == ["joint0", "joint1"]
        assert got.shape == (policy.horizon, 2) and np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)  # joint targets = IK of the policy's actions
        t_from_start = [p.time_from_start.sec + 1e-9 * p.time_from_start.nanosec for p in msg.points]
        np.testing.assert_allclose(t_from_start, 0.05 * np.arange(1, policy.horizon + 1), atol=1e-9)

        rc, status, err = finish(proc, signal.SIGTERM)
        assert rc == 0, err
        assert status["exit"]["signal"] == "SIGTERM" and status["exit"]["safe_stop"], status
        assert status["safety"] == "stopped: safe stop on SIGTERM" and status["stops_published"] == 1, status
        assert status["chunks_published"] >= 1 and status["embodiment"].startswith("three-target-reacher")
        stops, end = [], time.monotonic() + 5
        while not stops and time.monotonic() < end:
            stops = [m for m in reader.take(N=10) if not m.points]
            time.sleep(0.02)
        assert [list(m.joint_names) for m in stops] == [["joint0", "joint1"]]  # hold position
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- signals with a fake policy

FAKE_NODE = r"""
import sys
import numpy as np
from edgespec.robots import node as nd

if sys.argv[1] == "failing-stop":
    def boom(self, reason):
        raise RuntimeError("DDS writer gone")
    nd.PolicyNode.safe_stop = boom
sys.exit(nd.main(sys.argv[2:], lambda obs: np.zeros((2, 2))))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_makes_one_safe_stop_and_exits_0_with_a_summary(sig):
    proc = start(["-c", FAKE_NODE, "ok", "--loopback", "--domain", str(free_domain()), "--hz", "50"])
    proc.send_signal(sig)
    rc, status, err = finish(proc, sig)  # a second signal during the stop is recorded, not a second stop
    name = signal.Signals(sig).name
    assert rc == 0, err
    assert status["safety"] == f"stopped: safe stop on {name}" and status["stops_published"] == 1, status
    assert status["exit"]["signal"] == name and status["exit"]["signals"][0] == name and status["ticks"] >= 1


def test_a_safe_stop_that_raises_exits_nonzero_and_says_so():
    proc = start(["-c", FAKE_NODE, "failing-stop", "--loopback", "--domain", str(free_domain())])
    rc, status, err = finish(proc, signal.SIGTERM)
    assert rc == 1
    assert "SAFE STOP FAILED: RuntimeError: DDS writer gone" in err
    assert status["exit"] == {"signal": "SIGTERM", "signals": ["SIGTERM"], "safe_stop": True, "rc": 1}
    assert status["last_fault"] == "safe stop failed: RuntimeError: DDS writer gone"

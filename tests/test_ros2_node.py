"""The ROS 2-compatible node over plain DDS: golden CDR bytes of the message types written by hand from the
CDR rules, a PolicyNode talking to a robot-side peer over real DDS on loopback (in this process and from
another process), and fault injection (malformed messages, a publisher that disappears, a policy that raises
or returns NaN). Waits poll with generous deadlines instead of fixed sleeps (2 busy cores in CI)."""
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

# cyclonedds is a declared dependency (the robots extra): a missing one must fail here, not skip.
from cyclonedds.domain import Domain, DomainParticipant
from cyclonedds.pub import DataWriter
from cyclonedds.sub import DataReader
from cyclonedds.topic import Topic

from edgespec.robots import ros_msgs as rm
from edgespec.robots.node import NodeConfig, PolicyNode, loopback_config, main, use_loopback

NAMES = ["j1", "j2"]
POSITION, VELOCITY = [0.1, -0.2], [0.0, 0.5]
INSTRUCTION = "reach the red target"
RED = 200  # red channel of pixel (0, 0) of the test image


# ---------------------------------------------------------------- (a) golden CDR bytes
# Layout rules (XCDR1 = plain CDR, little-endian): a 4-byte encapsulation header 00 01 00 00 (CDR_LE, options
# 0), then the fields in declaration order; each primitive is aligned to its size *relative to the first
# byte after the header* (offsets below are relative to that byte); a string is u32 length (bytes + NUL),
# the bytes, NUL; a sequence is u32 count then its elements (float64 elements align to 8, but an empty
# sequence writes only its count); nested structs add no padding of their own.

GOLDEN = {
    # header stamp (1 s, 2 ns), frame_id "base", 2 joints, position [1.0, -0.5], velocity [0.25, 0.0], effort []
    "joint_state": (
        rm.JointState(rm.Header(rm.Time(1, 2), "base"), ["j1", "j2"], [1.0, -0.5], [0.25, 0.0], []),
        "00010000"          # encapsulation: CDR_LE, options 0
        "01000000"          # @0  stamp.sec = 1 (int32)
        "02000000"          # @4  stamp.nanosec = 2 (uint32)
        "05000000"          # @8  frame_id length 5 ("base" + NUL)
        "6261736500"        # @12 "base\0"
        "000000"            # @17 pad to 20 (next is a u32)
        "02000000"          # @20 name: 2 strings
        "03000000" "6a3100" "00"  # @24 "j1\0" (len 3), pad to 32
        "03000000" "6a3200" "00"  # @32 "j2\0" (len 3), pad to 40
        "02000000"          # @40 position: 2 doubles
        "00000000"          # @44 pad to 48 (float64 aligns to 8)
        "000000000000f03f"  # @48 1.0
        "000000000000e0bf"  # @56 -0.5
        "02000000"          # @64 velocity: 2 doubles
        "00000000"          # @68 pad to 72
        "000000000000d03f"  # @72 0.25
        "0000000000000000"  # @80 0.0
        "00000000"),        # @88 effort: 0 doubles (no padding for an empty sequence)
    "string": (
        rm.String(INSTRUCTION),
        "00010000"
        "15000000"          # @0 length 21 = 20 chars + NUL
        + INSTRUCTION.encode().hex() + "00"),
    # 2 wide x 1 high rgb8: a red then a green pixel; stamp (3, 0), frame_id "cam"
    "image": (
        rm.numpy_to_image(np.array([[[255, 0, 0], [0, 255, 0]]], np.uint8), stamp=rm.Time(3, 0), frame_id="cam"),
        "00010000"
        "03000000" "00000000"  # @0 stamp 3 s, 0 ns
        "04000000" "63616d00"  # @8 frame_id "cam\0"
        "01000000"          # @16 height 1
        "02000000"          # @20 width 2
        "05000000" "7267623800"  # @24 encoding "rgb8\0"
        "00"                # @33 is_bigendian 0 (uint8, no alignment)
        "0000"              # @34 pad to 36
        "06000000"          # @36 step 6 = 2 px * 3 bytes
        "06000000"          # @40 data: 6 bytes
        "ff0000" "00ff00"),  # @44 R, G
    # chunk [[0.5, 1.5], [0.75, 1.75]] at dt 0.05 s: points at 0.05 s and 0.10 s; stamp (0, 0), frame_id ""
    "joint_trajectory": (
        rm.chunk_to_trajectory(np.array([[0.5, 1.5], [0.75, 1.75]]), ["j1", "j2"], 0.05, stamp=rm.Time(0, 0)),
        "00010000"
        "00000000" "00000000"  # @0 stamp
        "01000000" "00" "000000"  # @8 frame_id "" = length 1, NUL; pad to 16
        "02000000"          # @16 joint_names: 2
        "03000000" "6a3100" "00"  # @20 "j1\0", pad to 28
        "03000000" "6a3200" "00"  # @28 "j2\0", pad to 36
        "02000000"          # @36 points: 2
        "02000000"          # @40 point 0 positions: 2 doubles
        "00000000"          # @44 pad to 48
        "000000000000e03f" "000000000000f83f"  # @48 0.5, 1.5
        "00000000" "00000000" "00000000"  # @64 velocities, accelerations, effort: empty
        "00000000" "80f0fa02"  # @76 time_from_start 0 s, 50_000_000 ns
        "02000000"          # @84 point 1 positions: 2 doubles (88 is already 8-aligned)
        "000000000000e83f" "000000000000fc3f"  # @88 0.75, 1.75
        "00000000" "00000000" "00000000"  # @104 empty sequences
        "00000000" "00e1f505"),  # @116 0 s, 100_000_000 ns
    # one status: level ERROR (2), name "node", message "ok", hardware_id "", values [k: v]; stamp (5, 6)
    "diagnostic_array": (
        rm.DiagnosticArray(rm.Header(rm.Time(5, 6), ""),
                           [rm.DiagnosticStatus(2, "node", "ok", "", [rm.KeyValue("k", "v")])]),
        "00010000"
        "05000000" "06000000"  # @0 stamp
        "01000000" "00" "000000"  # @8 frame_id "", pad to 16
        "01000000"          # @16 status: 1
        "02" "000000"       # @20 level = 2 (octet), pad to 24
        "05000000" "6e6f646500" "000000"  # @24 name "node\0", pad to 36
        "03000000" "6f6b00" "00"  # @36 message "ok\0", pad to 44
        "01000000" "00" "000000"  # @44 hardware_id "", pad to 52
        "01000000"          # @52 values: 1
        "02000000" "6b00" "0000"  # @56 key "k\0", pad to 64
        "02000000" "7600"),  # @64 value "v\0"
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_cdr_bytes_and_round_trip(name):
    msg, expected = GOLDEN[name]
    data = msg.serialize()
    assert data.hex() == expected
    back = type(msg).deserialize(data)
    assert back.serialize() == data
    if name == "image":  # data goes in as bytes, comes back as a list of ints
        assert bytes(back.data) == bytes(msg.data) and rm.image_to_numpy(back)[0, 1].tolist() == [0, 255, 0]
    else:
        assert back == msg


def test_types_carry_ros2_names_and_serialize_as_plain_cdr():
    expected = {rm.Time: "builtin_interfaces::msg::dds_::Time_",
                rm.Duration: "builtin_interfaces::msg::dds_::Duration_",
                rm.Header: "std_msgs::msg::dds_::Header_", rm.String: "std_msgs::msg::dds_::String_",
                rm.JointState: "sensor_msgs::msg::dds_::JointState_", rm.Image: "sensor_msgs::msg::dds_::Image_",
                rm.JointTrajectory: "trajectory_msgs::msg::dds_::JointTrajectory_",
                rm.JointTrajectoryPoint: "trajectory_msgs::msg::dds_::JointTrajectoryPoint_",
                rm.DiagnosticArray: "diagnostic_msgs::msg::dds_::DiagnosticArray_",
                rm.DiagnosticStatus: "diagnostic_msgs::msg::dds_::DiagnosticStatus_",
                rm.KeyValue: "diagnostic_msgs::msg::dds_::KeyValue_"}
    for typ, name in expected.items():
        assert typ.__idl_typename__ == name
        assert typ().serialize()[:4] == bytes.fromhex("00010000"), f"{name} is not plain CDR (XCDR1) LE"


def test_helpers_naming_domain_and_conversions():
    assert rm.ros_topic("joint_states") == rm.ros_topic("/joint_states") == "rt/joint_states"
    with pytest.raises(ValueError, match="topic name"):
        rm.ros_topic(" ")
    assert rm.ros_domain_id({}) == 0 and rm.ros_domain_id({"ROS_DOMAIN_ID": " 42 "}) == 42
    with pytest.raises(ValueError, match="integer in 0..232, got 'abc'"):
        rm.ros_domain_id({"ROS_DOMAIN_ID": "abc"})
    with pytest.raises(ValueError, match="0..232, got 233"):
        rm.ros_domain_id({"ROS_DOMAIN_ID": "233"})

    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    for enc in ("rgb8", "bgr8"):
        np.testing.assert_array_equal(rm.image_to_numpy(rm.numpy_to_image(img, enc)), img)
    padded = rm.numpy_to_image(img)
    rows = np.frombuffer(padded.data, np.uint8).reshape(2, 9)
    padded.step, padded.data = 10, b"".join(bytes(r) + b"\xee" for r in rows)  # one pad byte per row
    np.testing.assert_array_equal(rm.image_to_numpy(padded), img)  # row padding is legal ROS
    bad = {"encoding": ("mono8", "expected one of rgb8, bgr8, got 'mono8'"),
           "data": (b"\x00" * 17, "expected step \\* height = 18 bytes, got 17"),
           "step": (8, "expected >= width \\* 3 = 9 bytes per row for rgb8, got 8")}
    for fld, (value, err) in bad.items():
        msg = rm.numpy_to_image(img)
        setattr(msg, fld, value)
        with pytest.raises(ValueError, match=err):
            rm.image_to_numpy(msg)

    names, pos, vel = rm.joint_state_to_numpy(rm.joint_state_msg(["b", "a"], [2.0, 1.0]), expected=["a", "b"])
    assert names == ["a", "b"] and pos.tolist() == [1.0, 2.0] and vel.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 joint names but 3 positions"):
        rm.joint_state_to_numpy(rm.joint_state_msg(["a", "b"], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="not finite as float32: position of a = nan"):
        rm.joint_state_to_numpy(rm.joint_state_msg(["a"], [np.nan]))
    with pytest.raises(ValueError, match="not finite as float32: velocity of b = 1e"):  # inf in the engine
        rm.joint_state_to_numpy(rm.joint_state_msg(["a", "b"], [0.0, 0.0], [0.0, 1e39]))
    names, pos, _ = rm.joint_state_to_numpy(rm.joint_state_msg(["a", "gripper"], [1.0, np.nan]), expected=["a"])
    assert names == ["a"] and pos.tolist() == [1.0]  # a joint the policy does not read may hold anything

    traj = rm.chunk_to_trajectory(np.ones((3, 2)), NAMES, 0.1)
    names, chunk, t = rm.trajectory_to_numpy(traj)
    assert names == NAMES and chunk.shape == (3, 2) and np.allclose(t, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="NaN"):
        rm.chunk_to_trajectory(np.full((2, 2), np.nan), NAMES, 0.1)
    diag = rm.diagnostics_msg({"latency_ms": 12.3456789, "faults": 2}, name="n", level=rm.WARN)
    assert diag.status[0].level == rm.WARN and rm.diagnostics_values(diag) == {"latency_ms": "12.3457", "faults": "2"}


def test_node_config_is_validated():
    for bad, err in [({"hz": 0}, "hz must be"), ({"domain_id": 233}, "domain id"), ({"dt": -1}, "dt must"),
                     ({"stale_obs_s": 0}, "stale_obs_s"), ({"diag_hz": 0}, "diag_hz"), ({"image_topic": ""}, "topic"),
                     ({"joint_names": ("a", "a")}, "distinct")]:
        with pytest.raises(ValueError, match=err):
            NodeConfig(**bad)
    assert NodeConfig(hz=1).step_s == 1.0 and NodeConfig(hz=50).step_s == 0.02 and NodeConfig(hz=50, dt=0.1).step_s == 0.1


# ---------------------------------------------------------------- (b) real DDS on loopback

@pytest.fixture(scope="module", autouse=True)
def loopback():
    """Unicast discovery on 127.0.0.1 for every domain this module (and its subprocesses) creates."""
    old = use_loopback()
    yield
    if old is None:
        os.environ.pop("CYCLONEDDS_URI", None)
    else:
        os.environ["CYCLONEDDS_URI"] = old


_domains = itertools.count(random.randint(100, 170))


@pytest.fixture
def domain():
    """A fresh domain id per test (random base in 100..170), so tests and parallel runs do not hear each other."""
    return next(_domains)


class FakePolicy:
    """Deterministic: step k targets positions + 0.01 (k + 1) + red(0, 0) / 1000 + len(instruction) / 1e4.
    `mode` switches it to raising or returning NaN."""

    def __init__(self, horizon=4):
        self.horizon, self.mode, self.calls, self.seen = horizon, "ok", 0, None
        self.last_info = {"acceptance": 0.75, "accepted_per_round": 2.5}

    def __call__(self, obs):
        self.calls += 1
        self.seen = obs
        if self.mode == "raise":
            raise RuntimeError("engine exploded")
        d = len(obs["state"]) // 2
        chunk = expected_chunk(obs["state"][:d], int(obs["image"][0, 0, 0]), obs["instruction"], self.horizon)
        return np.full_like(chunk, np.nan) if self.mode == "nan" else chunk


def expected_chunk(position, red, instruction, horizon):
    steps = 0.01 * np.arange(1, horizon + 1)[:, None]
    return np.asarray(position, dtype=np.float64)[None, :] + steps + red / 1000 + len(instruction) / 1e4


def make_image():
    img = np.zeros((4, 6, 3), np.uint8)
    img[0, 0] = (RED, 10, 20)
    return img


class Peer:
    """The robot side in this process: publishes observations, records chunks and diagnostics."""

    def __init__(self, domain):
        self.dp = DomainParticipant(domain)
        q = rm.ros_qos()
        self.w = {name: DataWriter(self.dp, Topic(self.dp, rm.ros_topic(name), typ), q) for name, typ in
                  [("joint_states", rm.JointState), ("image", rm.Image), ("instruction", rm.String)]}
        self.r = {name: DataReader(self.dp, Topic(self.dp, rm.ros_topic(name), typ), q) for name, typ in
                  [("action_chunk", rm.JointTrajectory), ("diagnostics", rm.DiagnosticArray)]}
        self.chunks, self.stops, self.diags = [], [], []  # stops: trajectories without points

    def publish(self, position=POSITION, velocity=VELOCITY, encoding="bgr8"):
        self.w["instruction"].write(rm.String(INSTRUCTION))  # volatile: repeat it so a late reader gets it
        self.w["image"].write(rm.numpy_to_image(make_image(), encoding))
        self.w["joint_states"].write(rm.joint_state_msg(NAMES, position, velocity))

    def reset(self, why: str):
        """Clear the node's latched stop through its reset topic (the writer is made on first use)."""
        if "reset" not in self.w:
            self.w["reset"] = DataWriter(self.dp, Topic(self.dp, "rt/edgespec_policy_node/reset", rm.String),
                                         rm.ros_qos())
            end = time.monotonic() + 10
            while not self.w["reset"].get_matched_subscriptions() and time.monotonic() < end:
                time.sleep(0.02)  # volatile: a message written before the node's reader matched is lost
        self.w["reset"].write(rm.String(why))

    def poll(self):
        for msg in self.r["action_chunk"].take(N=100):
            (self.chunks if msg.points else self.stops).append(msg)
        self.diags += [rm.diagnostics_values(d) | {"_level": d.status[0].level, "_message": d.status[0].message}
                       for d in self.r["diagnostics"].take(N=100)]

    def wait_for(self, cond, publish=True, timeout=15.0):
        """Publish (optionally) and poll every 20 ms until cond() holds; False after `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if publish:
                self.publish()
            self.poll()
            if cond():
                return True
            time.sleep(0.02)
        return False


@pytest.fixture
def make_node(domain):
    nodes = []

    def make(policy, **cfg):
        node = PolicyNode(policy, NodeConfig(**{"domain_id": domain, "hz": 50, **cfg}))
        nodes.append(node)
        node.start()
        return node
    yield make
    for node in nodes:
        node.close()


def test_loopback_config_is_accepted_by_cyclonedds(domain):
    assert Domain(domain, loopback_config())  # raises on a config this cyclonedds does not accept


def test_node_publishes_chunks_for_fresh_observations(make_node, domain):
    policy = FakePolicy()
    node = make_node(policy, dt=0.1)
    peer = Peer(domain)
    assert peer.wait_for(lambda: len(peer.chunks) >= 3 and any("acceptance" in d for d in peer.diags)), node.status()
    obs = policy.seen
    assert obs["image"].shape == (4, 6, 3) and obs["image"].dtype == np.uint8 and obs["image"][0, 0, 0] == RED
    assert obs["state"].tolist() == POSITION + VELOCITY and obs["instruction"] == INSTRUCTION
    names, chunk, t = rm.trajectory_to_numpy(peer.chunks[-1])
    assert names == NAMES and np.allclose(t, [0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(chunk, expected_chunk(POSITION, RED, INSTRUCTION, 4), rtol=0, atol=1e-12)
    ok = [d for d in peer.diags if "acceptance" in d][-1]  # policy.last_info, forwarded
    assert ok["_level"] == rm.OK and ok["safety"] == "ok"
    assert ok["acceptance"] == "0.75" and ok["accepted_per_round"] == "2.5"
    assert float(ok["inference_ms"]) >= 0 and int(ok["chunks_published"]) >= 1
    st = node.status()
    assert st["rejected_messages"] == st["policy_faults"] == 0 and st["chunks_published"] >= 3
    assert st["inferences"] <= st["ticks"]  # at most one chunk per tick


PEER_SCRIPT = r"""
import json, sys, time
import numpy as np
from cyclonedds.domain import DomainParticipant
from cyclonedds.pub import DataWriter
from cyclonedds.sub import DataReader
from cyclonedds.topic import Topic
from edgespec.robots import ros_msgs as rm

domain, want, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
dp, q = DomainParticipant(domain), rm.ros_qos()
def writer(name, typ):
    return DataWriter(dp, Topic(dp, rm.ros_topic(name), typ), q)
js, image = writer("joint_states", rm.JointState), writer("image", rm.Image)
instruction = writer("instruction", rm.String)
reader = DataReader(dp, Topic(dp, "rt/action_chunk", rm.JointTrajectory), q)
img = np.zeros((4, 6, 3), np.uint8)
img[0, 0] = (200, 10, 20)
got, end = [], time.monotonic() + timeout
while len(got) < want and time.monotonic() < end:
    instruction.write(rm.String("reach the red target"))
    image.write(rm.numpy_to_image(img, "rgb8"))
    js.write(rm.joint_state_msg(["j1", "j2"], [0.1, -0.2], [0.0, 0.5]))
    got += reader.take(N=10)
    time.sleep(0.02)
print(json.dumps([[names, pos.tolist(), t.tolist()] for names, pos, t in map(rm.trajectory_to_numpy, got)]))
"""


def test_node_talks_to_a_peer_in_another_process_and_stops_when_it_exits(make_node, domain):
    node = make_node(FakePolicy(), stale_obs_s=0.3, hold_s=0.2)
    out = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(domain), "2", "20"], capture_output=True,
                         text=True, timeout=40, env=dict(os.environ))  # carries CYCLONEDDS_URI (loopback)
    assert out.returncode == 0, out.stderr
    chunks = json.loads(out.stdout)
    assert len(chunks) >= 2, (out.stderr, node.status())
    names, positions, t = chunks[-1]
    assert names == NAMES and np.allclose(t, [0.02, 0.04, 0.06, 0.08])
    np.testing.assert_allclose(positions, expected_chunk(POSITION, RED, INSTRUCTION, 4), rtol=0, atol=1e-12)
    # the publisher process is gone: hold, then a latched stop
    end = time.monotonic() + 10
    while time.monotonic() < end and not node.status()["safety"].startswith("stopped"):
        time.sleep(0.02)
    assert node.status()["safety"].startswith("stopped: stale observation"), node.status()


# ---------------------------------------------------------------- (c) faults

def test_malformed_messages_are_rejected_counted_and_reported(make_node, domain):
    node = make_node(FakePolicy())
    peer = Peer(domain)
    assert peer.wait_for(lambda: len(peer.chunks) >= 1), node.status()
    wrong_encoding = rm.numpy_to_image(make_image())
    wrong_encoding.encoding = "mono8"
    short = rm.numpy_to_image(make_image())
    short.data = short.data[:-3]
    peer.w["image"].write(wrong_encoding)
    peer.w["image"].write(short)
    peer.w["joint_states"].write(rm.joint_state_msg(NAMES, [np.nan, 0.0]))
    peer.w["joint_states"].write(rm.joint_state_msg(NAMES, [0.1, 0.2], [0.0, 1e39]))  # inf as float32
    peer.w["joint_states"].write(rm.joint_state_msg(NAMES, [0.1, 0.2, 0.3]))
    peer.w["joint_states"].write(rm.joint_state_msg(["j1", "other"], POSITION))  # not the joints it started with
    peer.w["joint_states"].write(rm.joint_state_msg(NAMES, POSITION))  # no velocities: the state needs them
    assert peer.wait_for(lambda: node.status()["rejected_messages"] >= 7, publish=False), node.status()
    faults = "\n".join(node.status()["faults"])
    for text in ("expected one of rgb8, bgr8, got 'mono8'", "expected step * height = 72 bytes, got 69",
                 "not finite as float32: position of j1 = nan", "not finite as float32: velocity of j2 = 1e+39",
                 "2 joint names but 3 positions", "missing joints ['j2']",
                 "no velocities in the message (the policy's state needs them for ['j1', 'j2'])"):
        assert text in faults, faults
    assert peer.wait_for(lambda: any(d["_level"] == rm.WARN and "rejected" in d["_message"] for d in peer.diags),
                         publish=False), peer.diags[-3:]
    n = len(peer.chunks)
    assert peer.wait_for(lambda: len(peer.chunks) >= n + 2), node.status()  # still serving
    assert node.status()["rejected_messages"] == 7


def test_publisher_gone_holds_then_latches_stop_until_reset(make_node, domain):
    node = make_node(FakePolicy(), stale_obs_s=0.2, hold_s=0.3)
    peer = Peer(domain)
    assert peer.wait_for(lambda: len(peer.chunks) >= 2), node.status()
    # the peer stops publishing
    assert peer.wait_for(lambda: any(d["safety"].startswith("stopped") for d in peer.diags), publish=False)
    holding = [d for d in peer.diags if d["safety"].startswith("holding")]
    stopped = [d for d in peer.diags if d["safety"].startswith("stopped")]
    assert holding and holding[0]["_level"] == rm.WARN
    assert "no joint_states or image newer than 0.2 s" in holding[0]["safety"]
    assert stopped[0]["_level"] == rm.ERROR and "stale observation" in stopped[0]["_message"]
    assert peer.diags.index(holding[0]) < peer.diags.index(stopped[0])
    # latched: fresh observations do not restart it
    published = node.status()["chunks_published"]
    start = time.monotonic()
    assert not peer.wait_for(lambda: node.status()["safety"] == "ok", timeout=0.6)
    assert node.status()["chunks_published"] == published and time.monotonic() - start >= 0.6
    # the latch told the controller to stop and hold: one trajectory without points, for the node's joints
    assert [rm.trajectory_to_numpy(m)[0] for m in peer.stops] == [NAMES] and node.status()["stops_published"] == 1
    peer.reset("operator: robot checked")
    n = len(peer.chunks)
    assert peer.wait_for(lambda: len(peer.chunks) >= n + 2 and node.status()["safety"] == "ok"), node.status()
    assert node.status()["resets"] == 1
    assert any("reset: on rt/edgespec_policy_node/reset: 'operator: robot checked'" in d["_message"] for d in peer.diags)


def test_policy_raising_or_returning_nan_publishes_nothing_and_keeps_running(make_node, domain):
    policy = FakePolicy()
    node = make_node(policy, max_policy_failures=10**6, hold_s=60.0)  # never latches here: degraded, then recovers
    peer = Peer(domain)
    assert peer.wait_for(lambda: len(peer.chunks) >= 1), node.status()
    for mode, text in (("raise", "policy raised RuntimeError: engine exploded"), ("nan", "NaN or inf in its chunk")):
        policy.mode = mode
        assert peer.wait_for(lambda: any(text in d["_message"] and d["_level"] == rm.ERROR for d in peer.diags)), \
            node.status()
        assert text in node.status()["last_fault"]
    policy.mode = "ok"
    n = len(peer.chunks)
    assert peer.wait_for(lambda: len(peer.chunks) >= n + 2), node.status()
    node.stop()
    st = node.status()
    assert peer.wait_for(lambda: len(peer.chunks) >= st["chunks_published"], publish=False, timeout=5)
    assert st["policy_faults"] >= 2 and st["safety"] == "ok"
    assert st["chunks_published"] == st["inferences"] - st["policy_faults"] - st["chunks_dropped"]
    assert len(peer.chunks) == st["chunks_published"]
    assert all(np.isfinite(rm.trajectory_to_numpy(m)[1]).all() for m in peer.chunks)


@pytest.mark.parametrize("max_failures, hold_s, reason", [(3, 60.0, "policy failing: 3 in a row"),
                                                         (10**6, 0.3, "policy failing: ")])
def test_policy_failures_are_never_reported_ok_and_latch_a_stop_until_reset(make_node, domain, max_failures,
                                                                             hold_s, reason):
    policy = FakePolicy()
    node = make_node(policy, max_policy_failures=max_failures, hold_s=hold_s, stale_obs_s=5.0)
    peer = Peer(domain)
    assert peer.wait_for(lambda: len(peer.chunks) >= 1), node.status()
    policy.mode = "raise"
    assert peer.wait_for(lambda: any(d["safety"].startswith("stopped") for d in peer.diags)), node.status()
    first = next(i for i, d in enumerate(peer.diags) if "engine exploded" in d["_message"])
    after = peer.diags[first:]
    assert all(d["safety"] != "ok" and d["_level"] == rm.ERROR for d in after), after  # never "ok" while failing
    degraded = [d for d in after if d["safety"].startswith("degraded")]
    if max_failures > 1 and hold_s > 1:
        assert degraded and "policy failing (1 in a row): policy raised RuntimeError" in degraded[0]["safety"]
    stopped = next(d for d in after if d["safety"].startswith("stopped"))
    assert reason in stopped["safety"] and "engine exploded" in stopped["safety"], stopped
    assert peer.wait_for(lambda: len(peer.stops) == 1, publish=False), node.status()  # the controller holds
    # latched: a policy that works again does not restart it
    policy.mode = "ok"
    n = len(peer.chunks)
    assert not peer.wait_for(lambda: len(peer.chunks) > n, timeout=0.6)
    assert node.status()["safety"].startswith("stopped: policy failing")
    peer.reset("policy fixed")
    assert peer.wait_for(lambda: len(peer.chunks) >= n + 2 and node.status()["safety"] == "ok"), node.status()
    assert node.status()["policy_failures_in_a_row"] == 0


def _corrupt(msg):
    """`msg` serialized as well-formed CDR whose frame_id is not UTF-8: cyclonedds carries it, and the
    node's Python decoding of it fails (UnicodeDecodeError)."""
    msg.header.frame_id = "@@"
    raw = msg.serialize().replace(b"@@", b"\xff\xfe")
    msg.serialize = lambda **kw: raw  # DataWriter.write sends what serialize() returns
    return msg


def test_an_undecodable_sample_costs_no_valid_sample(domain):
    node = PolicyNode(FakePolicy(), NodeConfig(domain_id=domain, joint_names=NAMES))  # not started: the test reads
    try:
        dp = DomainParticipant(domain)
        w = DataWriter(dp, Topic(dp, "rt/joint_states", rm.JointState), rm.ros_qos())
        end = time.monotonic() + 10
        while not w.get_matched_subscriptions() and time.monotonic() < end:
            time.sleep(0.02)
        sent = [[k, -k] for k in (1.0, 2.0, 3.0, 4.0)]
        for k, pos in enumerate(sent):  # valid, valid, undecodable, valid, valid: one batch on the reader
            if k == 2:
                w.write(_corrupt(rm.joint_state_msg(NAMES, [9.0, 9.0], VELOCITY)))
            w.write(rm.joint_state_msg(NAMES, pos, VELOCITY))
        end = time.monotonic() + 10
        while node.stats.joint_states + node.stats.rejected_messages < 5 and time.monotonic() < end:
            node._read_inputs(time.monotonic())
            time.sleep(0.02)
        st = node.status()
        assert st["joint_states"] == 4 and st["rejected_messages"] == 1, st
        assert "rejected joint_states: could not deserialize (UnicodeDecodeError" in st["last_fault"]
        assert node._state.tolist() == sent[-1] + VELOCITY  # the newest valid sample is the observation
    finally:
        node.close()


def test_main_runs_the_node_for_seconds(domain, capsys):
    assert main(["--seconds", "0.3", "--hz", "50", "--domain", str(domain)], FakePolicy()) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["ticks"] >= 5 and status["safety"].startswith("waiting: no joint_states")
    with pytest.raises(SystemExit):
        main(["--seconds", "0.1"])  # no policy
    with pytest.raises(SystemExit):
        main(["--domain", "999"], FakePolicy())


class HangingPolicy(FakePolicy):
    """FakePolicy whose calls block (a hung engine) while `hang` is set."""

    def __init__(self):
        super().__init__()
        self.hang = threading.Event()
        self.release = threading.Event()

    def __call__(self, obs):
        if self.hang.is_set():
            self.release.wait(30)
        return super().__call__(obs)


def test_a_hung_policy_latches_a_stop_and_publishes_nothing_more(make_node, domain):
    policy = HangingPolicy()
    node = make_node(policy, watchdog_s=0.3, stale_obs_s=5.0)
    peer = Peer(domain)
    try:
        assert peer.wait_for(lambda: len(peer.chunks) >= 1), node.status()
        policy.hang.set()
        assert peer.wait_for(lambda: node.status()["safety"].startswith("stopped: policy hung")), node.status()
        assert peer.wait_for(lambda: len(peer.stops) == 1, publish=False), node.status()
        assert any(d["safety"].startswith("stopped: policy hung") and d["_level"] == rm.ERROR for d in peer.diags)
        n = len(peer.chunks)
        peer.reset("still hung")  # the worker has not come back: the watchdog latches again
        assert not peer.wait_for(lambda: len(peer.chunks) > n, timeout=0.6)
        assert node.status()["safety"].startswith("stopped: policy hung")
        done = node.status()["inferences"]
    finally:
        policy.hang.clear()
        policy.release.set()
    # a reset the node takes before the hung call has returned latches again (above): wait for its return first
    assert peer.wait_for(lambda: node.status()["inferences"] > done, publish=False), node.status()
    peer.reset("policy back")
    assert peer.wait_for(lambda: len(peer.chunks) > n and node.status()["safety"] == "ok"), node.status()

"""ROS 2 message types over plain DDS (the `cyclonedds` Python package, no rclpy), plus the helpers a node needs.

Each type is an IDL struct named the way ROS 2 names it on the wire (`<pkg>::msg::dds_::<Msg>_`), with its
fields in the order of the `.msg` file, so a ROS 2 node (rmw_cyclonedds, rmw_fastrtps, ...) sees the same
type and the same bytes. The types are `final`: cyclonedds serializes them as plain CDR (XCDR1), header
`00 01 00 00` for little-endian, which is what ROS 2 sends. (Final is cyclonedds's default; the explicit
annotation keeps it so. `appendable` / `mutable` or an optional member would switch the default to XCDR2.)

ROS 2 maps a topic `/name` to the DDS topic `rt/name` (`ros_topic`); its default QoS is reliable, volatile,
keep-last 10 (`ros_qos`); its domain id comes from `ROS_DOMAIN_ID` (`ros_domain_id`).

Converters: `image_to_numpy` / `numpy_to_image` (rgb8, bgr8), `joint_state_to_numpy` / `joint_state_msg`,
`chunk_to_trajectory` / `trajectory_to_numpy`, `stop_trajectory`, `diagnostics_msg`. They raise ValueError
naming what was expected and what came.
"""
# No `from __future__ import annotations` here: cyclonedds evaluates the field annotations at runtime.

import math
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from cyclonedds.core import Policy, Qos
from cyclonedds.idl import IdlStruct
from cyclonedds.idl import annotations as annotate
from cyclonedds.idl import types as t
from cyclonedds.util import duration

from .checks import not_finite_as_engine_input

MAX_DOMAIN_ID = 232  # ROS 2's limit: higher ids push the RTPS port numbers past 65535
IMAGE_ENCODINGS = ("rgb8", "bgr8")
# diagnostic_msgs/DiagnosticStatus levels
OK, WARN, ERROR, STALE = 0, 1, 2, 3


# ---------------------------------------------------------------- types (field order = the ROS 2 .msg files)

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
    step: t.uint32 = 0  # bytes per row, >= width * bytes per pixel
    # sequence<uint8>. Deserialized as a list of ints; `bytes` is accepted when serializing (same wire bytes).
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


@dataclass
@annotate.final
class KeyValue(IdlStruct, typename="diagnostic_msgs::msg::dds_::KeyValue_"):
    key: str = ""
    value: str = ""


@dataclass
@annotate.final
class DiagnosticStatus(IdlStruct, typename="diagnostic_msgs::msg::dds_::DiagnosticStatus_"):
    level: t.byte = OK  # ROS `byte` = IDL octet
    name: str = ""
    message: str = ""
    hardware_id: str = ""
    values: t.sequence[KeyValue] = field(default_factory=list)


@dataclass
@annotate.final
class DiagnosticArray(IdlStruct, typename="diagnostic_msgs::msg::dds_::DiagnosticArray_"):
    header: Header = field(default_factory=Header)
    status: t.sequence[DiagnosticStatus] = field(default_factory=list)


# ---------------------------------------------------------------- naming, QoS, domain

def ros_topic(name: str) -> str:
    """The DDS topic ROS 2 uses for a topic: "joint_states" or "/joint_states" -> "rt/joint_states"."""
    name = name.strip().lstrip("/")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"a ROS topic name is non-empty without spaces, got {name!r}")
    return "rt/" + name


def ros_qos(best_effort: bool = False) -> Qos:
    """ROS 2's default QoS: reliable, volatile, keep-last 10. `best_effort=True` is its sensor-data QoS
    reliability (a reliable reader does not match a best-effort writer, e.g. many camera drivers)."""
    rel = Policy.Reliability.BestEffort if best_effort else Policy.Reliability.Reliable(duration(milliseconds=100))
    return Qos(rel, Policy.Durability.Volatile, Policy.History.KeepLast(10))


def check_domain_id(domain_id: int) -> int:
    if isinstance(domain_id, bool) or not isinstance(domain_id, int) or not 0 <= domain_id <= MAX_DOMAIN_ID:
        raise ValueError(f"a ROS 2 domain id is an integer in 0..{MAX_DOMAIN_ID}, got {domain_id!r}")
    return domain_id


def ros_domain_id(env: Mapping[str, str] | None = None) -> int:
    """The domain id from ROS_DOMAIN_ID (unset or empty: 0), as ROS 2 reads it."""
    raw = (os.environ if env is None else env).get("ROS_DOMAIN_ID", "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ROS_DOMAIN_ID must be an integer in 0..{MAX_DOMAIN_ID}, got {raw!r}") from None
    if not 0 <= value <= MAX_DOMAIN_ID:
        raise ValueError(f"ROS_DOMAIN_ID must be in 0..{MAX_DOMAIN_ID}, got {value}")
    return value


# ---------------------------------------------------------------- time

def time_msg(seconds: float | None = None) -> Time:
    """A Time from seconds since the epoch (default: now)."""
    ns = time.time_ns() if seconds is None else round(seconds * 1e9)
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def duration_msg(seconds: float) -> Duration:
    if not 0 <= seconds < 2**31:
        raise ValueError(f"a duration here is in [0, 2**31) s, got {seconds}")
    ns = round(seconds * 1e9)
    return Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def to_seconds(stamp: Time | Duration) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


# ---------------------------------------------------------------- converters

def check_image(msg: Image) -> None:
    """Raise ValueError unless `msg` is a well-formed rgb8 / bgr8 image."""
    if msg.encoding not in IMAGE_ENCODINGS:
        raise ValueError(f"image encoding: expected one of {', '.join(IMAGE_ENCODINGS)}, got {msg.encoding!r}")
    if msg.height < 1 or msg.width < 1:
        raise ValueError(f"image size: expected height and width >= 1, got {msg.height}x{msg.width} (HxW)")
    if msg.step < 3 * msg.width:
        raise ValueError(f"image step: expected >= width * 3 = {3 * msg.width} bytes per row for "
                         f"{msg.encoding}, got {msg.step}")
    if len(msg.data) != msg.step * msg.height:
        raise ValueError(f"image data: expected step * height = {msg.step * msg.height} bytes, got {len(msg.data)}")


def image_to_numpy(msg: Image) -> np.ndarray:
    """An rgb8 / bgr8 Image -> (H, W, 3) uint8 RGB (row padding beyond width * 3 is dropped)."""
    check_image(msg)
    rows = np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.step)
    img = rows[:, :3 * msg.width].reshape(msg.height, msg.width, 3)
    return np.ascontiguousarray(img[..., ::-1] if msg.encoding == "bgr8" else img)


def numpy_to_image(img: np.ndarray, encoding: str = "rgb8", stamp: Time | None = None,
                   frame_id: str = "") -> Image:
    """(H, W, 3) uint8 RGB -> Image in `encoding` (rgb8 or bgr8; bgr8 swaps the channels)."""
    img = np.asarray(img)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or 0 in img.shape:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got {img.dtype} {img.shape}")
    if encoding not in IMAGE_ENCODINGS:
        raise ValueError(f"encoding: expected one of {', '.join(IMAGE_ENCODINGS)}, got {encoding!r}")
    h, w, _ = img.shape
    pixels = img[..., ::-1] if encoding == "bgr8" else img
    return Image(header=Header(stamp or time_msg(), frame_id), height=h, width=w, encoding=encoding,
                 is_bigendian=0, step=3 * w, data=np.ascontiguousarray(pixels).tobytes())


def joint_state_msg(names: Sequence[str], position, velocity=(), effort=(), stamp: Time | None = None,
                    frame_id: str = "") -> JointState:
    return JointState(header=Header(stamp or time_msg(), frame_id), name=list(names),
                      position=[float(x) for x in position], velocity=[float(x) for x in velocity],
                      effort=[float(x) for x in effort])


def joint_state_to_numpy(msg: JointState, expected: Sequence[str] = (), require_velocity: bool = False
                         ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """-> (names, position, velocity), velocity zeros when the message has none (unless `require_velocity`:
    then that is an error). With `expected` names, the message must hold at least those joints (found by
    name; others are ignored); they come back in that order. Raises ValueError on a count mismatch, NaN /
    inf, a missing joint or missing velocities."""
    names, n = list(msg.name), len(msg.name)
    if n == 0:
        raise ValueError("joint_states: no joints in the message")
    if len(msg.position) != n:
        raise ValueError(f"joint_states: {n} joint names but {len(msg.position)} positions")
    if len(msg.velocity) not in (0, n):
        raise ValueError(f"joint_states: {n} joint names but {len(msg.velocity)} velocities (expected 0 or {n})")
    pos = np.asarray(msg.position, dtype=np.float64)
    vel = np.asarray(msg.velocity, dtype=np.float64) if len(msg.velocity) else np.zeros(n)
    if expected:
        missing = [j for j in expected if j not in names]
        if missing:
            raise ValueError(f"joint_states: missing joints {missing} (expected {list(expected)}, got {names})")
        idx = [names.index(j) for j in expected]
        names, pos, vel = list(expected), pos[idx], vel[idx]
    # checked as the policy's engines see them (float32); joints the policy does not read may hold anything
    bad = [f"{what} of {names[i]} = {float(arr[i])!r}" for what, arr in (("position", pos), ("velocity", vel))
           for i in not_finite_as_engine_input(arr)]
    if bad:
        raise ValueError(f"joint_states: not finite as float32: {', '.join(bad)}")
    if require_velocity and not len(msg.velocity):
        raise ValueError(f"joint_states: no velocities in the message (the policy's state needs them for {names})")
    return names, pos, vel


def chunk_to_trajectory(chunk: np.ndarray, joint_names: Sequence[str], dt: float, stamp: Time | None = None,
                        frame_id: str = "") -> JointTrajectory:
    """(H, D) position targets -> JointTrajectory of H points, point k at time_from_start (k + 1) * dt."""
    chunk = np.asarray(chunk, dtype=np.float64)
    if chunk.ndim != 2 or chunk.shape[0] == 0 or chunk.shape[1] != len(joint_names):
        raise ValueError(f"chunk: expected shape (H >= 1, {len(joint_names)} joints), got {chunk.shape}")
    if not np.isfinite(chunk).all():
        raise ValueError("chunk: NaN or inf in the position targets")
    if not (dt > 0 and math.isfinite(dt)):
        raise ValueError(f"dt must be > 0 seconds, got {dt}")
    points = [JointTrajectoryPoint(positions=row.tolist(), time_from_start=duration_msg((k + 1) * dt))
              for k, row in enumerate(chunk)]
    return JointTrajectory(header=Header(stamp or time_msg(), frame_id), joint_names=list(joint_names),
                           points=points)


def stop_trajectory(joint_names: Sequence[str], stamp: Time | None = None, frame_id: str = "") -> JointTrajectory:
    """A JointTrajectory with no points: ROS 2's joint_trajectory_controller takes it as "stop: cancel the
    current trajectory and hold the current position"."""
    return JointTrajectory(header=Header(stamp or time_msg(), frame_id), joint_names=list(joint_names), points=[])


def trajectory_to_numpy(msg: JointTrajectory) -> tuple[list[str], np.ndarray, np.ndarray]:
    """-> (joint names, (H, D) positions, (H,) time_from_start seconds); H = 0 for a stop trajectory."""
    pos = np.array([p.positions for p in msg.points], dtype=np.float64).reshape(len(msg.points),
                                                                               len(msg.joint_names))
    return list(msg.joint_names), pos, np.array([to_seconds(p.time_from_start) for p in msg.points])


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(v)


def diagnostics_msg(values: Mapping[str, object], name: str, level: int = OK, message: str = "",
                    hardware_id: str = "", stamp: Time | None = None) -> DiagnosticArray:
    """One DiagnosticStatus holding `values` as key/value strings (floats with 6 significant digits)."""
    if level not in (OK, WARN, ERROR, STALE):
        raise ValueError(f"level must be OK=0, WARN=1, ERROR=2 or STALE=3, got {level}")
    status = DiagnosticStatus(level=level, name=name, message=message, hardware_id=hardware_id,
                              values=[KeyValue(str(k), _fmt(v)) for k, v in values.items()])
    return DiagnosticArray(header=Header(stamp or time_msg(), ""), status=[status])


def diagnostics_values(msg: DiagnosticArray, index: int = 0) -> dict[str, str]:
    """The key/value pairs of one status as a dict."""
    return {kv.key: kv.value for kv in msg.status[index].values}

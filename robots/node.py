"""A ROS 2-compatible policy node over plain DDS (cyclonedds, no rclpy).

    subscribes  rt/joint_states  sensor_msgs/JointState     the robot's joints by name: position (rad / m),
                                                            velocity; joints the embodiment does not use are
                                                            ignored, a missing one rejects the message
                rt/<image_topic> sensor_msgs/Image          rgb8 / bgr8 camera frame (default topic "image")
                rt/instruction   std_msgs/String            the language instruction (latest one is used)
                rt/<node_name>/reset std_msgs/String        clear a latched stop (data: who / why, logged);
                                                            the node resumes once its inputs are fresh
    publishes   rt/action_chunk  trajectory_msgs/JointTrajectory  JOINT position targets of the embodiment's
                                                            joints (names in joint_names), point k at
                                                            (k + 1) * dt; no points = stop and hold position
                                                            (joint_trajectory_controller's convention), sent
                                                            when a stop latches and on a safe stop
                rt/diagnostics   diagnostic_msgs/DiagnosticArray  latency, policy info, safety state, faults

An `Embodiment` (robots/embodiment.py) maps between the two sides: joint positions / velocities (found by
joint name) -> the policy's state in the policy's order (state_names; the reacher adds its fingertip by
forward kinematics), and the policy's (H, A) actions -> (H, J) joint position targets (the reacher: IK of its
Cartesian fingertip targets). A Policy that declares its embodiment in policy.json gets it looked up; a plain
callable gets the generic one over the joints of the first joint state (or `NodeConfig.joint_names`): state =
positions then velocities, actions = joint position targets.

A tick thread runs at `hz`: it takes what arrived, checks it, and hands the newest complete observation to
the inference worker (robots/worker.py, the control loop's) whenever a fresh joint state came and the
worker is idle; it never waits for the policy. The policy sees
`{"image": (H, W, 3) uint8 RGB, "state": (S,) float64, "instruction": str}`; numbers in `policy.last_info`
(e.g. acceptance rate, accepted tokens per round) go to diagnostics.

Faults never crash the node, and the node never reports "ok" through one. DDS samples are decoded one at a
time: an undecodable one is rejected and counted and costs no other sample. Malformed messages (wrong image
encoding / size / step, NaN in a joint state, a missing joint, missing velocities the state needs) are
rejected and counted. A policy that raises, returns NaN or a wrongly shaped chunk publishes nothing: safety
is "degraded: policy failing (N in a row): <error>" (ERROR) until an inference succeeds; failing
`max_policy_failures` times in a row, or for longer than `hold_s`, latches a stop; so does an inference
that runs past `watchdog_s` (a hung policy). A stale observation (no
joint state or image newer than `stale_obs_s`: the publisher is gone) stops chunk publishing: "holding" for
`hold_s`, then a latched stop. A latched stop ("stopped: <reason>", ERROR) publishes a stop trajectory and
holds until `reset()` (or a message on the reset topic). `safe_stop()` (SIGINT / SIGTERM under `edgespec
robot node`) stops inference, publishes a stop trajectory and marks safety stopped.

Discovery: Cyclone DDS's default (multicast on the first interface) is fine on a real network. On a single
host without multicast (containers, CI), call `use_loopback()` before the first node / participant of a
domain is created in the process (or export CYCLONEDDS_URI=`loopback_config()` for other processes).

    node = PolicyNode(policy, NodeConfig(hz=20))
    node.spin(10.0)            # or node.start(); ...; node.stop()
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, MutableMapping

import numpy as np
from cyclonedds.domain import DomainParticipant
from cyclonedds.internal import InvalidSample
from cyclonedds.pub import DataWriter
from cyclonedds.sub import DataReader
from cyclonedds.topic import Topic

from . import ros_msgs as rm
from .checks import check_chunk
from .chunks import HoldThenStop
from .embodiment import Embodiment, JointEmbodiment, embodiment_for
from .realtime import FixedRate
from .worker import Inference, InferenceWorker

Policy = Callable[[dict], np.ndarray]  # observation -> (H, A) chunk of the policy's actions

MAX_TAKE = 100  # samples taken per reader per tick (one at a time); more wait for the next tick


def loopback_config() -> str:
    """Cyclone DDS XML that keeps discovery and data on 127.0.0.1 with unicast only: works on a host (or
    container) without multicast. Participants find each other by probing the ports of participant
    indices 0..9 on 127.0.0.1, so up to 10 processes per domain on the host."""
    return ('<CycloneDDS><Domain><General><Interfaces><NetworkInterface address="127.0.0.1"/></Interfaces>'
            '<AllowMulticast>false</AllowMulticast></General><Discovery><Peers><Peer address="127.0.0.1"/>'
            '</Peers><ParticipantIndex>auto</ParticipantIndex></Discovery></Domain></CycloneDDS>')


def use_loopback(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set CYCLONEDDS_URI to `loopback_config()`; returns the previous value (None if unset). Cyclone reads it
    when a domain is first used in a process, so call this before creating the node or any participant."""
    env = os.environ if env is None else env
    old = env.get("CYCLONEDDS_URI")
    env["CYCLONEDDS_URI"] = loopback_config()
    return old


@dataclass
class NodeConfig:
    hz: float = 20.0  # tick rate = the most chunks per second
    domain_id: int | None = None  # None: $ROS_DOMAIN_ID, default 0
    image_topic: str = "image"
    dt: float | None = None  # period of the chunk's steps (time_from_start = (k + 1) * dt); None: 1 / hz
    stale_obs_s: float = 0.5  # joint state / image older than this: the observation is stale
    hold_s: float = 0.5  # stale (or the policy failing) for this long: latch the stop
    max_policy_failures: int = 5  # this many failed inferences in a row latch the stop
    watchdog_s: float = 2.0  # an inference running longer than this is a hung policy: latch the stop
    diag_hz: float = 2.0  # periodic diagnostics (at most one per tick); faults and safety changes: at once
    joint_names: tuple = ()  # generic embodiment's joints in policy order; (): those of the first joint state
    default_instruction: str | None = None  # used until an instruction arrives; None: wait for one
    best_effort_inputs: bool = False  # subscribe best-effort (matches sensor-data publishers too)
    node_name: str = "edgespec_policy_node"  # diagnostics name; reset topic rt/<node_name>/reset

    def __post_init__(self):
        if not 1 <= self.hz <= 1000:
            raise ValueError(f"hz must be in [1, 1000], got {self.hz}")
        if self.domain_id is not None:
            rm.check_domain_id(self.domain_id)
        rm.ros_topic(self.image_topic)  # raises on a bad name
        rm.ros_topic(self.reset_topic)
        if self.dt is not None and not (self.dt > 0 and math.isfinite(self.dt)):
            raise ValueError(f"dt must be > 0 seconds (or None for 1 / hz), got {self.dt}")
        if not self.stale_obs_s > 0 or not self.hold_s >= 0:
            raise ValueError(f"stale_obs_s must be > 0 and hold_s >= 0, got {self.stale_obs_s} and {self.hold_s}")
        if isinstance(self.max_policy_failures, bool) or not isinstance(self.max_policy_failures, int) \
                or self.max_policy_failures < 1:
            raise ValueError(f"max_policy_failures must be an integer >= 1, got {self.max_policy_failures!r}")
        if not self.diag_hz > 0:
            raise ValueError(f"diag_hz must be > 0 (capped by hz), got {self.diag_hz}")
        if not (self.watchdog_s > 0 and math.isfinite(self.watchdog_s)):
            raise ValueError(f"watchdog_s must be > 0 seconds, got {self.watchdog_s}")
        self.joint_names = tuple(self.joint_names)
        if len(set(self.joint_names)) != len(self.joint_names):
            raise ValueError(f"joint_names must be distinct, got {self.joint_names}")

    @property
    def step_s(self) -> float:
        return self.dt if self.dt is not None else 1.0 / self.hz

    @property
    def reset_topic(self) -> str:
        return f"{self.node_name}/reset"


@dataclass
class NodeStats:
    ticks: int = 0
    overruns: int = 0  # ticks that started late by more than a period
    joint_states: int = 0  # valid joint states taken
    inferences: int = 0
    chunks_published: int = 0
    chunks_dropped: int = 0  # landed while holding / stopped
    stops_published: int = 0  # stop trajectories (no points)
    rejected_messages: int = 0
    policy_faults: int = 0
    policy_failures_in_a_row: int = 0  # since the last good inference
    resets: int = 0
    diagnostics_published: int = 0
    inference_ms: float = float("nan")  # the last policy call
    latency_ms: float = float("nan")  # joint state received -> its chunk published, the last one
    safety: str = "waiting: no joint_states yet"
    embodiment: str = ""
    last_fault: str = ""
    policy_info: dict = field(default_factory=dict)  # policy.last_info of the last call


@dataclass
class _Job:
    position: np.ndarray  # (J,) joint positions of the observation, embodiment.joint_names order (IK seed)
    received: float  # monotonic time the joint state arrived
    stamp: rm.Time  # wall-clock time of the same, for the trajectory header


class PolicyNode:
    def __init__(self, policy: Policy, cfg: NodeConfig | None = None, embodiment: Embodiment | None = None):
        """embodiment: None = the one `policy` declares (embodiment_for), else the generic JointEmbodiment
        over cfg.joint_names or the joints of the first joint state."""
        self.policy, self.cfg = policy, cfg or NodeConfig()
        self.embodiment = embodiment if embodiment is not None else embodiment_for(policy)
        if self.embodiment is None and self.cfg.joint_names:
            self.embodiment = JointEmbodiment(self.cfg.joint_names)
        elif self.embodiment is not None and self.cfg.joint_names \
                and tuple(self.cfg.joint_names) != tuple(self.embodiment.joint_names):
            raise ValueError(f"joint_names {list(self.cfg.joint_names)} conflict with the embodiment's joints "
                             f"{list(self.embodiment.joint_names)} ({self.embodiment.name}); leave joint_names empty")
        self.domain_id = rm.ros_domain_id() if self.cfg.domain_id is None else self.cfg.domain_id
        self.stats = NodeStats(embodiment=self.embodiment.describe() if self.embodiment else "")
        self.safety = HoldThenStop(self.cfg.hold_s)
        self._faults: deque[str] = deque(maxlen=20)
        self._new_faults: list[str] = []  # since the last diagnostic
        self._new_policy_fault = False
        self._diag_due, self._next_diag = True, 0.0
        self._lock = threading.RLock()  # safety, failure counts and the worker hand-off (shared with it)
        self._was_stopped = False
        # policy failures: the latch counts a run since the last good inference or reset
        self._policy_ok, self._last_policy_error = True, ""
        self._fail_run, self._fail_since = 0, 0.0
        # newest inputs (tick thread only)
        self._state = self._position = None
        self._state_t = self._image_t = None
        self._state_stamp = rm.Time()
        self._state_seq = self._used_seq = 0
        self._image = None
        self._instruction = self.cfg.default_instruction
        # threads: the tick thread and the inference worker (robots/worker.py), new ones per start()
        self._worker: InferenceWorker | None = None
        self._result: Inference | None = None  # the worker's last finished call, for the next tick
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

        self._dp = DomainParticipant(self.domain_id)
        qin, qout = rm.ros_qos(best_effort=self.cfg.best_effort_inputs), rm.ros_qos()

        def topic(name, typ):
            return Topic(self._dp, rm.ros_topic(name), typ)
        self._joint_reader = DataReader(self._dp, topic("joint_states", rm.JointState), qin)
        self._image_reader = DataReader(self._dp, topic(self.cfg.image_topic, rm.Image), qin)
        self._instruction_reader = DataReader(self._dp, topic("instruction", rm.String), qin)
        self._reset_reader = DataReader(self._dp, topic(self.cfg.reset_topic, rm.String), qout)
        self._chunk_writer = DataWriter(self._dp, topic("action_chunk", rm.JointTrajectory), qout)
        self._diag_writer = DataWriter(self._dp, topic("diagnostics", rm.DiagnosticArray), qout)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._ticker is not None:
            return
        if self._dp is None:
            raise RuntimeError("the node is closed")
        self._stop.clear()
        self._result = None  # a result that landed when the node was stopped is dropped
        self._worker = InferenceWorker(self.policy, self._landed, self._check_chunk, time.monotonic,
                                       lock=self._lock, name="policy-node-infer")
        self._worker.start()
        self._ticker = threading.Thread(target=self._run, name="policy-node-tick", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        """Stop ticking (a policy call in flight is abandoned to its daemon thread)."""
        self._stop.set()
        if self._ticker is None:
            return
        self._ticker.join(timeout=2.0)
        self._worker.stop()
        self._worker.join(timeout=2.0)
        self._ticker = None

    def safe_stop(self, reason: str = "safe stop requested") -> None:
        """Stop inference, publish a stop trajectory (no points: the controller holds position) and latch
        safety "stopped: <reason>". Raises if the stop could not be published (the node is closed, DDS
        failed): the caller must then stop the robot another way."""
        self.stop()
        if self._dp is None:
            raise RuntimeError("safe stop failed: the node is closed, no stop trajectory could be published")
        with self._lock:
            self.safety.latch(reason)
        self.stats.safety = f"stopped: {reason}"
        self._publish_stop()
        self._was_stopped, self._diag_due = True, True
        self._diagnose(time.monotonic())

    def spin(self, seconds: float | None = None) -> dict:
        """Run for `seconds` (None: until Ctrl-C), then stop; returns `status()`."""
        self.start()
        try:
            while seconds is None:
                time.sleep(1.0)
            time.sleep(seconds or 0.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
        return self.status()

    def close(self) -> None:
        """Stop and delete the DDS entities (the node leaves the domain)."""
        self.stop()
        for name in ("_joint_reader", "_image_reader", "_instruction_reader", "_reset_reader", "_chunk_writer",
                     "_diag_writer", "_dp"):
            setattr(self, name, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def reset(self, why: str = "reset()") -> None:
        """Clear a latched stop; the node resumes once its inputs are fresh again. A policy that was failing
        stays "degraded" until an inference succeeds, and gets a fresh run of failures before it latches."""
        with self._lock:
            self.safety.reset()
            self._fail_run = 0
        self.stats.resets += 1
        self._note(f"reset: {why}")

    def status(self) -> dict:
        """A snapshot of the counters, the safety state and the recent faults (oldest first)."""
        st = asdict(self.stats)
        st["faults"] = list(self._faults)
        return st

    # ------------------------------------------------------------ threads

    def _run(self) -> None:
        period = 1.0 / self.cfg.hz
        rate = FixedRate(period, time.monotonic(), time.monotonic, late_s=period, sleep=self._stop.wait)
        while not self._stop.is_set():
            try:
                self._tick(time.monotonic())
            except Exception as e:  # a bug here must not take the node down
                self._fault(f"node tick failed: {type(e).__name__}: {e}")
            if not rate.wait():  # more than a period late: restart the schedule from now
                self.stats.overruns += 1

    def _check_chunk(self, actions) -> np.ndarray:
        """The policy's (H, A) actions, checked against the embodiment's actions (in the worker thread)."""
        names = self.embodiment.action_names
        return check_chunk(actions, len(names), names)

    def _landed(self, done: Inference) -> None:
        """A policy call ended (worker thread, holding self._lock): the next tick collects it."""
        self._result = done

    # ------------------------------------------------------------ one tick

    def _tick(self, now: float) -> None:
        self.stats.ticks += 1
        self._read_inputs(now)
        ready = self._collect()  # before the safety check: a failed inference must show in this tick's state
        safety = self._update_safety(now)
        if ready is not None:
            self._publish(ready, safety)
        if safety == "ok" or safety.startswith("degraded"):  # degraded: only a good inference clears it
            self._submit()
        self._diagnose(now)

    def _fault(self, msg: str, rejected: bool = False, policy: bool = False) -> None:
        self._faults.append(msg)
        self._new_faults.append(msg)
        self.stats.last_fault = msg
        self.stats.rejected_messages += rejected
        self.stats.policy_faults += policy
        self._new_policy_fault |= policy
        self._diag_due = True

    def _note(self, msg: str) -> None:
        """Not a fault, but worth a diagnostic at once (a reset)."""
        self._new_faults.append(msg)
        self._diag_due = True

    def _take(self, reader: DataReader, what: str) -> list:
        """The samples waiting on `reader`, taken and decoded one at a time: an undecodable sample is counted
        and reported, and the others are still delivered (a batch take would lose them all)."""
        out = []
        for _ in range(MAX_TAKE):
            try:
                got = reader.take(N=1)  # the sample leaves the reader's cache before it is decoded
            except Exception as e:  # undecodable bytes from a peer
                self._fault(f"rejected {what}: could not deserialize ({type(e).__name__}: {e})", rejected=True)
                continue
            if not got:
                break
            out += [s for s in got if not isinstance(s, InvalidSample)]
        return out

    def _read_inputs(self, now: float) -> None:
        for msg in self._take(self._reset_reader, self.cfg.reset_topic):
            self.reset(f"on {rm.ros_topic(self.cfg.reset_topic)}: {msg.data!r}")
        for msg in self._take(self._joint_reader, "joint_states"):
            emb = self.embodiment
            try:
                names, pos, vel = rm.joint_state_to_numpy(msg, emb.joint_names if emb else (),
                                                          require_velocity=emb.needs_velocity if emb else True)
                if emb is None:  # the first valid message fixes the joints of the generic embodiment
                    emb = JointEmbodiment(names)
                state = emb.state(pos, vel)
            except ValueError as e:
                self._fault(f"rejected {e}", rejected=True)
                continue
            if self.embodiment is None:
                self.embodiment, self.stats.embodiment = emb, emb.describe()
            self._state, self._position = state, pos
            self._state_t, self._state_stamp = now, rm.time_msg()
            self._state_seq += 1
            self.stats.joint_states += 1
        newest = None
        for msg in self._take(self._image_reader, self.cfg.image_topic):
            try:
                rm.check_image(msg)
                newest = msg
            except ValueError as e:
                self._fault(f"rejected {self.cfg.image_topic}: {e}", rejected=True)
        if newest is not None:
            self._image, self._image_t = rm.image_to_numpy(newest), now
        for msg in self._take(self._instruction_reader, "instruction"):
            self._instruction = msg.data

    def _update_safety(self, now: float) -> str:
        hung = self._worker.overdue(now, self.cfg.watchdog_s)
        with self._lock:
            if not self.safety.stopped and hung is not None:  # the worker never came back
                why = f"policy hung: an inference has run {hung:.3f} s (watchdog {self.cfg.watchdog_s} s)"
                self.safety.latch(why)
                self._fault(why, policy=True)
            if not self.safety.stopped and not self._policy_ok and self._fail_run and (
                    self._fail_run >= self.cfg.max_policy_failures or now - self._fail_since > self.cfg.hold_s):
                self.safety.latch(f"policy failing: {self._fail_run} in a row for {now - self._fail_since:.3f} s "
                                  f"(limit {self.cfg.max_policy_failures} / {self.cfg.hold_s} s): "
                                  f"{self._last_policy_error}")
            if self.safety.stopped:
                state = f"stopped: {self.safety.reason}"
            elif self._state_t is None or self._image_t is None or self._instruction is None:
                missing = [n for n, v in (("joint_states", self._state_t), (self.cfg.image_topic, self._image_t),
                                          ("instruction", self._instruction)) if v is None]
                state = f"waiting: no {', '.join(missing)} yet"
            else:
                stale = [n for n, t in (("joint_states", self._state_t), (self.cfg.image_topic, self._image_t))
                         if now - t > self.cfg.stale_obs_s]
                if stale:
                    why = (f"stale observation (no {' or '.join(stale)} newer than {self.cfg.stale_obs_s} s; "
                           "publisher gone?)")
                    mode, _ = self.safety.on_empty(now, why)
                    state = f"holding: {why}" if mode == "hold" else f"stopped: {self.safety.reason}"
                else:
                    self.safety.on_action(self._state)
                    state = "ok" if self._policy_ok else (f"degraded: policy failing "
                                                          f"({self.stats.policy_failures_in_a_row} in a row): "
                                                          f"{self._last_policy_error}")
        stopped = state.startswith("stopped")
        if stopped and not self._was_stopped:
            self._publish_stop()  # the controller holds where the robot is instead of finishing the last chunk
        self._was_stopped = stopped
        if state.split(":")[0] != self.stats.safety.split(":")[0]:
            self._diag_due = True
        self.stats.safety = state
        return state

    def _submit(self) -> None:
        if self._state_seq == self._used_seq:
            return  # no fresh joint state since the last inference
        job = _Job(self._position.copy(), self._state_t, self._state_stamp)
        obs = {"image": self._image, "state": self._state.copy(), "instruction": self._instruction}
        if self._worker.submit(job, obs, time.monotonic()):  # False while an inference runs
            self._used_seq = self._state_seq

    def _collect(self):
        """The finished inference, turned into joint targets: (job, (H, C) targets) or None (none finished, or
        it failed: then a policy fault). The worker checked the chunk against the embodiment's actions."""
        with self._lock:
            done, self._result = self._result, None
        if done is None:
            return None
        job, emb, err, targets = done.job, self.embodiment, done.error or None, None
        self.stats.inferences += 1
        self.stats.inference_ms, self.stats.policy_info = (done.end - done.start) * 1e3, done.info
        if err is None:
            try:
                targets = np.asarray(emb.joint_targets(done.chunk, job.position), dtype=np.float64)
            except Exception as e:  # noqa: BLE001 - a bad conversion must not take the node down
                err = f"{emb.name}: actions -> joint targets failed: {type(e).__name__}: {e}"
        if err is None and (targets.shape != (done.chunk.shape[0], len(emb.command_joints))
                            or not np.isfinite(targets).all()):
            err = f"{emb.name}: joint targets of shape {targets.shape} with NaN / inf or the wrong shape"
        with self._lock:
            if err is not None:
                if self._fail_run == 0:
                    self._fail_since = time.monotonic()
                self._fail_run += 1
                self.stats.policy_failures_in_a_row += 1
                self._policy_ok, self._last_policy_error = False, err
            else:
                self._fail_run = self.stats.policy_failures_in_a_row = 0
                self._policy_ok = True
        if err is not None:
            self._fault(err, policy=True)
            return None
        return job, targets

    def _publish(self, ready, safety: str) -> None:
        job, targets = ready
        if safety != "ok":
            self.stats.chunks_dropped += 1
            return
        self._chunk_writer.write(rm.chunk_to_trajectory(targets, self.embodiment.command_joints, self.cfg.step_s,
                                                        stamp=job.stamp))
        self.stats.chunks_published += 1
        self.stats.latency_ms = (time.monotonic() - job.received) * 1e3

    def _publish_stop(self) -> None:
        joints = self.embodiment.command_joints if self.embodiment else self.cfg.joint_names
        self._chunk_writer.write(rm.stop_trajectory(joints))
        self.stats.stops_published += 1

    def _diagnose(self, now: float) -> None:
        if not self._diag_due and now < self._next_diag:
            return
        st, safety = self.stats, self.stats.safety
        if safety.startswith(("stopped", "degraded")) or self._new_policy_fault:
            level = rm.ERROR
        elif safety != "ok" or self._new_faults:
            level = rm.WARN
        else:
            level = rm.OK
        parts = ([] if safety == "ok" else [safety]) + self._new_faults[-3:]
        values = {"safety": safety, "latency_ms": st.latency_ms, "inference_ms": st.inference_ms,
                  "chunks_published": st.chunks_published, "inferences": st.inferences,
                  "rejected_messages": st.rejected_messages, "policy_faults": st.policy_faults,
                  "policy_failures_in_a_row": st.policy_failures_in_a_row, "embodiment": st.embodiment,
                  "last_fault": st.last_fault, **st.policy_info}
        self._diag_writer.write(rm.diagnostics_msg(values, name=self.cfg.node_name, level=level,
                                                   message="; ".join(parts) or "ok", hardware_id="edgespec"))
        st.diagnostics_published += 1
        self._new_faults, self._new_policy_fault, self._diag_due = [], False, False
        self._next_diag = now + 1.0 / self.cfg.diag_hz


# ---------------------------------------------------------------- command line

class _StopSignals:
    """While active, SIGINT / SIGTERM only record their name and set an event (in the main thread; elsewhere
    Python delivers no signals to us and Ctrl-C stays a KeyboardInterrupt). The stop itself is the caller's
    to do, once; signals arriving during it are recorded and ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.got: list[str] = []
        self.event = threading.Event()
        self._old: dict = {}

    def _on_signal(self, signum, frame):
        self.got.append(signal.Signals(signum).name)
        self.event.set()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)

    def wait(self, seconds: float | None) -> str | None:
        """Until `seconds` pass (-> None) or a signal arrives (-> its name, e.g. "SIGTERM")."""
        try:
            self.event.wait(seconds)
        except KeyboardInterrupt:  # handlers not installed (not the main thread)
            self.got.append("SIGINT")
        return self.got[0] if self.got else None


def main(argv: list[str] | None = None, policy: Policy | None = None, embodiment: Embodiment | None = None) -> int:
    """`edgespec robot node`: run a PolicyNode around `policy` (the caller builds it) and print its status as
    JSON. SIGINT / SIGTERM: safe stop (stop trajectory, safety stopped), exit 0, or 1 when the safe stop
    failed (its error is in the status and on stderr). --seconds elapsed: stop, exit 0."""
    p = argparse.ArgumentParser(prog="edgespec robot node", description=__doc__.split("\n")[0])
    p.add_argument("--hz", type=float, default=20.0, help="tick rate, the most chunks per second (default 20)")
    p.add_argument("--domain", type=int, default=None, help="DDS domain id (default: $ROS_DOMAIN_ID or 0)")
    p.add_argument("--image-topic", default="image", help="image topic without the rt/ prefix (default: image)")
    p.add_argument("--seconds", type=float, default=None, help="run this long, then exit (default: until a signal)")
    p.add_argument("--loopback", action="store_true", help="DDS on 127.0.0.1 only, unicast (see loopback_config)")
    p.add_argument("--max-policy-failures", type=int, default=5, help="failed inferences in a row that latch a stop")
    p.add_argument("--watchdog-s", type=float, default=2.0,
                   help="an inference running longer than this is a hung policy: latch a stop (default 2)")
    args = p.parse_args(argv)
    if policy is None:
        p.error("no policy given: call main(argv, policy)")
    if args.loopback:
        use_loopback()
    try:
        cfg = NodeConfig(hz=args.hz, domain_id=args.domain, image_topic=args.image_topic,
                         max_policy_failures=args.max_policy_failures,
                         watchdog_s=args.watchdog_s)
        node = PolicyNode(policy, cfg, embodiment)
    except ValueError as e:
        p.error(str(e))
    rc = 0
    with _StopSignals() as signals, node:
        node.start()
        what = node.stats.embodiment or "joints of the first joint state"
        print(f"edgespec robot node: serving on domain {node.domain_id} ({what}); SIGINT / SIGTERM: safe stop",
              file=sys.stderr, flush=True)
        sig = signals.wait(args.seconds)
        if sig is None:
            node.stop()
        else:
            try:
                node.safe_stop(f"safe stop on {sig}")
            except Exception as e:  # noqa: BLE001 - reported, and the exit code says so
                rc = 1
                print(f"edgespec robot node: SAFE STOP FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                node.stats.last_fault = f"safe stop failed: {type(e).__name__}: {e}"
        status = node.status()
        status["exit"] = {"signal": sig, "signals": list(signals.got), "safe_stop": sig is not None, "rc": rc}
        print(json.dumps(status, indent=1, default=str), flush=True)
    return rc


def cmd_node(argv) -> int:
    from .policy_args import make_policy, one_line, policy_flags

    p = argparse.ArgumentParser(prog="edgespec robot node", add_help=False)
    policy_flags(p)
    p.add_argument("--instruction", default=None, help="fixed instruction (default: from rt/instruction)")
    args, rest = p.parse_known_args(argv)
    try:
        policy, pol = make_policy(args, args.instruction)
    except Exception as e:  # noqa: BLE001  (bad folder, ORT error, an instruction the policy refuses)
        p.exit(2, f"{p.prog}: error: {one_line(e)}\n")  # one line: no usage, the flags were fine
    try:
        try:
            embodiment = embodiment_for(pol)  # what the policy folder declares (None: generic joints)
        except ValueError as e:
            p.error(f"{args.policy}: {e}")
        return main(rest, policy, embodiment)
    finally:
        policy.close()

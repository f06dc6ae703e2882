"""The loop's latency profile, Chrome trace and timeline PNG, on MockRobot runs with a fake policy of known
latency. Bands are wide: these machines are shared and loaded."""
import json
import time

import numpy as np
import pytest

from edgespec.robots.loop import ControlLoop, LoopConfig
from edgespec.robots.profile import chrome_trace, loop_profile, plot_timeline
from edgespec.robots.robot import MockRobot

HZ = 50


def slow_policy(delay=0.03, h=10, fail_after=None):
    calls = {"n": 0}

    def policy(obs):
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise RuntimeError("injected fault")
        time.sleep(delay)
        return np.tile(obs["state"] + 0.01, (h, 1))
    return policy


def run(seconds, tries=3, **kw):
    """A MockRobot run; rerun when the loaded box froze the whole process mid-run (a tick gap > 0.2 s)."""
    policy_kw = {k: kw.pop(k) for k in ("fail_after",) if k in kw}
    for _ in range(tries):
        with MockRobot(dims=2) as robot:
            rep = ControlLoop(robot, slow_policy(**policy_kw), LoopConfig(hz=HZ, **kw)).run(seconds)
        if rep.ticks and max(np.diff([0.0] + rep.tick_start_s)) <= 0.2:
            break
    return rep


@pytest.fixture(scope="module")
def healthy():
    return run(1.0)


@pytest.fixture(scope="module")
def faulted():
    return run(0.8, fail_after=2, hold_s=0.1)


def test_profile_keys_and_values(healthy):
    p = loop_profile(healthy, 1 / HZ)
    assert {"hz", "ticks", "sections_ms", "jitter_ms", "inference_ms", "deadline_misses", "starved_ticks",
            "held_ticks", "stopped_ticks", "faults", "safe_stop_reason"} <= set(p)
    assert p["hz"] == HZ and p["ticks"] == healthy.ticks and 30 <= p["ticks"] <= 51
    for k in ("observe", "infer", "act", "wait"):
        s = p["sections_ms"][k]
        assert s["n"] == healthy.ticks and 0 <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"]
    assert p["jitter_ms"]["n"] == healthy.ticks - 1 and 0 <= p["jitter_ms"]["p50"] <= p["jitter_ms"]["max"]
    inf = p["inference_ms"]
    assert inf["n"] >= 3 and 25 <= inf["p50"] <= 250  # the policy sleeps 30 ms; observation -> landed
    assert inf["p50"] <= inf["p95"] <= inf["p99"] <= inf["max"]
    assert p["inferences"].get("ok", 0) >= inf["n"]
    assert p["faults"] == [] and p["safe_stop_reason"] == "" and p["stopped_ticks"] == 0
    assert loop_profile(healthy) == p  # dt defaults to the report's period


def test_profile_of_a_faulted_run(faulted):
    p = loop_profile(faulted)
    assert p["stopped_ticks"] > 0 and p["held_ticks"] > 0 and p["starved_ticks"] == p["held_ticks"] + p["stopped_ticks"]
    assert "injected fault" in p["safe_stop_reason"] and p["safe_stop_s"] is not None
    assert p["inferences"]["raised"] == 1


def _check_trace(trace, rep):
    json.dumps(trace)  # serialisable
    ev = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == {"loop thread", "inference worker"}
    x = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in x)
    loop = [e for e in x if e["tid"] == names["loop thread"]]
    worker = [e for e in x if e["tid"] == names["inference worker"]]
    assert len(loop) == 4 * rep.ticks and {e["name"] for e in loop} == {"observe", "infer", "act", "wait"}
    assert len(worker) == len(rep.inference_outcome) >= 1
    return ev, worker


def test_chrome_trace_tracks_and_events(healthy, tmp_path):
    path = tmp_path / "loop.json"
    trace = chrome_trace(healthy, path)
    assert json.loads(path.read_text()) == trace
    ev, worker = _check_trace(trace, healthy)
    assert sum(e["name"] == "inference" for e in worker) >= 3
    assert all(e["ts"] >= 0 for e in ev if e["ph"] == "i") and not any(e["name"] == "fault" for e in ev)


def test_chrome_trace_marks_faults_and_the_safe_stop(faulted):
    ev, worker = _check_trace(chrome_trace(faulted), faulted)
    faults = [e for e in ev if e["ph"] == "i" and e["name"] == "fault"]
    stops = [e for e in ev if e["ph"] == "i" and e["name"] == "safe stop"]
    assert len(faults) == len(faulted.faults) >= 1 and "injected fault" in faults[0]["args"]["message"]
    assert len(stops) == 1 and stops[0]["ts"] >= faults[0]["ts"]
    assert any(e["args"]["outcome"] == "raised" for e in worker)


@pytest.mark.parametrize("which", ["healthy", "faulted"])
def test_timeline_png(which, request, tmp_path):
    pytest.importorskip("matplotlib", reason="plot_timeline needs matplotlib (the bench extra)")
    path = tmp_path / f"{which}.png"
    plot_timeline(request.getfixturevalue(which), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

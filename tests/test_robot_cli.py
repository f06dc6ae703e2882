"""`edgespec robot run` / `edgespec robot node` end to end with a tiny random policy."""
from __future__ import annotations

import json
import random

import pytest

from edgespec.cli import main as edgespec_main


def test_robot_run_drives_the_reacher_and_writes_the_profile(tiny_reacher_policy, tmp_path, capsys):
    out = tmp_path / "loop.json"
    rc = edgespec_main(["robot", "run", "--env", "reacher", "--policy", str(tiny_reacher_policy), "--draft",
                        "--hz", "20", "--instruction", "reach the red target", "--seconds", "0.6",
                        "--profile", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["loop"]["ticks"] >= 2 and prof["episode"]["speculative"] is True  # timing: bench_loop
    assert set(prof["loop"]["sections_ms"]) == {"observe", "infer", "act", "wait"}
    assert json.loads(out.with_suffix(".trace.json").read_text())["traceEvents"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ticks at 20 Hz" in capsys.readouterr().out


@pytest.mark.parametrize("instruction, match", [("reach the purple target", "must name one of"),
                                                ("reach the red thing", "unknown words")])
def test_robot_run_refuses_bad_instructions(tiny_reacher_policy, instruction, match, capsys):
    with pytest.raises(SystemExit):
        edgespec_main(["robot", "run", "--policy", str(tiny_reacher_policy), "--instruction", instruction])
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [(["--loop-cpus", "zero"], "expected CPU numbers separated by commas"),
                                          (["--policy-cpus", "-1"], "expected CPU numbers >= 0"),
                                          (["--policy-cpus", "0", "--inference", "thread"],
                                           "--policy-cpus needs --inference process"),
                                          (["--policy-cpus", "4096"], "non-empty subset of this process's CPUs")])
def test_robot_run_refuses_bad_cpu_flags(tiny_reacher_policy, flags, match, capsys):
    with pytest.raises(SystemExit):
        edgespec_main(["robot", "run", "--policy", str(tiny_reacher_policy)] + flags)
    assert match in capsys.readouterr().err


def test_robot_node_starts_and_stops(tiny_reacher_policy, capsys):
    from edgespec.robots.node import use_loopback
    use_loopback()
    rc = edgespec_main(["robot", "node", "--policy", str(tiny_reacher_policy), "--draft", "--loopback",
                        "--domain", str(random.randint(100, 200)), "--seconds", "0.5"])
    assert rc == 0
    status = json.loads(capsys.readouterr().out)
    assert status["ticks"] >= 3 and status["safety"].startswith("waiting")


@pytest.mark.parametrize("flags, match", [(["--seconds", "0"], "expected a finite number of seconds > 0"),
                                          (["--seconds", "nan"], "expected a finite number of seconds > 0"),
                                          (["--seconds", "inf"], "expected a finite number of seconds > 0"),
                                          (["--seconds", "-2"], "expected a finite number of seconds > 0"),
                                          (["--threads", "0"], "expected an integer >= 1, got 0"),
                                          (["--loop-cpus", "4096"], "--loop-cpus 4096: expected a non-empty subset")])
def test_robot_run_refuses_bad_run_flags_up_front(flags, match, capsys):
    # no policy is loaded: the flags are refused before anything starts (the folder does not even exist)
    with pytest.raises(SystemExit) as e:
        edgespec_main(["robot", "run", "--policy", "no/such/policy"] + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "node"])
def test_a_policy_that_does_not_load_is_one_error_line(tmp_path, monkeypatch, capsys, command):
    with pytest.raises(SystemExit) as e:
        edgespec_main(["robot", command, "--policy", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error: FileNotFoundError" in err, err
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidProtobuf

    def broken(**kw):  # what ONNX Runtime raises for a truncated model.onnx (its messages span lines)
        raise InvalidProtobuf("[ONNXRuntimeError] : 7 : INVALID_PROTOBUF : Load model failed:\nProtobuf parsing failed.")
    monkeypatch.setattr("edgespec.robots.policy_args.load_policy", broken)
    with pytest.raises(SystemExit) as e:
        edgespec_main(["robot", command, "--policy", str(tmp_path), "--inference", "thread"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error: InvalidProtobuf: [ONNXRuntimeError]" in err, err


def test_a_robot_that_fails_mid_run_is_one_error_line(tiny_reacher_policy, monkeypatch, capsys):
    def no_gl(self):
        raise RuntimeError("osmesa: could not create a context")
    monkeypatch.setattr("edgespec.robots.reacher.ReacherRobot.connect", no_gl)
    rc = edgespec_main(["robot", "run", "--policy", str(tiny_reacher_policy), "--inference", "thread"])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip() == "error: RuntimeError: osmesa: could not create a context", err


RUN = "import sys; from edgespec.cli import main; sys.exit(main(sys.argv[1:]))"
# the same, with a robot whose safe_stop() raises (its driver lost the bus)
RUN_STOP_FAILS = ("import sys; from edgespec.robots.reacher import ReacherRobot\n"
                  "def fail(self): raise OSError('CAN bus down')\n"
                  "ReacherRobot.safe_stop = fail\n" + RUN)


def run_and_signal(code, policy, sig, after_s=0.5):
    """`edgespec robot run` (30 s) in a child; `sig` once the loop has run for about after_s. -> (rc, out, err)"""
    import signal
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-c", code, "robot", "run", "--policy", str(policy), "--draft",
                          "--inference", "thread", "--seconds", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        err = []
        for line in p.stderr:  # the loop is about to start once it says so
            err.append(line)
            if line.startswith("running"):
                break
        time.sleep(after_s)
        p.send_signal(getattr(signal, sig))
        out, rest = p.communicate(timeout=60)
    finally:
        p.kill()
    return p.returncode, out, "".join(err) + rest


@pytest.mark.parametrize("sig, rc", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_the_robot_once_and_prints_the_summary(tiny_reacher_policy, sig, rc):
    code, out, err = run_and_signal(RUN, tiny_reacher_policy, sig)
    assert code == rc and "Traceback" not in err, (code, out, err)
    assert "ticks at 20 Hz" in out and f"stopped by {sig} after " in out, out
    assert "robot.safe_stop() calls: 1\n" in out, out  # exactly once, by the signal


def test_a_safe_stop_that_raises_on_a_signal_exits_nonzero_without_a_traceback(tiny_reacher_policy):
    code, out, err = run_and_signal(RUN_STOP_FAILS, tiny_reacher_policy, "SIGTERM")
    assert code == 1 and "Traceback" not in err, (code, out, err)
    assert "stopped by SIGTERM" in out and "robot.safe_stop() raised OSError: CAN bus down" in out, out
    assert "error: the robot's safe stop failed 1 time(s)" in err and "CAN bus down" in err, err


@pytest.mark.parametrize("flags, match", [(["--remote", "localhost:8000"], "url must be http://HOST:PORT"),
                                          (["--remote", "http://127.0.0.1:9", "--remote-fallback", "hold"],
                                           "cannot reach the server at load"),
                                          (["--remote", "http://127.0.0.1:9", "--remote-deadline", "0"],
                                           "expected a finite number of seconds > 0")])
def test_robot_run_refuses_bad_remote_flags_before_the_loop(tiny_reacher_policy, flags, match, capsys):
    with pytest.raises(SystemExit) as e:
        edgespec_main(["robot", "run", "--policy", str(tiny_reacher_policy), "--inference", "thread"] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and "Traceback" not in err

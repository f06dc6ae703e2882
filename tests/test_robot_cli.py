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

"""tegrastats parsing against recorded sample lines, and the profile report / trace on tiny engines."""
import json
from pathlib import Path

import pytest

import edgespec
from edgespec.cli import main as cli_main
from edgespec.profiling import TegrastatsSampler, parse_tegrastats, percentiles

SAMPLES = Path(__file__).parent / "fixtures" / "tegrastats-samples.txt"


def sample_pairs():
    lines = [ln.rstrip("\n") for ln in SAMPLES.read_text().splitlines() if ln and not ln.startswith("#")]
    return [(a, b[len("expect: "):]) for a, b in zip(lines, lines[1:]) if b.startswith("expect:") and not a.startswith("expect:")]


@pytest.mark.parametrize("line,expect", sample_pairs())
def test_tegrastats_lines_parse_to_the_expected_figures(line, expect):
    got = parse_tegrastats(line)
    for item in expect.split():
        key, val = item.split("=")
        want = None if val == "None" else int(val)
        have = got["power_mw"].get(key.split(".", 1)[1]) if key.startswith("power_mw.") else got[key]
        assert have == want, f"{key}: got {have}, expected {want}"


def test_sample_file_has_cases():
    assert len(sample_pairs()) >= 5


def test_no_tegrastats_says_so_instead_of_zeros(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    s = TegrastatsSampler().summary(tokens=10)
    assert s["available"] is False and "no tegrastats" in s["reason"] and "joules_per_token" not in s


def test_percentiles():
    p = percentiles(range(1, 101))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["n"] == 100


def test_profile_report_trace_and_lossless_check(tiny_engines, tmp_path, capsys):
    trace, report = tmp_path / "trace.json", tmp_path / "report.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('"def f(x):\\n"\nabcabcabc\n')
    rc = cli_main(["profile", "--target", str(tiny_engines["target"]), "--draft", str(tiny_engines["noisy"]),
                   "--prompts-file", str(prompts), "--max-new-tokens", "24", "--gamma", "3",
                   "--trace", str(trace), "--json", str(report), "--lossless-check", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "per token" in out and "tegrastats:" in out and "lossless check: 0/2" in out
    r = json.loads(report.read_text())
    assert r["tokens"] == 48 and r["round_ms"]["total"]["n"] > 0
    assert r["round_ms"]["verify"]["p50"] > 0 and r["round_ms"]["draft"]["p50"] > 0
    assert sum(r["round_time_share"][k] for k in ("engine", "kv_write", "python")) == pytest.approx(1.0)
    t = json.loads(trace.read_text())
    names = {e["name"] for e in t["traceEvents"]}
    assert {"round", "draft", "verify", "sampling"} <= names and any(n.startswith("target.run") for n in names)


def test_lossless_check_catches_a_divergence(tiny_engines):
    from edgespec.profiling import lossless
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=2)
    real = gen.generate

    def broken(p, **kw):  # a speculative path that corrupts its last token
        out = real(p, **kw)
        out.token_ids[-1] = (out.token_ids[-1] + 1) % 96
        return out
    gen.generate = broken
    r = lossless(gen, [[1, 2, 3], [4, 5]], 10)
    assert r["diverged"] == 2 and r["first_divergent_token"] == [9, 9]


def test_sampler_reads_a_tegrastats_stream_and_sums_energy(tmp_path, monkeypatch):
    """Three recorded Orin Nano lines through a fake `tegrastats` on PATH and the sampler's reader thread,
    stamped by a fake clock at t = 10.0, 10.5, 11.0 s; the summary is checked against hand-computed figures."""
    import os
    import time
    from types import SimpleNamespace

    from edgespec import profiling

    lines = [ln for ln in SAMPLES.read_text().splitlines() if ln.startswith("09-")][:3]  # Orin Nano lines
    assert len(lines) == 3
    stream = tmp_path / "stream.txt"
    stream.write_text("\n".join(lines) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tegrastats"  # prints the lines, then idles like the real one until terminated
    fake.write_text(f"#!/bin/sh\necho \"$@\" > '{tmp_path / 'args.txt'}'\ncat '{stream}'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    stamps = iter([10.0, 10.5, 11.0])
    monkeypatch.setattr(profiling, "time", SimpleNamespace(perf_counter=lambda: next(stamps)))

    with TegrastatsSampler(interval_ms=250) as ts:
        deadline = time.monotonic() + 20
        while len(ts.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert ts._proc.returncode is not None  # terminated on exit, not left running
    assert (tmp_path / "args.txt").read_text().split() == ["--interval", "250"]
    assert [t for t, _ in ts.samples] == [10.0, 10.5, 11.0]

    s = ts.summary(tokens=50)
    assert s["available"] is True and s["samples"] == 3
    assert s["emc_pct_mean"] == pytest.approx((0 + 87) / 2)  # the third line has no EMC_FREQ: left out, not 0
    assert s["power_mw_mean"] == pytest.approx({"VDD_IN": (4462 + 9876 + 4523) / 3,
                                                "VDD_CPU_GPU_CV": (480 + 3954 + 524) / 3,
                                                "VDD_SOC": (1400 + 2411 + 1373) / 3})
    # energy on the board input rail VDD_IN, trapezoids over the two 0.5 s intervals:
    # (4462 + 9876) / 2 * 0.5 + (9876 + 4523) / 2 * 0.5 = 3584.5 + 3599.75 = 7184.25 mW s = 7.18425 J
    assert s["energy_rail"] == "VDD_IN"
    assert s["joules"] == pytest.approx(7.18425)
    assert s["joules_per_token"] == pytest.approx(7.18425 / 50)

"""The VLA and control-loop benchmarks run end to end (tiny random policy, one short episode each) and
write what they promise: JSON with every mode / phase, the identity check, and the PNGs."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def engines_dir(tiny_reacher_policy, tmp_path) -> Path:
    d = tmp_path / "engines"
    shutil.copytree(tiny_reacher_policy, d / "vla-reacher")
    return d


def test_bench_vla_writes_every_mode(tiny_reacher_policy, tmp_path):
    import bench_vla
    out = tmp_path / "vla.json"
    assert bench_vla.main(["--engines", str(engines_dir(tiny_reacher_policy, tmp_path)), "--episodes", "1",
                           "--gamma", "3", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["modes"]) == {"plain", "exact", "exact (draft decoder)", "exact (last chunk)", "relaxed r=2",
                               "relaxed r=5", "relaxed r=9"}
    assert r["exact_actions_identical_to_plain"] == {"exact": True, "exact (draft decoder)": True,
                                                     "exact (last chunk)": True}
    assert r["modes"]["exact"]["draft"] == "head" and r["modes"]["exact (draft decoder)"]["draft"] == "decoder"
    assert r["modes"]["plain"]["calls"] == r["modes"]["exact"]["calls"] >= 10  # 40 steps, replan every 4
    assert {"target_S1", "target_S16", "draft_decoder_S1", "draft_head_next", "encoder"} <= set(r["call_costs_ms"])
    assert r["modes"]["relaxed r=5"]["max_accepted_dev_bins"] <= 5
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_loop_writes_both_phases(tiny_reacher_policy, tmp_path):
    import bench_loop
    out = tmp_path / "loop.json"
    assert bench_loop.main(["--engines", str(engines_dir(tiny_reacher_policy, tmp_path)), "--episodes", "1",
                            "--seconds", "0.5", "--load", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for phase in ("idle", "load 1"):
        for pol in ("plain", "speculative"):
            row = r["phases"][phase][pol]  # timing itself is the bench's business; its bookkeeping is ours
            # one 0.5 s episode at 20 Hz: 10 ticks, 11 when the summed periods round just under 0.5 s
            assert 5 <= row["ticks"] <= 11, row["ticks"]
            j = row["jitter_ms"]
            assert 0 <= j["p50"] <= j["p99"] <= j["max"], j
            assert row["starved_ticks"] == row["held_ticks"] + row["stopped_ticks"] <= row["ticks"]
    assert (tmp_path / "loop-load1-speculative.trace.json").is_file()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_loop_pools_episodes_into_the_numbers_it_reports():
    """pooled() on two hand-made episodes: every number checked against the arithmetic done by hand."""
    import bench_loop
    from edgespec.robots.loop import LoopReport

    def episode(starts, actions, inference_ms):
        rep = LoopReport(hz=20.0, ticks=len(starts), tick_action=actions, inference_ms=inference_ms)
        rep.section_start_s = {k: list(starts) for k in rep.section_start_s}
        rep.sections_ms = {k: [1.0] * len(starts) for k in rep.sections_ms}
        rep.starved = sum(a != "sent" for a in actions)
        rep.held = actions.count("held")
        return rep
    # periods 50, 60, 40, 50 ms and 70, 50 ms at dt = 50 ms: jitter 0, 10, 10, 0, 20, 0 ms
    a = episode([0.0, 0.05, 0.11, 0.15, 0.20], ["held", "sent", "sent", "held", "sent"], [10.0, 30.0])
    b = episode([0.0, 0.07, 0.12], ["held", "held", "held"], [])
    out = bench_loop.pooled([a, b], [0.01, 0.05], [[{"decode_ms": 5.0}, {"decode_ms": 7.0}], []], 0.05)
    # sorted jitter 0 0 0 10 10 20: median 5; p99 at rank 4.95 -> 10 + 0.95 * 10 = 19.5
    assert out["jitter_ms"] == pytest.approx({"p50": 5.0, "p99": 19.5, "max": 20.0})
    assert out["inference_ms"] == pytest.approx({"p50": 20.0, "p99": 29.8, "max": 30.0})
    assert out["decode_ms"] == pytest.approx({"p50": 6.0, "p99": 6.98})
    assert (out["episodes"], out["ticks"], out["starved_ticks"], out["held_ticks"]) == (2, 8, 5, 5)
    # a: one start-up tick, then one held among the rest; b: never got a chunk, all start-up
    assert (out["startup_ticks"], out["starved_after_first_chunk"], out["episodes_starved_after_first_chunk"]) == (4, 1, 1)
    assert out["success_rate"] == 0.5  # 0.01 m is inside the 0.02 m radius, 0.05 m is not


def test_bench_soak_fails_safe_under_every_fault_kind(tiny_reacher_policy, tmp_path):
    """A 12 s soak with a fault about every 0.5 s: (nearly) every kind injected, every one recorded, nothing
    sent while stopped. (RSS flatness needs the full soak: bench/results/soak.json.)"""
    import bench_soak
    out = tmp_path / "soak.json"
    rc = bench_soak.main(["--engines", str(engines_dir(tiny_reacher_policy, tmp_path)), "--models",
                          str(tmp_path / "no-models"), "--seconds", "12", "--mean-gap-s", "0.1", "--run-s", "6",
                          "--stopped-s", "0.2", "--watchdog-s", "0.3", "--hold-s", "0.2", "--rss-every-s", "0.5",
                          "--warmup-s", "1", "--rss-slope-mb-min", "1e6", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"], r
    kinds = {k for k, n in r["injected"].items() if n}  # usually all 9; a loaded machine can squeeze one out
    assert len(kinds) >= 7 and {"nan", "overflow", "dropped"} <= kinds, r["injected"]
    assert r["missed"] == {k: 0 for k in bench_soak.KINDS} and r["detected"] == r["injected"]
    assert r["sent_while_stopped"] == 0 and r["resets"] >= 1 and sum(r["latched_stops"].values()) >= 1
    assert 0.5 * r["expected_ticks"] <= r["ticks"] <= r["expected_ticks"] + 2 * r["runs"]
    assert len(r["rss"]["samples"]) >= 5 and r["rss"]["max_mb"] >= r["rss"]["start_mb"] > 0

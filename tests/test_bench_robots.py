"""The VLA and control-loop benchmarks run end to end (tiny random policy, one short episode each) and
write what they promise: JSON with every mode / phase, the identity check, and the PNGs."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

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
    assert set(r["modes"]) == {"plain", "exact", "exact (draft decoder)", "relaxed r=2", "relaxed r=5", "relaxed r=9"}
    assert r["exact_actions_identical_to_plain"] == {"exact": True, "exact (draft decoder)": True}
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
            row = r["phases"][phase][pol]
            assert row["ticks"] >= 1 and row["jitter_ms"]["p99"] >= 0  # timing itself: bench, not tests
    assert (tmp_path / "loop-load1-speculative.trace.json").is_file()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

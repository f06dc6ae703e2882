"""The peers benchmark: best-of selection, one run per table, ratios that name modes and configurations.

Fast and peer-free: these build the harness's dicts by hand; no runner or peer environment is started.
"""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_peers import (SAMPLED, MixedRunsError, best_vs_best, check_same_run, markdown, plan,  # noqa: E402
                         select_best, write_report)

RUN = "run-a"
T0, T1 = 1000.0, 2000.0


def tried(config, tps, identical="6/6", status="ok"):
    if status != "ok":
        return {"status": "failed", "error": "boom", "config": config}
    return {"status": "ok", "config": config, "tokens_per_s": {"median": tps, "min": tps, "max": tps},
            "identical_prompts": identical}


def row(tps, config, run_id=RUN, started=T0 + 10, ended=T0 + 20):
    return {"status": "ok", "config": config, "tokens_per_s": {"median": tps, "min": tps - 1, "max": tps + 1},
            "ttft_ms_median": 30.0, "peak_rss_mib": 200.0, "identical_prompts": "24/24", "run_id": run_id,
            "started": started, "ended": ended}


def report(systems, sweep=None):
    system_of = {n: n.split()[0] if not n.startswith("ORT") else "ORT GenAI" for n in systems}
    return {"run": {"id": RUN, "started_epoch": T0, "ended_epoch": T1, "started": "t0", "ended": "t1",
                    "duration_min": 16.7, "command": "python bench/bench_peers.py"},
            "systems": systems, "system_of": system_of, "sweep": {"modes": sweep or {}},
            "best_vs_best": best_vs_best(systems, system_of), "ratios": {}, "method": {},
            "roofline": {"read_bandwidth_gbs": 1.0, "copy_bandwidth_gbs": 1.0, "bytes_per_token": 1e6,
                         "roofline_tokens_per_s": 300.0, "plain_share_of_roofline": {}}}


# ---- best-of selection ----------------------------------------------------------------------------------------
def test_the_fastest_configuration_is_selected():
    got = select_best([tried("k=2", 300.0), tried("k=4", 420.0), tried("k=6", 390.0)])
    assert got["config"] == "k=4" and "selection_note" not in got


def test_a_faster_configuration_whose_tokens_differ_from_edgespec_plain_is_not_selected():
    got = select_best([tried("k=2", 300.0), tried("k=4", 900.0, identical="5/6"), tried("k=6", 390.0)])
    assert got["config"] == "k=6"


def test_failed_configurations_are_skipped_and_an_all_failed_mode_has_no_best():
    assert select_best([tried("k=2", 0, status="failed"), tried("k=3", 250.0)])["config"] == "k=3"
    assert select_best([tried("k=2", 0, status="failed")]) is None


def test_when_no_configuration_matches_the_fastest_is_shown_and_flagged():
    got = select_best([tried("a", 100.0, identical="4/6"), tried("b", 200.0, identical="3/6")])
    assert got["config"] == "b" and "no configuration matched" in got["selection_note"]


# ---- one run per table ----------------------------------------------------------------------------------------
def test_rows_from_one_run_pass_the_same_run_check():
    check_same_run(report({"edgespec plain": row(250.0, "threads: edgespec default"),
                           "ORT GenAI plain": row(317.0, "threads 2")},
                          sweep={"ORT GenAI plain": [dict(tried("threads 2", 320.0), run_id=RUN, started=T0 + 1,
                                                          ended=T0 + 2)]}))


def test_a_row_from_another_run_is_refused():
    r = report({"edgespec plain": row(250.0, "threads: edgespec default"),
                "ORT GenAI plain": row(317.0, "threads 2", run_id="run-b")})
    with pytest.raises(MixedRunsError, match="'ORT GenAI plain' is from run 'run-b'"):
        check_same_run(r)


def test_a_row_measured_outside_the_run_window_is_refused():
    r = report({"edgespec plain": row(250.0, "threads: edgespec default"),
                "ORT GenAI plain": row(317.0, "threads 2", started=T0 - 500, ended=T0 - 400)})
    with pytest.raises(MixedRunsError, match="outside this run's window"):
        check_same_run(r)


def test_a_sweep_entry_from_another_run_is_refused():
    r = report({"edgespec plain": row(250.0, "threads: edgespec default")},
               sweep={"ORT GenAI ngram": [dict(tried("k=4", 480.0), run_id="run-b", started=T0 + 1, ended=T0 + 2)]})
    with pytest.raises(MixedRunsError, match="sweep 'ORT GenAI ngram' 'k=4' is from run 'run-b'"):
        check_same_run(r)


def test_a_merged_table_is_never_written(tmp_path):
    r = report({"edgespec plain": row(250.0, "threads: edgespec default"),
                "ORT GenAI plain": row(317.0, "threads 2", run_id="run-b")})
    with pytest.raises(MixedRunsError):
        write_report(r, tmp_path / "peers.json")
    assert list(tmp_path.iterdir()) == []


# ---- ratios name modes and configurations ---------------------------------------------------------------------
def test_best_against_best_names_each_side_mode_and_configuration():
    systems = {"edgespec plain": row(250.0, "threads: edgespec default"),
               "edgespec draft": row(513.0, "γ=5"),
               "ORT GenAI plain": row(317.0, "threads 2"),
               "ORT GenAI ngram": row(471.0, "k=4, ngram_size=3, threads 2"),
               "HF assisted": row(103.0, "γ=4 (constant)"),
               SAMPLED: row(900.0, "γ=5")}  # sampled: never in the greedy comparison
    r = report(systems)
    texts = [b["text"] for b in r["best_vs_best"]]
    assert texts == ["edgespec draft γ=5 (513 tok/s) vs ORT GenAI ngram k=4, ngram_size=3, threads 2 (471 tok/s): "
                     "1.09×",
                     "edgespec draft γ=5 (513 tok/s) vs HF assisted γ=4 (constant) (103 tok/s): 4.98×"]
    md = markdown(r)
    assert "**Best against best**" in md and texts[0] in md


def test_a_faster_peer_mode_gives_a_ratio_below_one():
    systems = {"edgespec ngram": row(414.0, "γ=4, max_ngram=3"), "ORT GenAI ngram": row(471.0, "k=4"),
               "ORT GenAI draft (GenAI's default threads)": row(520.0, "k=5, GenAI's default threads")}
    (b,) = best_vs_best(systems, report(systems)["system_of"])
    assert b["peer"] == "ORT GenAI draft (GenAI's default threads)" and b["text"].endswith("0.80×")


# ---- the plan ------------------------------------------------------------------------------------------------
def test_genai_draft_is_tried_with_its_default_threads_and_with_edgespecs(monkeypatch):
    pytest.importorskip("onnxruntime", reason="edgespec.generate needs onnxruntime (a runtime dependency)")
    from edgespec.generate import DRAFT_THREADS
    monkeypatch.setenv("EDGESPEC_THREADS", "2")  # edgespec's target threads (conftest pins 1 for the tests)
    args = argparse.Namespace(gammas="2,3,4,5,6", max_ngrams="2,3,4", genai_ngram_sizes="2,3,4",
                              genai_chained="off,on", hf_lookup_ngrams="2,3", modes=None)
    modes = {m.name: m for m in plan(args)}
    default = modes["ORT GenAI draft (GenAI's default threads)"].configs
    ours = modes["ORT GenAI draft (edgespec's threads)"].configs
    assert [c.argv[c.argv.index("--gamma") + 1] for c in default] == ["2", "3", "4", "5", "6", "6"]
    assert all(c.argv[-4:] == ("--threads", "0", "--draft-threads", "0") for c in default)
    assert all(c.argv[-4:] == ("--threads", "2", "--draft-threads", str(DRAFT_THREADS)) for c in ours)
    assert [c.label for c in modes["edgespec draft"].configs] == ["γ=2", "γ=3", "γ=4", "γ=5", "γ=6", "γ=auto"]
    assert len(modes["edgespec ngram"].configs) == 18 and len(modes["ORT GenAI ngram"].configs) == 72

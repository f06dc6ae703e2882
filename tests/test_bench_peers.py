"""The peers benchmark: best-of selection, one run per table, ratios that name modes and configurations.

Fast and peer-free: these build the harness's dicts by hand; no runner or peer environment is started.
"""
import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_peers import (ROOT, SAMPLED, MixedRunsError, _builds, best_vs_best, check_same_run,  # noqa: E402
                         chunk_indices, chunk_tps, edgespec_runner, head_to_head_pairs, markdown, mode_ratios,
                         paired_summary, plan, predicted_vs_measured, runoff_candidates, select_best, sweep_score,
                         write_report)

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


def test_the_runoff_takes_the_fastest_matching_configurations_and_selects_by_the_median_of_three():
    """k=4 won its sweep slot (900) but ran at 500 and 520 in the runoff; k=6 ran at 600, 610 and 640: k=6 is
    chosen (median 610 against 520). A configuration outside the runoff never is, however fast its sweep slot
    looked; a runoff pass whose tokens differed rules a configuration out."""
    ts = [tried("k=2", 300.0), tried("k=4", 900.0), tried("k=5", 950.0, identical="5/6"), tried("k=6", 600.0),
          tried("k=8", 580.0), tried("k=3", 0, status="failed")]
    assert runoff_candidates(ts, 3) == ["k=4", "k=6", "k=8"] and runoff_candidates(ts, 1) == []
    ts[1].update(runoff_tokens_per_s=[500.0, 520.0], runoff_identical=[True, True])
    ts[3].update(runoff_tokens_per_s=[610.0, 640.0], runoff_identical=[True, True])
    ts[4].update(runoff_tokens_per_s=[None, 700.0], runoff_identical=[False, True])
    assert sweep_score(ts[1]) == 520.0 and sweep_score(ts[3]) == 610.0 and sweep_score(ts[4]) == 640.0
    assert select_best(ts)["config"] == "k=6"
    r = dict(report({"edgespec draft": row(600.0, "k=6")}, sweep={"edgespec draft": ts}), prompts={"count": 24},
             method={"sweep_prompt_indices": [0, 5], "selection": "by the median", "runoff": 3})
    md = markdown(r)
    assert "once each, then each mode's 3 fastest twice more (runoff); by the median" in md
    assert "| edgespec draft | k=4 | 900.0 (runoff 500.0, 520.0; median 520.0) |" in md
    assert "| edgespec draft | k=8 | 580.0 (runoff failed, 700.0; median 640.0) | – | 6/6, differed in the runoff |" in md


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
SWEEP = dict(gammas="2,3,4,5,6", max_ngrams="2,3,4", genai_ngram_sizes="2,3,4", genai_chained="off,on",
             hf_lookup_ngrams="2,3", modes=None, lookup_gammas="4,5,6,8,auto", lookups="2,3",
             lookup_lengths="0,12,16",
             genai_draft_ks="2,3,4,5,6,8", genai_adaptive_ks="4,6,8", genai_min_adaptive_k="1,2",
             genai_draft_precisions="fp32,int8", edgespec_providers="cpu,cpu-native")  # bench_peers.py's defaults


def _plan(monkeypatch, **over):
    pytest.importorskip("onnxruntime", reason="edgespec.generate needs onnxruntime (a runtime dependency)")
    monkeypatch.setenv("EDGESPEC_THREADS", "2")  # edgespec's target threads (conftest pins 1 for the tests)
    return {m.name: m for m in plan(argparse.Namespace(**{**SWEEP, **over}))}


def _opt(c, flag, default=None):
    return c.argv[c.argv.index(flag) + 1] if flag in c.argv else default


def test_genai_draft_is_tried_with_its_default_threads_and_with_edgespecs(monkeypatch):
    from edgespec.generate import DRAFT_THREADS
    modes = _plan(monkeypatch)
    default = modes["ORT GenAI draft (GenAI's default threads)"].configs
    ours = modes["ORT GenAI draft (edgespec's threads)"].configs
    per_precision = ["2", "3", "4", "5", "6", "8"] + ["4", "6", "8"] * 2  # fixed k, then adaptive 1..K, 2..K
    assert [_opt(c, "--gamma") for c in default] == per_precision * 2
    assert all(c.argv[-4:] == ("--threads", "0", "--draft-threads", "0") for c in default)
    assert all(c.argv[-4:] == ("--threads", "2", "--draft-threads", str(DRAFT_THREADS)) for c in ours)
    assert [c.label for c in modes["edgespec draft"].configs] == [f"γ={g}, int8 draft{p}" for p in ("", ", cpu-native")
                                                                  for g in ("2", "3", "4", "5", "6", "auto")]
    assert [_opt(c, "--provider") for c in modes["edgespec draft"].configs] == ["cpu"] * 6 + ["cpu-native"] * 6
    assert len(modes["edgespec ngram"].configs) == 36 and len(modes["ORT GenAI ngram"].configs) == 72
    assert _opt(modes["edgespec plain native"].configs[0], "--provider") == "cpu-native"
    assert _opt(modes["edgespec plain"].configs[0], "--provider") is None  # the runner's default: cpu


def test_genai_draft_is_swept_over_draft_precision_and_adaptive_k_and_its_label_says_both(monkeypatch):
    ours = _plan(monkeypatch)["ORT GenAI draft (edgespec's threads)"].configs
    got = {(_opt(c, "--draft-precision"), _opt(c, "--gamma"), _opt(c, "--min-adaptive-k", "0")) for c in ours}
    assert got == {(p, k, "0") for p in ("fp32", "int8") for k in ("2", "3", "4", "5", "6", "8")} | \
        {(p, k, m) for p in ("fp32", "int8") for k in ("4", "6", "8") for m in ("1", "2")}
    assert len(ours) == len(got) == 24
    for c in ours:  # the configuration column names the draft precision and fixed or adaptive k
        p, k, m = _opt(c, "--draft-precision"), _opt(c, "--gamma"), _opt(c, "--min-adaptive-k")
        assert f"{p} draft" in c.label
        assert (f"adaptive k {m}..{k}" if m else f"k={k},") in c.label
    assert "k=6, int8 draft, edgespec's threads: target 2, draft 1" in [c.label for c in ours]
    # min_adaptive_k must be below K: no "adaptive k 4..4"
    narrow = _plan(monkeypatch, genai_adaptive_ks="4", genai_min_adaptive_k="4,2")
    assert [c.label.split(",")[0] for c in narrow["ORT GenAI draft (edgespec's threads)"].configs
            if "adaptive" in c.label] == ["adaptive k 2..4"] * 2


def test_edgespec_draft_plus_lookup_sweeps_gamma_by_lookup(monkeypatch):
    modes = _plan(monkeypatch)
    cfgs = modes["edgespec draft+lookup"].configs
    assert modes["edgespec draft+lookup"].system == "edgespec" and modes["edgespec draft+lookup"].runner == "edgespec"
    assert [(_opt(c, "--gamma"), _opt(c, "--lookup"), _opt(c, "--lookup-gamma"), _opt(c, "--provider")) for c in cfgs] == \
        [(g, n, L, p) for p in ("cpu", "cpu-native") for L in (None, "12", "16") for n in ("2", "3")
         for g in ("4", "5", "6", "8", "auto")]
    assert all(c.argv[:2] == ("--mode", "draft") for c in cfgs)
    assert cfgs[0].label == "γ=4, lookup=2, int8 draft"
    assert cfgs[-1].label == "γ=auto, lookup=3, lookup γ=16, int8 draft, cpu-native"
    assert not any("--lookup" in c.argv for n, m in modes.items() if n != "edgespec draft+lookup" for c in m.configs)
    assert "edgespec draft+lookup" in _plan(monkeypatch, modes="edgespec draft+lookup")


# ---- the edgespec runner ---------------------------------------------------------------------------------------
class _Stats:
    new_tokens, drafted, accepted, rounds, rejections, host_fraction = 3, 4, 3, 1, 1, 0.1
    time_s = {"decode": 0.01, "prefill": 0.002}
    tokens_per_second = 300.0


class _Gen:
    cost = None

    def generate(self, prompt, **kw):
        return argparse.Namespace(token_ids=[5, 6, 7], stats=_Stats())

    def measure_costs(self):
        pass


def _run_edgespec(monkeypatch, capsys, tmp_path, load, **over):
    pytest.importorskip("onnxruntime", reason="edgespec needs onnxruntime (a runtime dependency)")
    import edgespec
    import edgespec.export.bundled
    monkeypatch.setattr(edgespec.export.bundled, "ensure_demo_engines", lambda models, engines: ("TARGET", "DRAFT"))
    monkeypatch.setattr(edgespec, "load", load)
    (tmp_path / "p.json").write_text(json.dumps(["a", "b"]))
    args = argparse.Namespace(**{**dict(engines=tmp_path, prompts=tmp_path / "p.json", mode="draft", gamma="5",
                                        max_ngram=None, lookup=None, lookup_gamma=None, max_new_tokens=8,
                                        temperature=0.0, repeats=1, provider="cpu"),
                                 **over})
    edgespec_runner(args)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_edgespec_runner_passes_lookup_to_load_only_when_asked(monkeypatch, capsys, tmp_path):
    calls = []

    def load(target, draft=None, gamma="auto", **kw):
        calls.append(dict(target=target, draft=draft, gamma=gamma, **kw))
        return _Gen()

    out = _run_edgespec(monkeypatch, capsys, tmp_path, load, lookup=3)
    assert calls[-1] == {"target": "TARGET", "draft": "DRAFT", "gamma": 5, "lookup": 3, "provider": "cpu"}
    assert out["mode"] == "draft+lookup" and out["config"]["lookup"] == 3 and len(out["results"]) == 2
    out = _run_edgespec(monkeypatch, capsys, tmp_path, load, lookup=3, lookup_gamma=12)
    assert calls[-1] == {"target": "TARGET", "draft": "DRAFT", "gamma": 5, "lookup": 3, "lookup_gamma": 12,
                         "provider": "cpu"}
    assert out["config"]["lookup_gamma"] == 12
    with pytest.raises(SystemExit, match="--lookup-gamma goes with --lookup"):
        _run_edgespec(monkeypatch, capsys, tmp_path, load, lookup_gamma=12)
    out = _run_edgespec(monkeypatch, capsys, tmp_path, load)  # plain draft mode: no lookup keyword at all
    assert calls[-1] == {"target": "TARGET", "draft": "DRAFT", "gamma": 5, "provider": "cpu"}
    out = _run_edgespec(monkeypatch, capsys, tmp_path, load, provider="cpu-native")  # the target's provider
    assert calls[-1]["provider"] == "cpu-native" and out["config"]["provider"] == "cpu-native"
    assert out["mode"] == "draft" and out["config"]["lookup"] is None


def test_the_edgespec_runner_takes_explicit_engine_folders_and_threads(monkeypatch, capsys, tmp_path):
    calls = []

    def load(target, draft=None, gamma="auto", **kw):
        calls.append(dict(target=target, draft=draft, gamma=gamma, **kw))
        return _Gen()

    eng = dict(target_engine=tmp_path / "t-int4", draft_engine=tmp_path / "d-int8")
    out = _run_edgespec(monkeypatch, capsys, tmp_path, load, threads=1, **eng)  # not the demo's folders
    assert calls[-1] == {"target": tmp_path / "t-int4", "draft": tmp_path / "d-int8", "gamma": 5, "provider": "cpu",
                         "threads": 1}
    assert out["config"]["threads"] == 1
    _run_edgespec(monkeypatch, capsys, tmp_path, load, mode="plain", **eng)
    assert calls[-1] == {"target": tmp_path / "t-int4", "draft": None, "gamma": "auto", "provider": "cpu"}
    with pytest.raises(SystemExit, match="--mode draft needs a draft engine"):
        _run_edgespec(monkeypatch, capsys, tmp_path, load, target_engine=tmp_path / "t-int4", draft_engine=None)
    measured = []
    monkeypatch.setattr(_Gen, "measure_costs", lambda self: measured.append(1))
    _run_edgespec(monkeypatch, capsys, tmp_path, load, **eng)  # fixed γ: costs measured after, for the prediction
    _run_edgespec(monkeypatch, capsys, tmp_path, load, no_cost_model=True, **eng)  # bench_realsize: not
    assert measured == [1]


def test_an_edgespec_without_load_lookup_fails_the_mode_with_the_reason(monkeypatch, capsys, tmp_path):
    def load(target, draft=None, gamma="auto", max_ngram=None):  # the signature before lookup= existed
        return _Gen()

    out = _run_edgespec(monkeypatch, capsys, tmp_path, load, lookup=2)
    assert "does not take lookup=" in out["error"] and "lookup" in out["error"]
    assert out["mode"] == "draft+lookup"


# ---- the report names the new mode, the draft builds and the configurations -----------------------------------
def test_draft_plus_lookup_is_in_the_ratios_the_table_and_best_against_best():
    systems = {"edgespec plain": row(250.0, "threads: edgespec default"),
               "edgespec draft": row(513.0, "γ=5, int8 draft"),
               "edgespec draft+lookup": row(560.0, "γ=6, lookup=2, int8 draft"),
               "ORT GenAI plain": row(317.0, "threads 2"),
               "ORT GenAI draft (edgespec's threads)": dict(
                   row(550.0, "adaptive k 2..8, int8 draft, edgespec's threads: target 2, draft 1"),
                   builds={"target": ".venv-genai/bin/python -m onnxruntime_genai.models.builder -p fp32",
                           "draft": ".venv-genai/bin/python -m onnxruntime_genai.models.builder -p int8 "
                                    "--extra_options block_size=32 accuracy_level=4 is_symmetric=false"})}
    r = report(systems)
    (b,) = r["best_vs_best"]
    assert b["edgespec"] == "edgespec draft+lookup" and b["peer_config"].startswith("adaptive k 2..8, int8 draft")
    r["method"] = {"sweep_prompt_indices": [0], "selection": "fastest", "configurations": "GenAI: fp32 and int8 drafts"}
    r["prompts"] = {"count": 24}
    r["sweep"] = {"modes": {"edgespec draft+lookup": [tried("γ=6, lookup=2, int8 draft", 560.0)]}}
    md = markdown(r)
    assert "| edgespec draft+lookup | 560.0" in md and "γ=6, lookup=2, int8 draft" in md
    assert "draft `.venv-genai/bin/python -m onnxruntime_genai.models.builder -p int8 --extra_options" in md
    assert "GenAI: fp32 and int8 drafts" in md
    ratios = mode_ratios(systems)
    assert ratios["edgespec draft+lookup / edgespec plain"] == pytest.approx(560 / 250)
    assert ratios["edgespec draft+lookup / ORT GenAI draft (edgespec's threads)"] == pytest.approx(560 / 550)


def test_a_genai_rows_builds_are_its_exact_builder_commands_without_machine_paths():
    cmd = (f"{ROOT}/.venv-genai/bin/python -m onnxruntime_genai.models.builder -i {ROOT}/models/demo-draft "
           f"-o {ROOT}/.cache/peers/genai/demo-draft-int8-abc.partial -p int8 -e cpu -c {ROOT}/.cache/peers/genai/"
           "builder_cache --extra_options block_size=32 accuracy_level=4 is_symmetric=false")
    out = {"config": {"builds": {"draft": {"builder_command": cmd}}}, "results": []}
    assert _builds(out) == {"draft": cmd.replace(f"{ROOT}/", "")}
    assert str(ROOT) not in _builds(out)["draft"]
    assert _builds({"results": []}) is None and _builds({"error": "x", "config": out["config"]}) is None


# ---- head to head ----------------------------------------------------------------------------------------------
def test_head_to_head_pairs_are_the_targets_comparisons():
    systems = {"edgespec plain": row(250.0, "threads: edgespec default"), "edgespec draft": row(513.0, "γ=5"),
               "edgespec draft+lookup": row(600.0, "γ=5, lookup=3"), "ORT GenAI plain": row(240.0, "threads 2"),
               "ORT GenAI ngram": row(471.0, "k=4"), "ORT GenAI draft (edgespec's threads)": row(520.0, "k=4"),
               "HF assisted": row(103.0, "γ=4 (constant)"), SAMPLED: row(900.0, "γ=5")}
    r = report(systems)
    assert head_to_head_pairs(systems, r["system_of"]) == [
        ("edgespec draft+lookup", "ORT GenAI draft (edgespec's threads)"), ("edgespec plain", "ORT GenAI plain"),
        ("edgespec draft", "edgespec plain")]
    systems["ORT GenAI plain"] = {"status": "failed", "error": "boom"}
    assert head_to_head_pairs(systems, r["system_of"]) == [
        ("edgespec draft+lookup", "ORT GenAI draft (edgespec's threads)"), ("edgespec draft", "edgespec plain")]
    systems["edgespec draft"] = {"status": "failed", "error": "boom"}
    assert head_to_head_pairs(systems, r["system_of"]) == [
        ("edgespec draft+lookup", "ORT GenAI draft (edgespec's threads)")]


def test_prompt_chunks_interleave_and_cover_every_prompt_once():
    got = chunk_indices(10, 4)
    assert got == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert sorted(i for c in got for i in c) == list(range(10))
    with pytest.raises(ValueError, match="chunks <= prompts"):
        chunk_indices(3, 4)


def test_a_trials_ratio_is_total_tokens_over_total_decode_time_and_failures_are_counted_not_used():
    out = {"results": [{"new_tokens": 100, "decode_s": 0.5}, {"new_tokens": 50, "decode_s": 0.25}]}
    assert chunk_tps(out) == pytest.approx(200.0)
    assert chunk_tps({"error": "boom"}) is None
    trials = [{"a_tokens_per_s": a, "b_tokens_per_s": b} for a, b in
              [(600.0, 500.0), (660.0, 500.0), (400.0, 500.0), (None, 500.0), (700.0, 500.0)]]
    h = paired_summary("A", "B", trials)
    assert h["failed_trials"] == 1 and h["trials_ok"] == 4 and h["trials_a_faster"] == 3
    assert h["ratio_median"] == pytest.approx((1.2 + 1.32) / 2) and h["ratio_min"] == pytest.approx(0.8)
    assert h["ratio_max"] == pytest.approx(1.4) and h["b_tokens_per_s_median"] == 500.0
    assert "ratio_median" not in paired_summary("A", "B", [{"a_tokens_per_s": None, "b_tokens_per_s": 1.0}])


def _with_head_to_head(trial_run=RUN, started=T0 + 30):
    r = report({"edgespec plain": row(250.0, "threads: edgespec default"), "ORT GenAI plain": row(240.0, "threads 2")})
    trial = {"a_tokens_per_s": 260.0, "b_tokens_per_s": 240.0, "run_id": trial_run, "started": started,
             "ended": started + 5}
    r["head_to_head"] = [dict(paired_summary("edgespec plain", "ORT GenAI plain", [trial] * 4),
                              a_config="threads: edgespec default", b_config="threads 2")]
    r["method"] = {"head_to_head": {"rounds": 2, "chunks": [[0, 2], [1, 3]]}}
    return r


def test_head_to_head_is_in_the_summary_and_under_the_same_run_rule():
    r = _with_head_to_head()
    check_same_run(r)
    md = markdown(r)
    assert "**Head to head**" in md and "2 rounds × 2 prompt chunks" in md
    assert "edgespec plain threads: edgespec default vs ORT GenAI plain threads 2: **1.08×**" in md
    with pytest.raises(MixedRunsError, match="head to head 'edgespec plain' vs 'ORT GenAI plain' trial 0 is from"):
        check_same_run(_with_head_to_head(trial_run="run-b"))
    with pytest.raises(MixedRunsError, match="outside this run's window"):
        check_same_run(_with_head_to_head(started=T1 + 10))


def test_predicted_vs_measured_takes_the_paired_speedup_when_the_head_to_head_ran_it():
    """α = 3 / (3 + 1) over repeat 0 only, γ = 12 drafts / 4 rounds = 3; predicted = E[tokens](0.75, 3) /
    (3 · 0.5 / 2 + 3 / 2) = 2.734375 / 2.25; measured from the final rows (600 / 300) and from the paired
    trials' median (1.8), and both printed."""
    ed = {"cost_model": {"t_draft_ms": 0.5, "t_verify_ms": [2.0, 2.2, 2.5, 3.0]},
          "results": [{"repeat": 0, "accepted": 3, "rejections": 1, "drafted": 12, "rounds": 4},
                      {"repeat": 1, "accepted": 0, "rejections": 9, "drafted": 90, "rounds": 9}]}
    systems = {"edgespec plain": row(300.0, "threads: edgespec default"), "edgespec draft": row(600.0, "γ=3")}
    h2h = [{"a": "edgespec plain", "b": "ORT GenAI plain", "ratio_median": 1.1},
           {"a": "edgespec draft", "b": "edgespec plain", "ratio_median": 1.8}]
    got = predicted_vs_measured(ed, systems, h2h)
    assert got["alpha"] == 0.75 and got["mean_gamma"] == 3
    assert got["predicted_speedup"] == pytest.approx(2.734375 / 2.25)
    assert got["measured_speedup"] == 2.0 and got["measured_speedup_head_to_head"] == 1.8
    assert predicted_vs_measured(ed, systems)["measured_speedup_head_to_head"] is None
    r = dict(report(systems), edgespec_predicted_vs_measured=got)
    assert "measured 2.00x (final medians), 1.80x head to head (148% of predicted)" in markdown(r)
    # a draft row on provider cpu-native is measured against plain decoding on cpu-native, its own target
    systems.update({"edgespec draft": row(900.0, "γ=3, int8 draft, cpu-native"),
                    "edgespec plain native": row(450.0, "provider cpu-native: float16 weights, float32 math")})
    h2h.append({"a": "edgespec draft", "b": "edgespec plain native", "ratio_median": 1.9})
    got = predicted_vs_measured(ed, systems, h2h)
    assert got["plain"] == "edgespec plain native" and got["measured_speedup"] == 2.0
    assert got["measured_speedup_head_to_head"] == 1.9
    assert "predicted speedup over edgespec plain native" in markdown(dict(report(systems),
                                                                            edgespec_predicted_vs_measured=got))
    # the per-round costs the cost model measured count too: E = 2.734375 tokens per round of
    # 0.25 + 0.75 + 3 · 0.5 + 3 = 5.5 ms, against (0.25 + 2) ms per plain token
    ed["cost_model"].update(t_round_ms=0.25, t_draft_round_ms=0.75)
    got = predicted_vs_measured(ed, systems, h2h)
    assert got["predicted_speedup"] == pytest.approx(2.734375 * 2.25 / 5.5)
    assert got["predicted_speedup_paper"] == pytest.approx(2.734375 / 2.25)
    assert got["cost_model_ms"]["t_draft_round_ms"] == 0.75
    md = markdown(dict(report(systems), edgespec_predicted_vs_measured=got))
    assert "1.12x from every measured cost (1.22x from draft and verify calls alone, the paper's formula)" in md
    assert ("edgespec draft", "edgespec plain native") in head_to_head_pairs(systems, report(systems)["system_of"])
    assert mode_ratios(systems)["edgespec draft / edgespec plain native"] == 2.0


# ---- llama.cpp ---------------------------------------------------------------------------------------------------
def test_llamacpp_has_a_plain_draft_and_lookup_mode_per_precision_each_swept(monkeypatch):
    modes = _plan(monkeypatch)  # a Namespace without the llama.cpp options: bench_peers' defaults
    names = [n for n in modes if n.startswith("llama.cpp")]
    assert names == [f"llama.cpp {k} {p}" for p in ("f16", "q8_0", "q4_0") for k in ("plain", "draft", "lookup")]
    assert all(modes[n].system == "llama.cpp" and modes[n].runner == "llamacpp" for n in names)
    plain = modes["llama.cpp plain q8_0"].configs
    assert [c.label for c in plain] == ["q8_0, threads 1", "q8_0, threads 2"]
    assert [c.argv for c in plain] == [("--mode", "plain", "--precision", "q8_0", "--threads", t) for t in ("1", "2")]
    draft = modes["llama.cpp draft f16"].configs
    got = {(_opt(c, "--draft-max"), _opt(c, "--draft-p-min"), _opt(c, "--threads"), _opt(c, "--draft-threads", "0"),
            _opt(c, "--draft-precision")) for c in draft}
    assert got == {(k, pm, t, d, "f16") for k in ("2", "3", "4", "6", "8") for pm in ("0", "0.75")
                   for t, d in (("1", "0"), ("2", "0"), ("2", "1"))}
    assert len(draft) == len(got) == 30 and all(c.argv[:4] == ("--mode", "draft", "--precision", "f16") for c in draft)
    assert "draft max 4, p_min 0.75, f16 draft, threads 2, draft threads 1" in [c.label for c in draft]
    lookup = modes["llama.cpp lookup q4_0"].configs
    assert len(lookup) == 2 * (9 + 1)
    assert lookup[0].label == "ngram-simple n=2, draft 4, threads 1"
    assert lookup[0].argv == ("--mode", "lookup", "--precision", "q4_0", "--lookup-type", "ngram-simple",
                              "--ngram-size", "2", "--lookup-max", "4", "--threads", "1")
    assert lookup[-1].argv == ("--mode", "lookup", "--precision", "q4_0", "--lookup-type", "ngram-cache",
                               "--threads", "2")


def test_llamacpp_repack_sweeps_every_mode_with_and_without_it(monkeypatch):
    narrow = dict(llamacpp_precisions="q4_0", llamacpp_threads="2", llamacpp_draft_threads="0",
                  llamacpp_draft_ks="4", llamacpp_draft_p_mins="0", llamacpp_draft_precisions="same",
                  llamacpp_lookup_types="ngram-cache")
    on = _plan(monkeypatch, **narrow)  # the default: repacking on, no --no-repack anywhere
    assert not any("--no-repack" in c.argv for n, m in on.items() if n.startswith("llama.cpp") for c in m.configs)
    both = _plan(monkeypatch, llamacpp_repack="on,off", **narrow)
    for kind in ("plain", "draft", "lookup"):
        cs = both[f"llama.cpp {kind} q4_0"].configs
        assert len(cs) == 2 and "--no-repack" not in cs[0].argv and cs[1].argv == cs[0].argv + ("--no-repack",)
        assert cs[1].label == cs[0].label + ", no repack"
    with pytest.raises(SystemExit, match="expected on and/or off"):
        _plan(monkeypatch, llamacpp_repack="yes", **narrow)


def test_llamacpp_sweep_options_narrow_it_and_none_leaves_it_out(monkeypatch):
    modes = _plan(monkeypatch, llamacpp_precisions="q4_0", llamacpp_threads="2", llamacpp_draft_threads="0",
                  llamacpp_draft_ks="4", llamacpp_draft_p_mins="0", llamacpp_draft_precisions="same,q8_0",
                  llamacpp_lookup_types="ngram-simple", llamacpp_ngram_sizes="3", llamacpp_lookup_lengths="8")
    assert [n for n in modes if n.startswith("llama.cpp")] == ["llama.cpp plain q4_0", "llama.cpp draft q4_0",
                                                              "llama.cpp lookup q4_0"]
    assert [c.label for c in modes["llama.cpp draft q4_0"].configs] == [
        "draft max 4, p_min 0, q4_0 draft, threads 2", "draft max 4, p_min 0, q8_0 draft, threads 2"]
    assert [c.label for c in modes["llama.cpp lookup q4_0"].configs] == ["ngram-simple n=3, draft 8, threads 2"]
    assert not any(n.startswith("llama.cpp") for n in _plan(monkeypatch, llamacpp_precisions="none"))
    only = _plan(monkeypatch, modes="llama.cpp draft f16")
    assert set(only) == {"edgespec plain", "llama.cpp draft f16"}


def test_llamacpp_rows_are_summarised_compared_and_their_conversions_listed():
    from bench_peers import summarize
    ref = {"results": [{"prompt_index": i, "repeat": 0, "token_ids": [1, 2, 3]} for i in range(2)]}
    out = {"system": "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)", "peak_rss_bytes": 2 ** 20,
           "speculative_stats": {"draft_tokens_proposed": 40, "draft_tokens_accepted": 30},
           "results": [{"prompt_index": i, "repeat": 0, "token_ids": t, "new_tokens": 3, "decode_s": 0.01,
                        "ttft_s": 0.002} for i, t in enumerate(([1, 2, 3], [1, 2, 4]))]}
    s = summarize(out, ref, 2)
    assert s["status"] == "ok" and s["acceptance_rate"] == 0.75 and s["identical_prompts"] == "1/2"
    assert s["token_agreement_with_edgespec"] == pytest.approx((1 + 2 / 3) / 2)
    assert s["tokens_per_s"]["median"] == pytest.approx(300.0)
    cmd = (f".venv-llamacpp/bin/python -c '<CONVERT_WRAPPER>' {ROOT}/.cache/llamacpp/src/vendor/llama.cpp "
           f"{ROOT}/models/demo-target --outtype f16 --outfile x-f16.gguf && {ROOT}/bin/llama-quantize x-f16.gguf "
           "x-q4_0.gguf Q4_0")
    builds = _builds({"config": {"builds": {"target": {"builder_command": cmd}}}, "results": []})
    assert str(ROOT) not in builds["target"]
    systems = {"edgespec plain": row(250.0, "threads: edgespec default"),
               "edgespec plain native": row(300.0, "provider cpu-native: float16 weights, float32 math"),
               "edgespec draft": row(500.0, "γ=5"),
               "llama.cpp plain f16": row(200.0, "f16, threads 2"),
               "llama.cpp draft f16": dict(row(400.0, "draft max 4, p_min 0, f16 draft, threads 2"), builds=builds),
               "llama.cpp lookup q4_0": row(450.0, "ngram-simple n=3, draft 8, threads 2"),
               "llama.cpp plain q4_0": row(300.0, "q4_0, threads 2")}
    ratios = mode_ratios(systems)
    assert ratios["llama.cpp draft f16 / llama.cpp plain f16"] == 2.0
    assert ratios["llama.cpp lookup q4_0 / llama.cpp plain q4_0"] == 1.5
    assert ratios["edgespec plain native / llama.cpp plain f16"] == 1.5
    assert ratios["edgespec draft / llama.cpp draft f16"] == 1.25
    r = report(systems)
    assert r["system_of"]["llama.cpp draft f16"] == "llama.cpp"
    r["system_of"] = {n: "llama.cpp" if n.startswith("llama.cpp") else "edgespec" for n in systems}
    r["best_vs_best"] = best_vs_best(systems, r["system_of"])
    (b,) = r["best_vs_best"]
    assert (b["edgespec"], b["peer"]) == ("edgespec draft", "llama.cpp lookup q4_0")
    md = markdown(r)
    assert "llama.cpp GGUF conversions of the rows above" in md and "GenAI model builds" not in md
    assert "- llama.cpp draft f16: target `.venv-llamacpp/bin/python -c '<CONVERT_WRAPPER>'" in md


def test_a_missing_llamacpp_environment_fails_its_rows_with_the_set_up_command(tmp_path):
    from bench_peers import run_system, summarize
    out = run_system("llama.cpp plain f16", [str(tmp_path / ".venv-llamacpp" / "bin" / "python"), "runner.py"], 10)
    s = summarize(out, None, 1)
    assert s["status"] == "failed" and "bash bench/setup_peers.sh" in s["error"]

"""The real-size benchmark's logic (bench/bench_realsize.py): which rows each engine folder supports and why the
others cannot run, bytes per token from engine folders, the roofline arithmetic, the issue's targets, the report
carrying unavailable rows. Fast and peer-free: no runner, peer environment or real-size model is started."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_realsize as br  # noqa: E402
from bench_peers import MixedRunsError  # noqa: E402

ROOT = br.ROOT


def args(**over):
    return br.parse_args(["--preset", "qwen2.5-0.5b"] + [x for k, v in over.items()
                                                          for x in (f"--{k.replace('_', '-')}", v)])


def folders(int8_native=None, fp16_native=None, int4_error=None):
    """What the exports give today (native weights only in the fp32 folder, fp16), or with int8 native weights."""
    why = "native weights go with fp32 ids-input engines; this one is {}, ids"
    f = {"fp16": br.Folder("fp16", ROOT / ".cache/e/x-fp16", fp16_native, None if fp16_native else why.format("fp16")),
         "int8": br.Folder("int8", ROOT / ".cache/e/x-int8", int8_native, None if int8_native else why.format("int8")),
         "int4": br.Folder("int4", ROOT / ".cache/e/x-int4", None, why.format("int4")),
         "fp32": br.Folder("fp32", ROOT / ".cache/e/x-fp32", "fp16", None)}
    if int4_error:
        f["int4"] = br.Folder("int4", error=int4_error)
    return f


DRAFT = br.Folder("int8", ROOT / ".cache/e/x-draft-int8", None, "int8 draft: no native weights")


# ---- which rows run, on which folder, and why the others do not -------------------------------------------------
def test_native_precision_reads_extra_native_weights_defaulting_to_fp16():
    assert br.native_precision({"native": {"file": "native.npz"}}) == ("fp16", None)
    assert br.native_precision({"native": {"file": "native.npz", "weights": "float16"}}) == ("fp16", None)
    assert br.native_precision({"native": {"file": "native.npz", "weights": "int4"}}) == ("int4", None)
    assert br.native_precision({"native": {"unavailable": "no C compiler"}}) == (None, "no C compiler")
    nat, why = br.native_precision({})
    assert nat is None and "no extra.native" in why


def test_every_edgespec_row_is_planned_and_the_unsupported_ones_say_why():
    rows = {r.name: r for r in br.edgespec_rows(folders(), [DRAFT], args())}
    assert len(rows) == 3 * 2 * 4  # precision x provider x kind: nothing dropped
    nat16 = rows["edgespec plain fp16 cpu-native"]
    assert nat16.unavailable is None and nat16.engine == ".cache/e/x-fp32"  # the fp32 folder's float16 copy
    assert "native weights of the fp32 folder" in nat16.mode.configs[0].label
    for prec in ("int8", "int4"):
        for kind in br.EDGESPEC_KINDS:
            r = rows[f"edgespec {kind} {prec} cpu-native"]
            assert r.mode.configs == () and f"no engine folder has {prec} native weights" in r.unavailable
            assert f"this one is {prec}" in r.unavailable and "fp32 folder's native weights are fp16" in r.unavailable
        assert rows[f"edgespec plain {prec} cpu"].engine == f".cache/e/x-{prec}"
    assert all(r.unavailable is None for n, r in rows.items() if n.endswith(" cpu"))


def test_native_int8_weights_once_exported_make_their_rows_run_on_that_folder():
    rows = {r.name: r for r in br.edgespec_rows(folders(int8_native="int8", fp16_native="fp16"), [DRAFT], args())}
    assert rows["edgespec plain int8 cpu-native"].unavailable is None
    assert rows["edgespec plain int8 cpu-native"].engine == ".cache/e/x-int8"
    assert rows["edgespec plain fp16 cpu-native"].engine == ".cache/e/x-fp16"  # its own folder before fp32's
    assert rows["edgespec ngram int4 cpu-native"].unavailable  # still none for int4


def test_a_failed_export_or_a_missing_draft_makes_rows_unavailable_with_the_error():
    rows = {r.name: r for r in br.edgespec_rows(folders(int4_error="exit 1: precision gate"), [], args())}
    assert "edgespec export --dtype int4 failed: exit 1: precision gate" in rows["edgespec plain int4 cpu"].unavailable
    assert "the int4 export failed (exit 1: precision gate)" in rows["edgespec plain int4 cpu-native"].unavailable
    for kind in ("draft", "draft+lookup"):
        assert "no draft engine" in rows[f"edgespec {kind} fp16 cpu"].unavailable
    assert rows["edgespec ngram fp16 cpu"].unavailable is None and rows["edgespec plain fp16 cpu"].unavailable is None
    bad = br.Folder("int4", error="exit 1: no space")
    rows = {r.name: r for r in br.edgespec_rows(folders(), [bad], args())}
    assert "no draft engine: int4: exit 1: no space" in rows["edgespec draft fp16 cpu"].unavailable


def test_the_draft_kinds_sweep_every_draft_precision_that_exported():
    d4 = br.Folder("int4", ROOT / ".cache/e/x-draft-int4", "int4", None)
    bad = br.Folder("fp16", error="exit 1: no space")
    rows = {r.name: r for r in br.edgespec_rows(folders(), [DRAFT, d4, bad], args(gammas="4,auto"))}
    for kind, per in (("draft", 2), ("draft+lookup", 2)):  # γ 4, auto / lookup γ 0, 16
        cfgs = rows[f"edgespec {kind} fp16 cpu-native"].mode.configs
        engines = [c.argv[c.argv.index("--draft-engine") + 1] for c in cfgs]
        assert engines == [".cache/e/x-draft-int8"] * per + [".cache/e/x-draft-int4"] * per, kind
    labels = [c.label for c in rows["edgespec draft fp16 cpu-native"].mode.configs]
    assert "int8 draft on cpu" in labels[0] and "int4 draft on cpu-native" in labels[-1]


def test_edgespec_configurations_are_the_runner_arguments_of_each_sweep_point():
    rows = {r.name: r for r in br.edgespec_rows(folders(), [DRAFT], args(plain_threads="1,2", gammas="4,auto",
                                                                       lookup_gammas="6", lookups="2,3",
                                                                       lookup_lengths="0,16"))}
    plain = rows["edgespec plain int4 cpu"].mode.configs
    assert [c.argv for c in plain] == [("--mode", "plain", "--provider", "cpu", "--target-engine", ".cache/e/x-int4",
                                        "--threads", t) for t in ("1", "2")]
    draft = rows["edgespec draft fp16 cpu-native"].mode.configs
    assert [c.argv[c.argv.index("--gamma") + 1] for c in draft] == ["4", "auto"]
    assert all(c.argv[c.argv.index("--draft-engine") + 1] == ".cache/e/x-draft-int8" for c in draft)
    assert draft[0].label.startswith("γ=4, int8 draft on cpu")  # the draft has no native weights: it runs on cpu
    look = rows["edgespec draft+lookup int8 cpu"].mode.configs
    assert len(look) == 4 and all(c.argv[:2] == ("--mode", "draft") and "--lookup" in c.argv for c in look)
    assert sum("--lookup-gamma" in c.argv for c in look) == 2
    assert all("--draft-engine" not in c.argv for c in rows["edgespec ngram int8 cpu"].mode.configs)


def test_peer_rows_follow_the_precisions_and_a_failed_build_keeps_its_rows_unavailable():
    rows = br.llamacpp_rows(args(llamacpp_threads="2"), {"q8_0": "llama.cpp q8_0 did not build: boom"})
    assert [(r.name, r.precision) for r in rows] == [(f"llama.cpp {k} {g}", p) for g, p in
                                                      (("f16", "fp16"), ("q8_0", "int8"), ("q4_0", "int4"))
                                                      for k in ("plain", "draft", "lookup")]
    for r in rows:
        assert (r.mode.configs == ()) == ("q8_0" in r.name) and bool(r.unavailable) == ("q8_0" in r.name)
    assert [r.name for r in br.llamacpp_rows(args(precisions="int4"), {})] == [
        "llama.cpp plain q4_0", "llama.cpp draft q4_0", "llama.cpp lookup q4_0"]
    lc = {r.name: r for r in br.llamacpp_rows(args(llamacpp_threads="1,2", llamacpp_spec_threads="2"), {})}
    assert [c.label for c in lc["llama.cpp plain q4_0"].mode.configs] == [  # repacking on and off by default
        "q4_0, threads 1", "q4_0, threads 2", "q4_0, threads 1, no repack", "q4_0, threads 2, no repack"]
    assert {c.argv[c.argv.index("--threads") + 1] for n in ("draft", "lookup")
            for c in lc[f"llama.cpp {n} f16"].mode.configs} == {"2"}
    # the draft GGUF's type is swept: the target's ("same") and the others named, each once
    for g, want in (("f16", ["f16", "q8_0", "q4_0"]), ("q4_0", ["q4_0", "q8_0"])):
        d = br.llamacpp_rows(args(llamacpp_draft_precisions="same,q8_0,q4_0"), {})
        got = [c.argv[c.argv.index("--draft-precision") + 1] for r in d if r.name == f"llama.cpp draft {g}"
               for c in r.mode.configs]
        # x draft max 4, 8 x p_min 0, 0.75 x repacking on, off
        assert list(dict.fromkeys(got)) == want and len(got) == len(want) * 8
    g = {r.name: r for r in br.genai_rows(args(genai_precisions="int4,fp16", genai_threads="0,2",
                                               genai_spec_threads="0,2"),
                                          {"ORT GenAI draft fp16": "did not build"})}
    assert set(g) == {f"ORT GenAI {k} {p}" for k in ("plain", "draft", "ngram") for p in ("int4", "fp16")}
    assert g["ORT GenAI draft fp16"].unavailable and g["ORT GenAI plain fp16"].mode.configs
    d = g["ORT GenAI draft int4"].mode.configs
    assert ("--draft-precision", "int4") == d[0].argv[4:6] and {c.argv[-1] for c in d} == {"0", "1"}


def test_a_missing_peer_environment_is_recorded_unavailable_with_the_set_up_command(tmp_path):
    (tmp_path / "p.json").write_text('["x"]')
    rec = br.prepare_peer("genai", "int4", [str(tmp_path / ".venv-genai" / "bin" / "python"), "runner.py"],
                          tmp_path / "p.json", 10)
    assert rec["status"] == "unavailable" and rec["rows"] == "all" and "bash bench/setup_peers.sh" in rec["error"]


def test_rows_are_ordered_by_precision_then_system_and_the_reference_is_plain_at_that_precision():
    rows = br.order_rows(br.genai_rows(args(genai_precisions="int4"), {}) + br.llamacpp_rows(args(), {})
                         + br.edgespec_rows(folders(), [DRAFT], args()))
    assert rows[0].name == "edgespec plain fp16 cpu-native" and rows[-1].name == "ORT GenAI ngram int4"
    assert [r.precision for r in rows] == sorted((r.precision for r in rows), key=br.PRECISIONS.index)
    ok = {"edgespec plain fp16 cpu-native", "edgespec plain int4 cpu"}
    assert br.reference_row("fp16", ok) == "edgespec plain fp16 cpu-native"
    assert br.reference_row("int4", ok) == "edgespec plain int4 cpu"
    assert br.reference_row("fp32", ok) == "edgespec plain fp16 cpu-native"
    assert br.reference_row("int8", ok) is None


# ---- bytes per token, the roofline ------------------------------------------------------------------------------
def test_native_bytes_per_token_are_every_array_but_the_embedding_plus_one_row(tmp_path):
    arrays = {"embed": np.zeros((4096, 96), np.float16), "lm_head": np.zeros((4096, 96), np.float16),
              "layers.0.wqkv": np.zeros((50, 96), np.int8), "layers.0.wqkv.scales": np.zeros((50, 3), np.float32),
              "norm": np.zeros(96, np.float32)}
    np.savez(tmp_path / "native.npz", **arrays)
    (tmp_path / "engine.json").write_text(json.dumps({"extra": {"native": {"file": "native.npz", "weights": "int8"}}}))
    got = br.npz_arrays(tmp_path / "native.npz")
    assert got["layers.0.wqkv.scales"] == ((50, 3), "<f4", 600) and got["embed"][2] == 4096 * 96 * 2
    w = br.weight_bytes_per_token(tmp_path, "cpu-native")
    assert w["bytes"] == 4096 * 96 * 2 + 50 * 96 + 600 + 96 * 4 + 96 * 2
    with pytest.raises(ValueError, match="weight_bytes_per_token"):
        br.weight_bytes_per_token(tmp_path, "cpu")


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """A tiny fp32 export whose shapes the native step takes (multiples of 16): native.npz and the ONNX graph."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from conftest import char_tokenizer_json
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("realsize")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(root / "ckpt", safe_serialization=True)
    char_tokenizer_json(root / "ckpt" / "tokenizer.json")
    export_engine(root / "ckpt", root / "eng", max_context=64, progress=False)
    return root / "eng"


def test_bytes_per_token_of_a_real_engine_folder(tiny_engine):
    m = json.loads((tiny_engine / "engine.json").read_text())
    ort = br.weight_bytes_per_token(tiny_engine, "cpu")
    assert ort["bytes"] == m["extra"]["weight_bytes_per_token"]["total"] > 0
    assert br.kv_bytes_per_context_token(m) == 2 * 2 * 1 * 16 * 4
    f = br.folder_info(tiny_engine, "fp32")
    if f.native is None:  # the native step could not be built here: its reason is what the row reports
        assert f.native_why
        return
    assert f.native == "fp16"
    with np.load(tiny_engine / "native.npz") as z:
        row = z["embed"][0].nbytes
        want = sum(z[k].nbytes for k in z.files if k != "embed") + row
    nat = br.weight_bytes_per_token(tiny_engine, "cpu-native")
    assert nat["bytes"] == want and nat["recorded"] == m["extra"]["native"]["weight_bytes_per_token"]


def test_roofline_share_is_tokens_times_bytes_over_bandwidth():
    r = br.roofline_share(20.0, 1e9, 25.0)
    assert r["roofline_tokens_per_s"] == pytest.approx(25.0) and r["share"] == pytest.approx(0.8)
    assert r["achieved_gbs"] == pytest.approx(20.0)
    assert br.best_bandwidth([{"1": {"gbs_best": 9.0}, "2": {"gbs_best": 14.0}},
                              {"1": {"gbs_best": 11.0}, "2": {"error": "x"}}], 1) == 11.0
    assert br.best_bandwidth([{"error": "no cc"}], 2) is None


def test_each_pass_is_judged_against_the_read_loop_right_beside_it():
    """The adjacent share: each pass's tok/s x bytes over the faster of the readings just before and after it at
    the row's thread count, the median over passes; passes without a speed or a reading are left out."""
    passes = [{"before": {"2": {"gbs_best": 30.0}}, "after": {"2": {"gbs_best": 40.0}}, "tokens_per_s": 32.0},
              {"before": {"2": {"gbs_best": 50.0}}, "after": {"2": {"error": "x"}}, "tokens_per_s": 25.0},
              {"before": {"2": {"gbs_best": 20.0}, "1": {"gbs_best": 99.0}}, "after": {}, "tokens_per_s": 18.0},
              {"before": None, "after": None, "tokens_per_s": 30.0},
              {"before": {"2": {"gbs_best": 30.0}}, "after": None, "tokens_per_s": None}]
    a = br.adjacent_share(passes, 1e9, 2)
    assert [round(p["share"], 3) for p in a["passes"]] == [0.8, 0.5, 0.9]  # 32/40, 25/50, 18/20 (not 1 thread's 99)
    assert a["share"] == pytest.approx(0.8) and a["read_gbs_median"] == pytest.approx(40.0)
    assert br.adjacent_share(passes[3:], 1e9, 2) is None
    assert br.adjacent_share([], 1e9, 2) is None


def test_the_report_names_both_shares_and_bolds_the_judged_one(tmp_path):
    systems = {"edgespec plain fp16 cpu-native": ok(50.0, "edgespec", "fp16", "plain")}
    rep = _report(systems)
    near = br.adjacent_share([{"before": {"2": {"gbs_best": 45.0}}, "after": {"2": {"gbs_best": 40.0}},
                               "tokens_per_s": 40.0}], 1e9, 2)
    rep["roofline"]["rows"]["edgespec plain fp16 cpu-native"] = dict(
        br.roofline_share(50.0, 1e9, 55.0), bytes_per_token=1e9, how="npz", threads=2, read_gbs=55.0,
        share_run_best=50.0 / 55.0, adjacent=near, share=near["share"])
    br.write_report(rep, tmp_path / "r.json")
    md = (tmp_path / "r.md").read_text()
    assert "of 55.0 (the run's best) at 2 thread(s): 91%" in md
    assert "(40.0 tok/s of 45.0 GB/s): **89%**, the share the target judges" in md


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_native_read_loop_compiles_and_measures(monkeypatch, tmp_path):
    monkeypatch.setattr(br, "WORK", tmp_path)
    got = br.read_bandwidth([1, 2], 16, 2)
    assert got["1"]["threads"] == 1 and got["2"]["threads"] == 2 and len(got["2"]["gbs"]) == 2
    assert got["1"]["gbs_best"] >= got["1"]["gbs_median"] > 0
    for g in got.values():  # each repetition's figure is the faster of its two loops
        assert g["gbs"] == [max(a, b) for a, b in zip(g["gbs_plain"], g["gbs_prefetch"])]
    words = np.arange(16 * 2 ** 20 // 8, dtype=np.uint64) ^ np.uint64(0x9e3779b97f4a7c15)
    assert got["2"]["checksum"] == int(words.sum(dtype=np.uint64)) * 4 % 2 ** 64  # every word, each loop and repetition


def test_machine_load_names_other_processes_and_load_averages():
    ld = br.machine_load(0.05)
    assert len(ld["loadavg_1_5_15"]) == 3 and ld["others_cpu_percent"] >= 0
    assert all({"pid", "name", "cpu_percent"} <= set(b) for b in ld["busiest_others"])


# ---- export caching ---------------------------------------------------------------------------------------------
def test_an_engine_folder_is_reused_only_for_the_same_checkpoint_precision_and_export_code(tmp_path):
    out = tmp_path / "x-int8"
    out.mkdir()
    (out / "engine.json").write_text(json.dumps({"source_sha256": "abc", "precision": "int8"}))
    assert "other export code" in br.reuse_reason(out, "int8", "abc", "code1")
    (tmp_path / "x-int8.export.json").write_text(json.dumps({"export_code": "code1"}))
    assert br.reuse_reason(out, "int8", "abc", "code1") is None
    assert "checkpoint changed" in br.reuse_reason(out, "int8", "abd", "code1")
    assert "int4 wanted" in br.reuse_reason(out, "int4", "abc", "code1")
    assert "other export code" in br.reuse_reason(out, "int8", "abc", "code2")
    assert br.reuse_reason(tmp_path / "none", "int8", "abc", "code1") == "not exported yet"


def test_an_attention_head_adds_head_rows_over_its_gammas_and_none_without_it():
    assert not any(" head " in r.name for r in br.edgespec_rows(folders(), [DRAFT], args()))
    rows = {r.name: r for r in br.edgespec_rows(folders(), [DRAFT], args(head=".cache/h.npz", head_gammas="6,8"))}
    assert len(rows) == 3 * 2 * 5
    head = rows["edgespec head fp16 cpu-native"]
    assert head.kind == "head" and head.engine == ".cache/e/x-fp32"
    assert [c.argv for c in head.mode.configs] == [
        ("--mode", "draft", "--provider", "cpu-native", "--target-engine", ".cache/e/x-fp32", "--draft-engine",
         ".cache/h.npz", "--gamma", g, "--threads", str(br.os.cpu_count())) for g in ("6", "8")]
    assert "no engine folder has int4 native weights" in rows["edgespec head int4 cpu-native"].unavailable
    assert [r.kind for r in br.order_rows(list(rows.values()))][:5] == ["plain", "draft", "draft+lookup", "head",
                                                                         "ngram"]


def test_a_head_of_the_stand_ins_source_is_widened_to_the_target_and_a_wider_one_refused(tmp_path, monkeypatch):
    from edgespec.attn_head import AttnHeadWeights
    from edgespec.export.training import train_attn_head as T
    rng = np.random.default_rng(0)
    embed = rng.normal(0, 1, (40, 32)).astype(np.float32)
    cfg = T.AttnHeadConfig(hidden=24, heads=2)
    T.to_weights(T.build(embed, embed.copy(), cfg), cfg).save(tmp_path / "h.npz")
    (tmp_path / "h.json").write_text(json.dumps({"command": "python -m train_attn_head --windows code",
                                                 "minutes": 19.5, "config": {"windows": "code"}}))
    monkeypatch.setattr(br, "WORK", tmp_path / "work")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"hidden_size": 64}))
    a = args(head=str(tmp_path / "h.npz"))
    rec = br.prepare_head(a, ck)
    assert rec["width"] == 32 and rec["widened_to"] == 64 and rec["windows"] == "code"
    assert Path(a.head).parent == tmp_path / "work" / "heads" and AttnHeadWeights.load(a.head).w_out.shape == (24, 64)
    same = args(head=str(tmp_path / "h.npz"))
    (ck / "config.json").write_text(json.dumps({"hidden_size": 32}))
    assert "widened_to" not in br.prepare_head(same, ck) and Path(same.head) == tmp_path / "h.npz"
    (ck / "config.json").write_text(json.dumps({"hidden_size": 16}))
    with pytest.raises(SystemExit, match="32 wide, wider than the target's hidden size 16"):
        br.prepare_head(args(head=str(tmp_path / "h.npz")), ck)
    with pytest.raises(SystemExit, match="no such file"):
        br.prepare_head(args(head=str(tmp_path / "none.npz")), ck)


def test_a_folder_without_the_hidden_output_is_not_reused_for_the_head(tmp_path):
    out = tmp_path / "x-fp16-hidden"
    out.mkdir()
    m = {"source_sha256": "abc", "precision": "fp16", "outputs": [{"name": "logits", "dtype": "float32", "shape": [1]}]}
    (out / "engine.json").write_text(json.dumps(m))
    (tmp_path / "x-fp16-hidden.export.json").write_text(json.dumps({"export_code": "c"}))
    assert br.reuse_reason(out, "fp16", "abc", "c") is None
    assert "no hidden-state output" in br.reuse_reason(out, "fp16", "abc", "c", hidden=True)
    m["outputs"].append({"name": "hidden", "dtype": "float32", "shape": [1]})
    (out / "engine.json").write_text(json.dumps(m))
    assert br.reuse_reason(out, "fp16", "abc", "c", hidden=True) is None


# ---- the targets and the report ---------------------------------------------------------------------------------
RUN = {"id": "r1", "started_epoch": 1000.0, "ended_epoch": 2000.0, "started": "t0", "ended": "t1",
       "duration_min": 16.7, "command": "python bench/bench_realsize.py --preset qwen2.5-0.5b"}


def ok(tps, system, prec, kind, identical="8/8", **kw):
    return dict({"status": "ok", "system": system, "precision": prec, "kind": kind, "run_id": "r1", "started": 1100.0,
                 "ended": 1200.0, "tokens_per_s": {"median": tps, "min": tps - 1, "max": tps + 1},
                 "ttft_ms_median": 10.0, "peak_rss_mib": 900.0, "identical_prompts": identical, "config": "c"}, **kw)


def _rows(systems):
    out = []
    for n, s in systems.items():
        parts = n.split()
        prov = parts[-1] if s["system"] == "edgespec" else None
        out.append(br.Row(br.Mode(n, s["system"], "x", ()), s["precision"], s["kind"], prov))
    return out


def test_targets_compare_best_against_best_per_precision_and_flag_differing_output():
    systems = {"edgespec plain int4 cpu": ok(100.0, "edgespec", "int4", "plain"),
               "edgespec ngram int4 cpu": ok(300.0, "edgespec", "int4", "ngram"),
               "edgespec draft int4 cpu": ok(250.0, "edgespec", "int4", "draft"),
               "llama.cpp plain q4_0": ok(120.0, "llama.cpp", "int4", "plain", "3/8"),
               "llama.cpp lookup q4_0": ok(180.0, "llama.cpp", "int4", "lookup", "2/8"),
               "ORT GenAI draft int4": ok(250.0, "ORT GenAI", "int4", "draft", "1/8"),
               "edgespec plain fp16 cpu-native": ok(50.0, "edgespec", "fp16", "plain")}
    roof = {"rows": {"edgespec plain int4 cpu": {"share": 0.9}, "edgespec plain fp16 cpu-native": {"share": 0.6}}}
    t = {x["target"]: x for x in br.targets(systems, _rows(systems), roof)}
    lc = t["int4: edgespec's fastest speculative mode >= 1.5x llama.cpp's fastest int4 mode"]
    assert (lc["a"], lc["b"], lc["met"]) == ("edgespec ngram int4 cpu", "llama.cpp lookup q4_0", True)
    assert lc["value"] == pytest.approx(300 / 180)
    ga = t["int4: edgespec's fastest speculative mode >= 1.5x ORT GenAI's fastest int4 mode"]
    assert ga["value"] == pytest.approx(1.2) and ga["met"] is False
    fp16 = t["fp16: edgespec's fastest mode >= 2x llama.cpp's fastest f16 mode"]
    assert fp16["met"] is None and "no peer row ran" in fp16["why"]
    assert t["int4: edgespec plain (cpu) >= llama.cpp plain q4_0"]["value"] == pytest.approx(100 / 120)
    assert t["edgespec plain int4 cpu >= 85% of the DRAM roofline"]["met"] is True
    assert t["edgespec plain fp16 cpu-native >= 85% of the DRAM roofline"]["met"] is False
    systems["edgespec ngram int4 cpu"]["identical_prompts"] = "7/8"  # fast, but not edgespec's own output
    lc = br.targets(systems, _rows(systems), roof)[0]
    assert lc["met"] is False and "differs from edgespec's int4 plain (7/8)" in lc["why"]


def test_a_ratio_is_judged_by_its_head_to_head_median_with_the_final_passes_beside_it(tmp_path):
    systems = {"edgespec plain fp16 cpu-native": ok(18.0, "edgespec", "fp16", "plain"),
               "llama.cpp plain f16": ok(20.0, "llama.cpp", "fp16", "plain"),
               "edgespec plain int4 cpu-native": ok(80.0, "edgespec", "int4", "plain"),
               "llama.cpp plain q4_0": ok(60.0, "llama.cpp", "int4", "plain")}
    pairs = [(c["a"], c["b"]) for c in br.comparisons(systems, _rows(systems)) if c["a"] and c["b"]]
    assert pairs == [("edgespec plain fp16 cpu-native", "llama.cpp plain f16")] * 2 + [  # fastest and plain at fp16
        ("edgespec plain int4 cpu-native", "llama.cpp plain q4_0")]
    trials = [{"a_tokens_per_s": a, "b_tokens_per_s": b} for a, b in ((25.0, 24.0), (17.0, 16.0), (21.0, 20.0),
                                                                       (10.0, None))]
    h = br.paired_summary("edgespec plain fp16 cpu-native", "llama.cpp plain f16", trials)
    paired = {"edgespec plain fp16 cpu-native | llama.cpp plain f16": h}
    t = {x["target"]: x for x in br.targets(systems, _rows(systems), {"rows": {}}, paired)}
    fp16 = t["fp16: edgespec plain (cpu-native) >= llama.cpp plain f16"]
    assert fp16["value"] == pytest.approx(21 / 20) and fp16["met"] is True and fp16["judged_by"] == "head to head"
    assert fp16["value_final_passes"] == pytest.approx(0.9) and fp16["paired"]["trials_ok"] == 3
    assert fp16["paired"]["failed_trials"] == 1
    int4 = t["int4: edgespec plain (cpu-native) >= llama.cpp plain q4_0"]  # no head to head: the final passes
    assert int4["judged_by"] == "final passes" and int4["value"] == pytest.approx(80 / 60)
    rep = dict(_report(systems), targets=list(t.values()))
    br.write_report(rep, tmp_path / "r.json")
    md = (tmp_path / "r.md").read_text()
    assert "**1.05x** head to head (median of 3 back-to-back chunks" in md and "final passes 0.90x" in md
    assert "met" in md.split("head to head (median of 3")[1].split("\n")[0]


def test_head_to_head_settings_are_checked():
    a = br.parse_args(["--preset", "qwen2.5-0.5b"])
    assert (a.paired_rounds, a.paired_chunks) == (2, 4)
    with pytest.raises(SystemExit):
        br.parse_args(["--preset", "qwen2.5-0.5b", "--paired-chunks", "9"])  # 8 prompts
    with pytest.raises(SystemExit):
        br.parse_args(["--preset", "qwen2.5-0.5b", "--paired-rounds", "-1"])
    assert br.parse_args(["--preset", "qwen2.5-0.5b", "--smoke"]).paired_chunks == 2


def _report(systems):
    return {"run": RUN, "checkpoints": {"name": "qwen2.5-0.5b", "target": "t", "draft": "d"},
            "prompts": {"count": 8, "sweep_prompt_indices": [0, 7]}, "max_new_tokens": 64, "repeats": 1,
            "systems": systems, "sweep": {"modes": {}}, "engines": {}, "peer_builds": {},
            "roofline": {"bandwidth_measurements": [{"1": {"gbs_best": 20.0, "gbs_median": 19.0}}],
                         "mean_context_tokens": 120.0, "rows": {}},
            "targets": [], "load": {}, "method": {"selection": "fastest"}}


def test_unavailable_and_failed_rows_are_in_the_report_with_their_reasons(tmp_path):
    systems = {"edgespec plain fp16 cpu-native": ok(50.0, "edgespec", "fp16", "plain"),
               "edgespec plain int4 cpu-native": {"status": "unavailable", "system": "edgespec", "run_id": "r1",
                                                  "started": 1000.0, "ended": 1000.0,
                                                  "error": "no engine folder has int4 native weights: ..."},
               "ORT GenAI plain fp16": {"status": "failed", "system": "ORT GenAI", "run_id": "r1", "started": 1300.0,
                                        "ended": 1310.0, "error": "every configuration failed in the sweep; first: "
                                                                  "exit 2, no JSON; stderr tail: x\nFP16 not on CPU"}}
    br.write_report(_report(systems), tmp_path / "r.json")
    md = (tmp_path / "r.md").read_text()
    assert "| edgespec plain int4 cpu-native | unavailable: no engine folder has int4 native weights" in md
    assert "| ORT GenAI plain fp16 | failed: every configuration failed in the sweep; first: exit 2, no JSON; FP16 " \
           "not on CPU" in md
    assert json.loads((tmp_path / "r.json").read_text())["systems"]["edgespec plain int4 cpu-native"]["status"] == \
        "unavailable"
    assert (tmp_path / "r.png").stat().st_size > 0 or pytest.importorskip("matplotlib") is None
    systems["ORT GenAI plain fp16"]["run_id"] = "other"
    with pytest.raises(MixedRunsError):
        br.write_report(_report(systems), tmp_path / "r2.json")
    assert not (tmp_path / "r2.json").exists()


def test_smoke_settings_apply_unless_given_and_a_checkpoint_is_required():
    a = br.parse_args(["--preset", "qwen2.5-0.5b", "--smoke", "--max-new-tokens", "8"])
    assert (a.code_prompts, a.max_new_tokens, a.gammas, a.repeats) == (2, 8, "4", 1)
    full = br.parse_args(["--preset", "qwen2.5-0.5b"])
    assert (full.code_prompts, full.max_new_tokens) == (8, 64)
    assert (a.draft_dtype, a.llamacpp_draft_precisions) == ("int8", "same")  # the smoke sweeps one draft each
    assert (full.draft_dtype, full.llamacpp_draft_precisions) == ("int8,int4", "same,q8_0,q4_0")
    with pytest.raises(SystemExit):
        br.parse_args(["--target", "x"])
    with pytest.raises(SystemExit):
        br.parse_args(["--preset", "qwen2.5-0.5b", "--precisions", "fp8"])
    assert full.vocab == "source" and br.parse_args(["--preset", "qwen2.5-0.5b", "--vocab", "real"]).vocab == "real"
    with pytest.raises(SystemExit):
        br.parse_args(["--target", "x", "--draft", "y", "--vocab", "real"])


def test_the_real_vocabulary_pair_has_its_own_folder_and_results():
    from edgespec.export.standin import default_out
    assert default_out("llama-3.2-1b").name == "llama-3.2-1b"
    assert default_out("llama-3.2-1b", "real") == default_out("llama-3.2-1b").with_name("llama-3.2-1b-real-vocab")


def test_a_failed_rows_one_line_error_is_its_last_error_line():
    err = ("exit 1, no JSON; stderr tail: edgespec/native_step.c:572:9: error: too few arguments to function 'qrows'\n"
           "  572 |         qrows(rows, R, p, np, a->K, a->kind, out);\n      |         ^~~~~")
    assert br._why(err) == "exit 1, no JSON; edgespec/native_step.c:572:9: error: too few arguments to function 'qrows'"
    assert br._why("exit 2, no JSON; stderr tail: Traceback\nValueError: bad | thing\n") == \
        "exit 2, no JSON; ValueError: bad / thing"
    assert br._why("timed out after 900 s") == "timed out after 900 s"


def test_a_bench_records_its_command_and_writes_json_and_markdown(tmp_path, monkeypatch):
    import host  # bench/lib, on sys.path once bench_realsize is imported
    monkeypatch.setattr(sys, "argv", ["/abs/path/bench_x.py", "--out", "a b.json"])
    assert host.command_line("/abs/path/bench_x.py") == "python bench/bench_x.py --out 'a b.json'"
    out = tmp_path / "sub" / "r.json"
    host.write_results(out, {"x": [1, 2]}, "# r\n")
    assert json.loads(out.read_text()) == {"x": [1, 2]} and (tmp_path / "sub" / "r.md").read_text() == "# r\n"

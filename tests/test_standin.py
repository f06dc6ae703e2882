"""Stand-in checkpoints (export/standin.py): a small Llama inflated to a bigger shape computes the same function.

Small random sources (transformers' LlamaForCausalLM, fp16-rounded weights) are inflated in every dimension (hidden,
heads, KV heads, head_dim x2 or x4, MLP, layers) and compared with the source through transformers (fp32, with its
KV cache) and through the reference decoder; one run inflates the bundled demo target and compares greedy ids on
real prompts. The source's rms_norm_eps is large (0.02) so that an eps left unscaled would show.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the stand-in tests need the export extra (torch)")
transformers = pytest.importorskip("transformers", reason="the stand-in tests need the export extra (transformers)")

from edgespec.export import standin  # noqa: E402
from edgespec.export.reference import ReferenceDecoder  # noqa: E402
from edgespec.export.standin import PRESETS, Shape, StandinError, make_standin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 160
SRC = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=0.02,
           bos_token_id=None, eos_token_id=None, pad_token_id=None)
SOURCES = {
    "tied-default": dict(tie_word_embeddings=True),
    "untied-llama3": dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
# bigger in every dimension: E'/E = 1.5 (norm weights rounded after the sqrt(2/3) scale), head_dim x2 (q rounded
# after the sqrt(2) scale), 2 -> 4 query heads per KV head
BIG = Shape(hidden_size=96, num_attention_heads=12, num_key_value_heads=3, head_dim=32, intermediate_size=136,
            num_hidden_layers=5)
# power-of-4 ratios (E x4, head_dim x4): every rescale is a power of two, so the stand-in is exact in float16
EXACT = Shape(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=200,
              num_hidden_layers=4)
CASES = {"big": ("tied-default", BIG), "big-untied-llama3": ("untied-llama3", BIG), "exact": ("tied-default", EXACT)}
TOL = {"big": 5e-3, "big-untied-llama3": 5e-3, "exact": 1e-4}  # max |logit diff| / max |logit|


def _make_source(path: Path, extra: dict, seed: int) -> Path:
    cfg = transformers.LlamaConfig(**SRC, **extra)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)  # HF inits small; wider so that mistakes show
            p.copy_(p.half().float())  # the stand-in is float16: start from float16 values
        if cfg.tie_word_embeddings:
            model.tie_weights()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """case -> (source dir, stand-in dir)."""
    root = tmp_path_factory.mktemp("standin")
    srcs = {k: _make_source(root / k, extra, i) for i, (k, extra) in enumerate(SOURCES.items())}
    out = {}
    for case, (src, shape) in CASES.items():
        # a small shard size: the index and several shards are exercised
        make_standin(srcs[src], root / f"out-{case}", shape, seed=3, shard_bytes=96 << 10, progress=False)
        out[case] = (srcs[src], root / f"out-{case}")
    return out


def _hf(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (1, n), generator=g) for n in (3, 7, 12, 20)]


def _greedy(model, ids, n=24):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("case", list(CASES))
def test_standin_matches_the_source_through_transformers(made, case):
    src_dir, out_dir = made[case]
    src, big = _hf(src_dir), _hf(out_dir)
    assert big.config.hidden_size == CASES[case][1].hidden_size
    assert {p.dtype for p in transformers.LlamaForCausalLM.from_pretrained(out_dir).parameters()} == {torch.float16}
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = src(ids).logits, big(ids).logits
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < TOL[case], f"{case}: max |stand-in - source| / max |logit| = {rel:.2e}"
    for p in _prompts():
        assert torch.equal(_greedy(src, p), _greedy(big, p)), f"{case}: greedy ids differ on prompt {p.tolist()}"


@pytest.mark.parametrize("case", ["big-untied-llama3", "exact"])
def test_standin_matches_the_source_through_the_reference_decoder(made, case):
    src_dir, out_dir = made[case]
    src, big = ReferenceDecoder.from_pretrained(src_dir), ReferenceDecoder.from_pretrained(out_dir)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    want, got = src(ids), big(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < TOL[case]
    for p in _prompts()[:2]:
        a, b = p, p
        for _ in range(16):
            a = torch.cat([a, src(a)[:, -1:].argmax(-1)], 1)
            b = torch.cat([b, big(b)[:, -1:].argmax(-1)], 1)
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_padded_residual_dims_stay_exactly_zero(made, case):
    src_dir, out_dir = made[case]
    e = transformers.AutoConfig.from_pretrained(src_dir).hidden_size
    big = _hf(out_dir)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = big(ids, output_hidden_states=True).hidden_states
    assert len(hs) == CASES[case][1].num_hidden_layers + 1
    for i, h in enumerate(hs):
        assert h[..., :e].abs().max() > 0
        assert torch.count_nonzero(h[..., e:]) == 0, f"{case}: padded dims nonzero after layer {i}"


def test_config_layout_and_recipe(made):
    src_dir, out_dir = made["big"]
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["rms_norm_eps"] == pytest.approx(0.02 * 64 / 96, rel=1e-12)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["intermediate_size"], cfg["num_hidden_layers"]) == (96, 12, 3, 32, 136, 5)
    assert cfg["dtype"] == "float16" and cfg["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    from safetensors import safe_open
    total, count = 0, 0
    for f in files:
        with safe_open(str(out_dir / f), "np") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                assert t.dtype == np.float16
                total, count = total + t.nbytes, count + t.size
    rec = json.loads((out_dir / "standin.json").read_text())
    assert index["metadata"]["total_size"] == total == rec["bytes"]
    assert rec["params"] == count == standin.param_count(BIG, VOCAB) == _hf(out_dir).num_parameters()
    assert rec["real_layers"] == [0, 1, 3]  # source layer i -> i * 5 // 3


def test_structure_required_zeros_and_random_dead_weights(made):
    """The required zeros are there; everything else dead is noise of the source tensor's scale, not zeros."""
    src_dir, out_dir = made["big"]
    _, sw = standin.load_checkpoint(src_dir)
    _, w = standin.load_checkpoint(out_dir)
    e, i = 64, 96
    emb = w["model.embed_tokens.weight"]
    assert not emb[:, e:].any() and np.array_equal(emb[:, :e], sw["model.embed_tokens.weight"])
    for p, (s, real) in enumerate([(0, True), (1, True), (1, False), (2, True), (2, False)]):
        pre = f"model.layers.{p}."
        o, down = w[pre + "self_attn.o_proj.weight"], w[pre + "mlp.down_proj.weight"]
        if not real:
            assert not o.any() and not down.any()
        else:
            assert not o[e:].any() and not down[e:].any() and not down[:, i:].any()
            assert np.array_equal(down[:e, :i], sw[f"model.layers.{s}.mlp.down_proj.weight"])
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            t, ref = w[pre + part + ".weight"], sw[f"model.layers.{s}.{part}.weight"]
            dead = t[np.any(t != 0, axis=1)][:, e:]  # reads the padded dims: noise (q's zero RoPE rows aside)
            assert dead.shape[0] >= t.shape[0] * 5 // 6
            assert np.count_nonzero(dead) > 0.99 * dead.size
            ratio = dead.std() / ref.std() / (np.sqrt(2) if part == "self_attn.q_proj" else 1)
            assert 0.8 < ratio < 1.25, (pre + part, ratio)


def test_rope_frequencies_map_exactly_when_head_dim_grows():
    """transformers' own inv_freq: new pair r*i has the source pair i's frequency, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    for extra in SOURCES.values():
        rp = extra.get("rope_parameters")
        kw = {"rope_parameters": rp} if rp else {}
        a = LlamaRotaryEmbedding(transformers.LlamaConfig(**{**SRC, **kw}))
        for r in (2, 4):
            b = LlamaRotaryEmbedding(transformers.LlamaConfig(**{**SRC, **kw, "head_dim": 16 * r}))
            assert torch.equal(b.inv_freq[::r], a.inv_freq) and a.attention_scaling == b.attention_scaling
    m = standin.head_dim_map(16, 32)
    assert m[:8].tolist() == [0, 2, 4, 6, 8, 10, 12, 14] and m[8:].tolist() == [16, 18, 20, 22, 24, 26, 28, 30]


def test_deterministic_from_the_seed(made, tmp_path):
    src_dir, out_dir = made["big"]
    again = make_standin(src_dir, tmp_path / "a", BIG, seed=3, shard_bytes=96 << 10, progress=False)
    for f in again["files"]:
        assert (tmp_path / "a" / f).read_bytes() == (out_dir / f).read_bytes()
    assert make_standin(src_dir, tmp_path / "a", BIG, seed=3, shard_bytes=96 << 10, progress=False).get("reused")
    other = make_standin(src_dir, tmp_path / "b", BIG, seed=4, progress=False)
    _, wa = standin.load_checkpoint(out_dir)
    _, wb = standin.load_checkpoint(tmp_path / "b")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(wa[q], wb[q]) and np.array_equal(wa[q][:, :64][:16], wb[q][:, :64][:16])
    assert other["params"] == again["params"]


def test_demo_target_inflated_keeps_its_greedy_output(tmp_path):
    from tokenizers import Tokenizer
    demo = REPO / "models" / "demo-target"
    shape = Shape(hidden_size=640, num_attention_heads=10, num_key_value_heads=5, head_dim=128,
                  intermediate_size=1600, num_hidden_layers=10)
    make_standin(demo, tmp_path / "s", shape, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "s" / f).read_bytes() == (demo / f).read_bytes()
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    src, big = _hf(demo), _hf(tmp_path / "s")
    for text in ("def read_config(path):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self"):
        ids = torch.tensor([tok.encode(text).ids])
        a, b = _greedy(src, ids), _greedy(big, ids)
        assert torch.equal(a, b), f"{text!r}: {tok.decode(a[0].tolist())!r} vs {tok.decode(b[0].tolist())!r}"


# --------------------------------------------------------------------------------------- padded vocabulary

PADDED = 3 * VOCAB + 7  # not a multiple of anything: the copy is not a tiling


@pytest.fixture(scope="module")
def padded(made, tmp_path_factory):
    """case -> (source dir, stand-in dir with the vocabulary padded to PADDED), for a tied and an untied source."""
    root = tmp_path_factory.mktemp("padded")
    out = {}
    for case in ("big", "big-untied-llama3"):
        src_dir = made[case][0]
        make_standin(src_dir, root / case, CASES[case][1], seed=3, vocab_size=PADDED, progress=False)
        out[case] = (src_dir, root / case)
    return out


@pytest.mark.parametrize("case", ["big", "big-untied-llama3"])
def test_padded_vocabulary_keeps_greedy_ids_and_copies_the_sink(padded, case):
    src_dir, out_dir = padded[case]
    rec = json.loads((out_dir / "standin.json").read_text())
    pv = rec["padded_vocab"]
    assert rec["vocab_size"] == PADDED == json.loads((out_dir / "config.json").read_text())["vocab_size"]
    assert rec["recipe"]["vocab_size"] == PADDED and pv["source"] == VOCAB and pv["margin_min"] > 0
    src, big = _hf(src_dir), _hf(out_dir)
    assert rec["params"] == big.num_parameters() == standin.param_count(CASES[case][1], PADDED,
                                                                          tied=case == "big")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = src(ids).logits, big(ids).logits
    assert got.shape[-1] == PADDED
    assert ((got[..., :VOCAB] - want).abs().max() / want.abs().max()).item() < TOL[case]
    sink = got[..., pv["sink"]:pv["sink"] + 1]
    assert (got[..., VOCAB:] - sink).abs().max().item() <= 1e-5 * want.abs().max().item()  # copies of the sink
    cal = torch.from_numpy(standin._calibration_ids(standin.read_source(src_dir)))
    with torch.no_grad():
        got = big(cal).logits  # on the calibration ids a padded id is never the greedy choice, not even tied
    assert (got[..., :VOCAB].max(-1).values > got[..., VOCAB:].max(-1).values).all()
    # (elsewhere a random source's sink can win: test_demo_target_padded_to_a_real_vocabulary_keeps_its_greedy_output)


def test_the_sink_is_the_calibrations_least_likely_token(padded):
    """pick_sink's choice, margin and padded probability, recomputed here from the source's own logits."""
    src_dir, out_dir = padded["big"]
    pv = json.loads((out_dir / "standin.json").read_text())["padded_vocab"]
    ids = torch.from_numpy(standin._calibration_ids(standin.read_source(src_dir)))
    assert pv["calibration_tokens"] == ids.numel()
    with torch.no_grad():
        logits = _hf(src_dir)(ids).logits.reshape(-1, VOCAB).double()
    gap = logits.max(-1, keepdim=True).values - logits  # (T, V): how far below the winner each token is
    worst = gap.min(0).values
    assert pv["sink"] == int(worst.argmax()) and pv["margin_min"] == pytest.approx(float(worst.max()), abs=1e-4)
    probs = torch.softmax(torch.cat([logits, logits[:, pv["sink"]:pv["sink"] + 1].expand(-1, PADDED - VOCAB)], 1), 1)
    assert pv["padded_probability_max"] == pytest.approx(float(probs[:, VOCAB:].sum(1).max()), rel=1e-2)


def test_an_unpadded_recipe_is_the_earlier_one(made, tmp_path):
    """vocab_size equal to the source's changes nothing: same bytes, and the earlier recipe (no vocab_size key)."""
    src_dir, out_dir = made["big"]
    rec = make_standin(src_dir, tmp_path / "same", BIG, seed=3, vocab_size=VOCAB, shard_bytes=96 << 10,
                       progress=False)
    assert "vocab_size" not in rec["recipe"] and "padded_vocab" not in rec
    assert rec["recipe"] == json.loads((out_dir / "standin.json").read_text())["recipe"]
    for f in rec["files"]:
        assert (tmp_path / "same" / f).read_bytes() == (out_dir / f).read_bytes()


@pytest.mark.parametrize("vocab, match", [(VOCAB - 1, r"vocab_size: expected an integer >= 160 .*got 159"),
                                          (True, r"vocab_size: expected an integer >= 160 .*got True"),
                                          (136, r"vocab_size: expected an integer >= 160")])
def test_bad_vocab_sizes_are_refused(made, tmp_path, vocab, match):
    with pytest.raises(StandinError, match=match):
        make_standin(made["big"][0], tmp_path / "x", BIG, vocab_size=vocab, progress=False)
    assert not (tmp_path / "x").exists()


def test_a_padded_vocabulary_as_wide_as_a_projection_is_refused(made, tmp_path):
    with pytest.raises(StandinError, match=r"shape\.intermediate_size: expected a width other than vocab_size 200"):
        make_standin(made["big"][0], tmp_path / "x", _shape(intermediate_size=200), vocab_size=200, progress=False)


def test_demo_target_padded_to_a_real_vocabulary_keeps_its_greedy_output(tmp_path):
    """The trained demo target, padded to Llama 3's 128256 ids: its sink is a token it never predicts, far below
    the winner, and greedy output on code prompts is the demo's."""
    from tokenizers import Tokenizer
    demo = REPO / "models" / "demo-target"
    shape = Shape(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1408, num_hidden_layers=8)  # the demo's own shape: only the vocabulary grows
    rec = make_standin(demo, tmp_path / "s", shape, vocab_size=128256, progress=False)
    pv = rec["padded_vocab"]
    assert pv["margin_min"] > 5 and 0 < pv["padded_probability_max"] < 1, pv  # greedy-safe; sampling is not
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    src, big = _hf(demo), _hf(tmp_path / "s")
    for text in ("def read_config(path):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self",
                 "for i in range(10):\n    print(", "# Compute the mean of a list\ndef mean(xs):\n"):
        ids = torch.tensor([tok.encode(text).ids])
        a, b = _greedy(src, ids, 48), _greedy(big, ids, 48)
        assert torch.equal(a, b), f"{text!r}: {tok.decode(a[0].tolist())!r} vs {b[0].tolist()!r}"


# -------------------------------------------------------------------------------------------- refusals

def _shape(**kw):
    return {**asdict(BIG), **kw}


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_size=32), r"shape\.hidden_size: expected >= 64 \(the source's\), got 32"),
    (dict(num_attention_heads=2, num_key_value_heads=2), r"shape\.num_attention_heads: expected >= 4"),
    (dict(num_key_value_heads=1, num_attention_heads=12), r"shape\.num_key_value_heads: expected >= 2"),
    (dict(head_dim=8), r"shape\.head_dim: expected >= 16"),
    (dict(intermediate_size=64), r"shape\.intermediate_size: expected >= 96"),
    (dict(num_hidden_layers=2), r"shape\.num_hidden_layers: expected >= 3"),
    (dict(num_attention_heads=12, num_key_value_heads=12), r"expected >= 2 query heads per KV head .* got 12/12 = 1"),
    (dict(num_attention_heads=16, num_key_value_heads=6), r"num_attention_heads: expected a multiple of num_key_value_heads"),
    (dict(num_attention_heads=16, num_key_value_heads=4, hidden_size=100), r"shape\.hidden_size: expected a multiple of num_attention_heads"),
    (dict(head_dim=24), r"shape\.head_dim: expected a multiple of the source's 16"),
    (dict(intermediate_size=VOCAB), r"shape\.intermediate_size: expected a width other than vocab_size 160.*got 160"),
    (dict(hidden_size=160, num_attention_heads=10, num_key_value_heads=5), r"shape\.hidden_size: expected a width other than vocab_size"),
    (dict(num_key_value_heads=5, num_attention_heads=10, head_dim=32, hidden_size=120), r"num_key_value_heads\*head_dim: expected a width other than vocab"),
    (dict(head_dim="x"), r"shape\.head_dim: expected a positive integer, got 'x'"),
    (dict(heads=3), r"shape: unknown field 'heads'"),
])
def test_bad_shapes_are_refused(made, tmp_path, kw, match):
    src_dir, _ = made["big"]
    with pytest.raises(StandinError, match=match):
        make_standin(src_dir, tmp_path / "x", _shape(**kw), progress=False)
    assert not (tmp_path / "x").exists()


def test_a_projection_as_wide_as_the_vocabulary_is_allowed_where_no_genai_builder_reads_it(made, tmp_path):
    """openvla_standin's decoders (never given to GenAI): Llama-3.2-3B's 8 KV heads x 128 = 1024 = the reacher
    policy's vocabulary."""
    src_dir, _ = made["big"]
    make_standin(src_dir, tmp_path / "x", _shape(intermediate_size=VOCAB), seed=3, progress=False,
                 genai_builder=False)
    src, big = _hf(src_dir), _hf(tmp_path / "x")
    assert big.config.intermediate_size == VOCAB
    for p in _prompts()[:2]:
        assert torch.equal(_greedy(src, p), _greedy(big, p))


def test_other_families_and_inexact_rope_are_refused(made, tmp_path):
    src_dir, _ = made["big"]
    cfg = json.loads((src_dir / "config.json").read_text())
    for patch, match in ((dict(model_type="qwen2"), r"model_type: expected 'llama' .*got 'qwen2'"),
                         (dict(attention_bias=True), r"attention_bias: expected False .*got True"),
                         (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
                          r"shape\.head_dim: expected 16 .* with rope_type 'yarn'.*got 32")):
        d = tmp_path / patch.__repr__()[:20].replace(" ", "_").replace("'", "")
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(StandinError, match=match):
            make_standin(d, tmp_path / "out", BIG, progress=False)
    with pytest.raises(StandinError, match=r"source: expected a Hugging Face checkpoint folder"):
        make_standin(tmp_path / "nowhere", tmp_path / "out", BIG, progress=False)


def test_a_foreign_out_folder_is_not_overwritten(made, tmp_path):
    src_dir, _ = made["big"]
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    with pytest.raises(StandinError, match="out: expected an empty folder or an earlier stand-in"):
        make_standin(src_dir, tmp_path / "o", BIG, progress=False)
    assert (tmp_path / "o" / "notes.txt").read_text() == "mine"


def test_cli_errors_are_one_line(made, tmp_path, capsys):
    src_dir, _ = made["big"]
    rc = standin.main(["--source", str(src_dir), "--out", str(tmp_path / "c"), "--no-progress",
                       "--shape", "hidden_size=96,num_attention_heads=12,num_key_value_heads=3,head_dim=32,"
                                  f"intermediate_size={VOCAB},num_hidden_layers=5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("error: shape.intermediate_size: expected a width other")
    assert standin.main(["--shape", "hidden_size=96", "--source", str(src_dir)]) == 2
    assert standin.main(["--preset", "llama-3.2-1b", "--shape", "hidden_size=96"]) == 2


def test_cli_makes_a_custom_shape(made, tmp_path, capsys):
    src_dir, _ = made["big"]
    shape = ",".join(f"{k}={v}" for k, v in _shape().items())
    assert standin.main(["--source", str(src_dir), "--out", str(tmp_path / "c"), "--no-progress", "--shape", shape]) == 0
    assert "M params" in capsys.readouterr().out
    assert (tmp_path / "c" / "config.json").is_file()


# ------------------------------------------------------------------------------------------------ presets

def test_presets_fit_the_demo_pair_and_list(capsys):
    tgt, dft = standin.read_source(REPO / "models" / "demo-target"), standin.read_source(REPO / "models" / "demo-draft")
    for name, p in PRESETS.items():
        standin.check_shape(tgt, p.target)
        standin.check_shape(dft, p.draft)
        t, d = standin.param_count(p.target, tgt.vocab_size), standin.param_count(p.draft, dft.vocab_size)
        assert 10 <= t / d <= 30, name
        for shape in (p.target, p.draft):  # transformers accepts the shape
            transformers.LlamaConfig(vocab_size=tgt.vocab_size, **asdict(shape))
    # the real models' published parameter counts
    assert PRESETS["llama-3.2-1b"].real.params == 1_235_814_400
    assert PRESETS["llama-3.2-3b"].real.params == 3_212_749_824
    assert PRESETS["qwen2.5-0.5b"].real.params == 494_032_768
    for name, p in PRESETS.items():  # with the real vocabulary: still 10-30x, and within 3% of the real model
        t = standin.param_count(p.shape("target", "real"), p.real.vocab_size)
        d = standin.param_count(p.shape("draft", "real"), p.real.vocab_size)
        standin.check_shape(dft, p.shape("draft", "real"))
        assert 10 <= t / d <= 30 and abs(t - p.real.params) <= 0.03 * p.real.params, (name, t / d, t)
    with pytest.raises(StandinError, match=r"vocab: expected one of source, real, got 'big'"):
        PRESETS["llama-3.2-1b"].shape("target", "big")
    assert standin.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and "fp16" in out and "--vocab real (151936)" in out
    assert standin.main(["--preset", "llama-3.2-1b", "--vocab-size", "9000"]) == 2
    assert "--vocab-size: expected only with --shape" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- quantization

def _int4(w: np.ndarray, block: int) -> np.ndarray:
    """W [out, in] -> what ONNX Runtime's MatMulNBits (int4, asymmetric, `block` values along `in`) computes
    with it, read back through an identity input: the dequantized W^T [in, out]."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    k, n = w.shape[1], w.shape[0]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                          [numpy_helper.from_array(np.ascontiguousarray(w.T, np.float32), "w")])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), bits=4,
                             block_size=block, is_symmetric=False)
    q.process()
    assert [nd.op_type for nd in q.model.model.graph.node] == ["MatMulNBits"]
    sess = ort.InferenceSession(q.model.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0]


@pytest.mark.parametrize("case", ["big", "exact"])
def test_int4_keeps_the_zeros_and_quantizes_the_real_weights_as_the_source(made, case):
    """Block 16 divides the tiny source's E, D and I, so every real value sits in a block of real values grouped
    as in the source: the int4 stand-in holds the int4 source's weights, and every required zero stays zero."""
    pytest.importorskip("onnx")
    src_dir, out_dir = made[case]
    _, sw = standin.load_checkpoint(src_dir)
    _, w = standin.load_checkpoint(out_dir)
    src, shape = standin.read_source(src_dir), CASES[case][1]
    inf = standin._Inflater(src, sw, shape, seed=3)
    e, i = 64, 96
    pre = spre = "model.layers.0."
    cols = np.arange(e)
    real = {"self_attn.q_proj": (inf.q_rows, cols), "self_attn.k_proj": (inf.k_rows, cols),
            "self_attn.v_proj": (inf.v_rows, cols), "self_attn.o_proj": (cols, inf.o_cols),
            "mlp.gate_proj": (np.arange(i), cols), "mlp.down_proj": (cols, np.arange(i))}
    for part, (rows, cs) in real.items():
        got = _int4(w[pre + part + ".weight"], 16).T  # [out, in]
        want = _int4(sw[spre + part + ".weight"], 16).T
        if part == "self_attn.q_proj":  # scaled by sqrt(D'/D): compare with the source scaled the same way
            want = _int4(w[pre + part + ".weight"][np.ix_(rows, cs)], 16).T
        np.testing.assert_array_equal(got[np.ix_(rows, cs)], want, err_msg=part)
    o, down = _int4(w[pre + "self_attn.o_proj.weight"], 16).T, _int4(w[pre + "mlp.down_proj.weight"], 16).T
    assert not o[e:].any() and not o[:, inf.o_zero_cols].any() and not down[e:].any() and not down[:, i:].any()
    dead = next(p for p, (_, is_real) in enumerate(inf.donor) if not is_real)
    for part in ("self_attn.o_proj", "mlp.down_proj"):  # a dead layer stays the identity
        assert not _int4(w[f"model.layers.{dead}.{part}.weight"], 16).any()


def test_a_padded_stand_in_exports_and_decodes_like_its_source(tmp_path):
    """The runtime side of a vocabulary padded past its tokenizer (as Qwen's and Phi's real checkpoints are): the
    export's gates pass, greedy decoding on ONNX Runtime and on the native step gives the source's ids, and a
    padding id, which tokenizers would drop silently, shows in the text by its number."""
    import edgespec
    from edgespec.export.onnx_export import export_engine
    from edgespec.tokenizer import TextTokenizer
    demo = REPO / "models" / "demo-target"
    shape = Shape(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1408, num_hidden_layers=8)
    make_standin(demo, tmp_path / "s", shape, vocab_size=6000, progress=False)  # the native step needs 16 | V
    m = export_engine(tmp_path / "s", tmp_path / "e", max_context=256, progress=False)
    assert m.vocab_size == 6000
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(demo / "tokenizer.json")).encode("def read_config(path):\n").ids
    want = _greedy(_hf(demo), torch.tensor([ids]), 40)[0, len(ids):].tolist()
    for provider in ("cpu", "cpu-native"):
        out = edgespec.load(tmp_path / "e", provider=provider).generate(ids, max_new_tokens=40)
        assert out.token_ids == want, provider
    tok = TextTokenizer(tmp_path / "e" / "tokenizer.json")
    assert tok.decode(want) == Tokenizer.from_file(str(demo / "tokenizer.json")).decode(want,
                                                                                          skip_special_tokens=False)
    plain = TextTokenizer(demo / "tokenizer.json")
    assert tok.decode([17, 4096, 5999, 18]) == plain.decode([17]) + "<|id:4096|><|id:5999|>" + plain.decode([18])
    assert tok.decode([]) == "" and tok.decode([-3]) == "<|id:-3|>"

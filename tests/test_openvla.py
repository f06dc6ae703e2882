"""OpenVLA-format import (export/prismatic.py, export/openvla.py, export/openvla_ckpt.py) and prompt policies in
the runtime: the reference's ViTs against transformers' own DINOv2-with-registers and SigLIP, an export whose
actions are OpenVLA's formula over the reference's ids, speculative == plain with a draft decoder, and every bad
input the issue names refused with one line saying what was expected and what was got."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from edgespec.export.openvla import export_openvla  # noqa: E402
from edgespec.export.openvla_ckpt import TinyOpenVLA, text_config, write_checkpoint  # noqa: E402
from edgespec.export.prismatic import OpenVLAFormatError, VLMFormatError, build_reference, read_checkpoint  # noqa: E402,E501


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("openvla") / "ckpt")


@pytest.fixture(scope="module")
def draft_lm(tmp_path_factory):
    """A one-layer Llama of the target's width and vocabulary: a draft decoder reading the target's prefix."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = {k: v for k, v in text_config(TinyOpenVLA()).items() if k not in ("model_type", "architectures", "torch_dtype")}
    cfg.update(num_hidden_layers=1, intermediate_size=64)
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("openvla") / "draft"
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(ckpt, draft_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("openvla") / "engine"
    export_openvla(ckpt, out, unnorm_key="bridge_orig", draft=draft_lm, progress=False)
    return out


def _weights(path):
    from safetensors.torch import load_file
    return {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}


def test_vits_equal_transformers_dinov2_and_siglip(ckpt):
    """Our ViT (timm's layout, read to its second-to-last block) against transformers' independent classes with
    the same weights: DINOv2 with registers (cls + 4 registers, LayerScale, patch-only positions) and SigLIP."""
    from transformers import (Dinov2WithRegistersConfig, Dinov2WithRegistersModel, SiglipVisionConfig,
                              SiglipVisionModel)
    ck = read_checkpoint(ckpt)
    ref, w = build_reference(ck), _weights(ckpt)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))

    def block_map(p, i, names):
        q = f"{p}blocks.{i}."
        qw, kw, vw = w[q + "attn.qkv.weight"].chunk(3, 0)
        qb, kb, vb = w[q + "attn.qkv.bias"].chunk(3)
        out = {names["q"] + ".weight": qw, names["q"] + ".bias": qb, names["k"] + ".weight": kw,
               names["k"] + ".bias": kb, names["v"] + ".weight": vw, names["v"] + ".bias": vb,
               names["o"] + ".weight": w[q + "attn.proj.weight"], names["o"] + ".bias": w[q + "attn.proj.bias"]}
        for ours, theirs in (("norm1", names["n1"]), ("norm2", names["n2"]), ("mlp.fc1", names["mlp"] + ".fc1"),
                             ("mlp.fc2", names["mlp"] + ".fc2")):
            out[theirs + ".weight"], out[theirs + ".bias"] = w[q + ours + ".weight"], w[q + ours + ".bias"]
        return out

    a, p = ck.vits[0], "vision_backbone.featurizer."
    assert (a.n_cls, a.n_reg, a.layerscale, a.pos_prefix) == (1, 4, True, False)
    dino = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(
        hidden_size=a.dim, num_hidden_layers=a.depth, num_attention_heads=a.heads, mlp_ratio=a.mlp // a.dim,
        image_size=224, patch_size=a.patch, num_register_tokens=4, layer_norm_eps=1e-6, hidden_act="gelu")).eval()
    sd = {"embeddings.cls_token": w[p + "cls_token"], "embeddings.register_tokens": w[p + "reg_token"],
          "embeddings.position_embeddings": torch.cat([torch.zeros(1, 1, a.dim), w[p + "pos_embed"]], 1),
          "embeddings.patch_embeddings.projection.weight": w[p + "patch_embed.proj.weight"],
          "embeddings.patch_embeddings.projection.bias": w[p + "patch_embed.proj.bias"],
          "embeddings.mask_token": torch.zeros(1, a.dim), "layernorm.weight": w[p + "norm.weight"],
          "layernorm.bias": w[p + "norm.bias"]}
    for i in range(a.depth):
        h = f"encoder.layer.{i}."
        sd.update(block_map(p, i, {"q": h + "attention.q_proj", "k": h + "attention.k_proj",
                                   "v": h + "attention.v_proj", "o": h + "attention.o_proj", "n1": h + "norm1",
                                   "n2": h + "norm2", "mlp": h + "mlp"}))
        sd[h + "layer_scale1.lambda1"] = w[f"{p}blocks.{i}.ls1.scale_factor"]
        sd[h + "layer_scale2.lambda1"] = w[f"{p}blocks.{i}.ls2.scale_factor"]
    dino.load_state_dict(sd, strict=True)

    a, p = ck.vits[1], "vision_backbone.fused_featurizer."
    sig = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=a.dim, intermediate_size=a.mlp, num_hidden_layers=a.depth, num_attention_heads=a.heads,
        image_size=224, patch_size=a.patch, hidden_act="gelu", layer_norm_eps=1e-6, vision_use_head=False)).eval()
    sd = {"embeddings.patch_embedding.weight": w[p + "patch_embed.proj.weight"],
          "embeddings.patch_embedding.bias": w[p + "patch_embed.proj.bias"],
          "embeddings.position_embedding.weight": w[p + "pos_embed"][0],
          "post_layernorm.weight": w[p + "norm.weight"], "post_layernorm.bias": w[p + "norm.bias"]}
    for i in range(a.depth):
        h = f"encoder.layers.{i}."
        sd.update(block_map(p, i, {"q": h + "self_attn.q_proj", "k": h + "self_attn.k_proj",
                                   "v": h + "self_attn.v_proj", "o": h + "self_attn.out_proj", "n1": h + "layer_norm1",
                                   "n2": h + "layer_norm2", "mlp": h + "mlp"}))
    sig.load_state_dict(sd, strict=True)
    with torch.no_grad():
        for model, ours, n_prefix in ((dino, ref.vision_backbone.featurizer, 5),
                                      (sig, ref.vision_backbone.fused_featurizer, 0)):
            want = model(pixel_values=x, output_hidden_states=True).hidden_states[-2][:, n_prefix:]
            got = ours(x)
            assert got.shape == want.shape == (2, 256, ours.a.dim)
            assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


def test_export_actions_are_openvlas_formula(engine, ckpt):
    """act(): 7 actions from the policy's ids by predict_action's formula (vocab_size - id - 1 into 255 bin
    centres, q01/q99 un-normalisation, the gripper passed through), ids equal to the torch reference's."""
    from edgespec import load_policy
    pol = load_policy(engine)
    assert (pol.horizon, pol.dims, pol.state_dim, pol.prefix_len) == (1, 7, 0, 257)
    assert pol.action_names[-1] == "gripper" and pol.manifest.binary_dims == [6]
    ck = read_checkpoint(ckpt)
    ref = build_reference(ck)
    rng = np.random.default_rng(5)
    cfg = json.loads((ckpt / "config.json").read_text())
    stats = cfg["norm_stats"]["bridge_orig"]["action"]
    bins = np.linspace(-1, 1, 256)
    centers = (bins[:-1] + bins[1:]) / 2
    vocab = cfg["text_config"]["vocab_size"] - cfg["pad_to_multiple_of"]
    for instr in ("pick up the red cup", "open the drawer"):
        img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        actions = pol.act(img, None, instr)
        ids = pol.instruction_ids(instr)
        assert ids[0, 0] == 1 and ids[0, -1] == pol.prompt["append_id"]  # BOS first, "▁" appended
        want_ids = ref.action_ids(torch.from_numpy(img[None]), torch.from_numpy(ids), 7, vocab - 256, vocab)
        x = centers[np.clip(vocab - np.asarray(want_ids) - 1, 0, 254)]
        lo, hi, mask = (np.asarray(stats[k]) for k in ("q01", "q99", "mask"))
        want = np.where(mask, 0.5 * (x + 1) * (hi - lo) + lo, x)
        np.testing.assert_allclose(actions, want[None], rtol=0, atol=1e-12)
        assert pol.last_info["decode_ms"] > 0


def test_speculative_equals_plain_with_a_draft_decoder(engine):
    from edgespec import load_policy
    plain, spec = load_policy(engine), load_policy(engine, draft=True)
    rng = np.random.default_rng(9)
    drafted = 0
    for i in range(6):
        img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        instr = ["put the spoon in the bowl", "close the top drawer", "move the can to the left"][i % 3]
        np.testing.assert_array_equal(spec.act(img, None, instr), plain.act(img, None, instr))
        drafted += spec.last_info["drafted"]
        prefix = plain.encode(img, None, instr)
        assert plain.decode_ids(prefix)[0] == plain.reference_ids(prefix)  # cached decoding == whole-sequence
    assert drafted > 0


def test_relaxed_acceptance_on_an_openvla_policy(engine):
    """Relaxed acceptance on an OpenVLA-format policy: more drafts kept than exact, every kept draft within the
    radius of the target's choice, and the gripper (OpenVLA's binary 7th dimension) never relaxed."""
    from edgespec import load_policy
    exact = load_policy(engine, draft=True, gamma=4, stop_below=0.0)
    relaxed = load_policy(engine, draft=True, gamma=4, stop_below=0.0, mode="relaxed", radius=60)
    assert relaxed.manifest.binary_dims == [6]
    r = relaxed._radius[:relaxed.horizon * relaxed.dims].reshape(relaxed.horizon, relaxed.dims)
    assert (r[:, 6] == 0).all() and (r[:, :6] == 60).all()
    bound = relaxed.worst_case_deviation()
    assert bound[6] == 0.0 and (bound[:6] > 0).all()
    rng = np.random.default_rng(11)
    kept_exact = kept_relaxed = 0
    for i in range(6):
        img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        instr = ["put the spoon in the bowl", "close the top drawer"][i % 2]
        exact.act(img, None, instr)
        relaxed.act(img, None, instr)
        kept_exact += exact.last_info["accepted"]
        kept_relaxed += relaxed.last_info["accepted"]
        assert relaxed.last_info["max_dev_bins"] <= 60
    assert kept_relaxed > kept_exact


def test_fp16_export_with_its_gates(ckpt, draft_lm, tmp_path):
    meta = export_openvla(ckpt, tmp_path / "fp16", unnorm_key="fractal20220817_data", dtype="fp16",
                          draft=draft_lm, progress=False)
    gate = meta["end_to_end_gate"]
    assert gate["passed"] and not gate["ids_enforced"] and gate["ids"] == 28
    eng = json.loads((tmp_path / "fp16" / "target" / "engine.json").read_text())
    assert eng["precision"] == "fp16"
    assert json.loads((tmp_path / "fp16" / "action_stats.json").read_text())["q99"][0] == pytest.approx(0.056)


def test_prompt_policy_refuses_bad_inputs(engine):
    from edgespec import load_policy
    pol = load_policy(engine)
    ok = np.zeros((224, 224, 3), np.uint8)
    with pytest.raises(ValueError, match=r"image must be \(224, 224, 3\) uint8 RGB, got \(64, 64, 3\)"):
        pol.act(np.zeros((64, 64, 3), np.uint8), None, "open the drawer")
    with pytest.raises(ValueError, match=r"image must be \(224, 224, 3\) uint8 RGB, got \(224, 224, 4\)"):
        pol.act(np.zeros((224, 224, 4), np.uint8), None, "open the drawer")
    with pytest.raises(ValueError, match=r"state must have shape \(0,\)"):
        pol.act(ok, np.zeros(6), "open the drawer")
    with pytest.raises(ValueError, match="instruction must be a non-empty string"):
        pol.act(ok, None, "  ")
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens.*over the decoder's context 2048"):
        pol.act(ok, None, "open the drawer " * 700)
    with pytest.raises(FileNotFoundError, match="no draft head .*--draft-head FILE"):
        load_policy(engine, draft="head")


def test_a_stateless_policy_runs_on_the_control_loops_observations(engine):
    """The loop and the node observe the robot's state for every policy; a policy that reads none (OpenVLA's) is
    called without it, through Policy.__call__ and the command line's fixed-instruction wrapper alike."""
    from edgespec import load_policy
    from edgespec.robots.policy_args import FixedInstruction
    pol = load_policy(engine)
    obs = {"image": np.zeros((224, 224, 3), np.uint8), "state": np.zeros(6), "instruction": "open the drawer"}
    want = pol.act(obs["image"], None, "open the drawer")
    np.testing.assert_array_equal(pol(obs), want)
    np.testing.assert_array_equal(FixedInstruction(pol, "open the drawer")({**obs, "instruction": "ignored"}), want)


def _broken(ckpt, tmp_path, name, edit_config=None, drop=()):
    out = tmp_path / name
    shutil.copytree(ckpt, out)
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop:
        from safetensors.torch import load_file, save_file
        w = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in w.items() if k not in drop}, str(out / "model.safetensors"))
    return out


def test_bad_checkpoints_are_refused_by_name(ckpt, tmp_path):
    cases = [
        ("no-backbone", lambda c: c.pop("vision_backbone_id"), (), "no vision_backbone_id; not an OpenVLA checkpoint"),
        ("unknown", lambda c: c.update(vision_backbone_id="dinosiglip-vit-xl-999px"), (),
         "vision_backbone_id 'dinosiglip-vit-xl-999px' is not one OpenVLA defines; known: .*dinosiglip-vit-so-224px"),
        ("timm", lambda c: c.update(timm_model_ids=["vit_huge_patch99", "vit_so400m_patch14_siglip_224"]), (),
         r"timm model ids \['vit_huge_patch99'\] are not supported"),
        ("names", None, ("vision_backbone.fused_featurizer.blocks.1.mlp.fc2.bias",),
         r"weight names do not match OpenVLA's layout: missing \['vision_backbone.fused_featurizer.blocks.1.mlp.fc2"),
        ("projector", None, ("projector.fc3.weight", "projector.fc3.bias"),
         r"projector weights do not match a fused backbone of width 272"),
        ("stats", lambda c: c.update(norm_stats={}), (), "norm_stats must map dataset names"),
    ]
    for name, edit, drop, msg in cases:
        with pytest.raises(OpenVLAFormatError, match=msg):
            export_openvla(_broken(ckpt, tmp_path, name, edit, drop), tmp_path / f"out-{name}",
                           unnorm_key="bridge_orig", progress=False)
        assert not (tmp_path / f"out-{name}").exists()
    with pytest.raises(VLMFormatError, match=r"--unnorm-key 'libero' is not in .*it has \['bridge_orig', "
                                                 r"'fractal20220817_data'\]"):
        export_openvla(ckpt, tmp_path / "o1", unnorm_key="libero", progress=False)
    with pytest.raises(VLMFormatError, match="action statistics for 2 datasets .* choose one with --unnorm-key"):
        export_openvla(ckpt, tmp_path / "o2", progress=False)
    no_tok = _broken(ckpt, tmp_path, "no-tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(VLMFormatError, match="tokenizer.json is missing"):
        export_openvla(no_tok, tmp_path / "o3", unnorm_key="bridge_orig", progress=False)
    with pytest.raises(ValueError, match="needs width 128 and vocabulary 1024"):
        export_openvla(ckpt, tmp_path / "o4", unnorm_key="bridge_orig", draft=_wide_draft(tmp_path), progress=False)


def test_text_config_is_completed_from_its_class_defaults(ckpt, tmp_path):
    """config.json's text_config holds only what differs from its transformers class's defaults (openvla-7b's:
    model_type, pad_token_id, torch_dtype, vocab_size); the import fills the rest as OpenVLA's PrismaticConfig does."""
    from transformers import LlamaConfig
    defaults = LlamaConfig().to_dict()
    full = text_config(TinyOpenVLA())
    sparse = {k: v for k, v in full.items() if k == "model_type" or defaults.get(k, object()) != v}
    assert "hidden_size" in sparse and "hidden_act" not in sparse and "bos_token_id" not in sparse
    out = _broken(ckpt, tmp_path, "sparse", lambda c: c.update(text_config=sparse))
    ck = read_checkpoint(out)
    assert (ck.llm_dim, ck.text_config["hidden_act"], ck.text_config["num_hidden_layers"]) == (128, "silu", 2)
    meta = export_openvla(out, tmp_path / "o-sparse", unnorm_key="bridge_orig", progress=False)
    assert meta["end_to_end_gate"]["passed"]
    # openvla-7b's own text_config: the rest is Llama 2 7B's (LlamaConfig's defaults), which this checkpoint is not
    seven_b = {"model_type": "llama", "pad_token_id": 32000, "torch_dtype": "bfloat16", "vocab_size": 32064}
    with pytest.raises(OpenVLAFormatError, match="into a language model of width 4096"):
        read_checkpoint(_broken(ckpt, tmp_path, "7b", lambda c: c.update(text_config=seven_b)))
    with pytest.raises(OpenVLAFormatError, match="into a language model of width 4096"):
        read_checkpoint(_broken(ckpt, tmp_path, "none", lambda c: (c.pop("text_config"),
                                                                    c.update(llm_backbone_id="llama2-7b-pure"))))
    with pytest.raises(OpenVLAFormatError, match="llm_backbone_id 'gpt-9' is not one OpenVLA defines; known: "):
        read_checkpoint(_broken(ckpt, tmp_path, "gpt", lambda c: (c.pop("text_config"),
                                                                   c.update(llm_backbone_id="gpt-9"))))


def test_a_weight_of_the_wrong_shape_is_one_line(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    out = _broken(ckpt, tmp_path, "shape")
    w = load_file(str(out / "model.safetensors"))
    name = "language_model.model.layers.1.mlp.down_proj.weight"
    w[name] = w[name][:, :8].contiguous()
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(OpenVLAFormatError) as e:
        export_openvla(out, tmp_path / "o-shape", unnorm_key="bridge_orig", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and f"1 weight does not fit config.json: {name}: expected (128, 256), got (128, 8)" in msg
    assert not (tmp_path / "o-shape").exists()


def _wide_draft(tmp_path):
    out = tmp_path / "wide-draft"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 1024}))
    return out


def test_manifest_takes_words_or_a_prompt(engine):
    from edgespec.policy_contract import PolicyFileError, PolicyManifest
    meta = json.loads((engine / "policy.json").read_text())
    PolicyManifest.from_dict(meta, engine / "policy.json")
    for edit, msg in ((dict(words=["<pad>", "go"], instr_len=2), "words: expected null with a prompt"),
                      (dict(prompt=None), "words: expected distinct strings"),
                      (dict(prompt={**meta["prompt"], "template": "no placeholder"}), "prompt: expected an object"),
                      (dict(prompt={**meta["prompt"], "tokenizer_file": "../t.json"}), "prompt: expected an object")):
        with pytest.raises(PolicyFileError, match=msg):
            PolicyManifest.from_dict({**meta, **edit}, engine / "policy.json")


def test_cli_export_policy_dispatches_on_the_layout(ckpt, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "edgespec", "export-policy", str(ckpt), "--out", str(out),
                        "--unnorm-key", "fractal20220817_data", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OpenVLA checkpoint, statistics 'fractal20220817_data', 1 x 7 action tokens" in r.stdout
    assert json.loads((out / "policy.json").read_text())["source"]["unnorm_key"] == "fractal20220817_data"
    r = subprocess.run([sys.executable, "-m", "edgespec", "export-policy", "models/vla-reacher", "--out",
                        str(tmp_path / "x"), "--unnorm-key", "bridge_orig"], capture_output=True, text=True)
    assert r.returncode != 0 and "--unnorm-key: only for OpenVLA and Llava checkpoints" in r.stderr


def test_hidden_state_draft_head_is_exact(ckpt, tmp_path):
    """A prompt policy's draft head reads the target's final hidden state at the prefix's last position (its
    prefix length varies with the prompt): exported with --draft-head, the target then outputs its hidden state;
    speculative ids equal plain ones; a head of another context size or bin count is refused by name."""
    from conftest import random_draft_head

    from edgespec import load_policy
    head = tmp_path / "draft_head.npz"
    random_draft_head(1, 128, 256, 1, 7, seed=3).save(head)
    export_openvla(ckpt, tmp_path / "eng", unnorm_key="bridge_orig", draft_head=head, progress=False)
    plain = load_policy(tmp_path / "eng")
    spec = load_policy(tmp_path / "eng", draft="head", gamma=6, stop_below=0.0)
    assert spec.target.caps.hidden and type(spec._head_draft).from_prefix is False
    rng = np.random.default_rng(2)
    drafted = 0
    for instr in ("open the drawer", "put the spoon in the bowl", "pick up the red cup"):
        img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        np.testing.assert_array_equal(spec.act(img, None, instr), plain.act(img, None, instr))
        drafted += spec.last_info["drafted"]
    assert drafted > 0
    # with the last chunk: its rounds never come between the prefill and the head's start (which reads the
    # prefill's rows), and a repeated chunk takes one target call
    from edgespec.last_chunk import LastChunk
    last = load_policy(tmp_path / "eng", draft="head", gamma=6, stop_below=0.0, last_chunk=True)
    img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    prefix = plain.encode(img, None, "open the drawer")
    want = plain.decode_ids(prefix)[0]
    for rec in (LastChunk(tuple(want), True), LastChunk(tuple(want[:3]) + (want[3] ^ 1,) * 4, False),
                LastChunk(tuple(want[:3]) + (want[3] ^ 1,) * 4, True)):
        got, info = last.decode_ids(prefix, last=rec)
        assert got == want and (info["target_calls"] == 1) == (rec.repeated and list(rec.ids) == want), (rec, info)
    for bad, msg in ((random_draft_head(1, 64, 256, 1, 7), r"reads 64 values and proposes 256 bins for 1x7"),
                     (random_draft_head(1, 128, 128, 1, 7), r"proposes 128 bins")):
        bad.save(head)
        with pytest.raises(ValueError, match=msg):
            export_openvla(ckpt, tmp_path / "bad", unnorm_key="bridge_orig", draft_head=head, progress=False)


def test_real_size_standin_computes_the_same_policy(ckpt, draft_lm, tmp_path):
    """export/openvla_standin.py at a small shape: the inflated policy (wider stream, more heads, layers and MLP
    channels) decodes the source policy's ids, plain and with its widened draft decoder, draft head and feature head;
    the widened feature head proposes what the source's does from the zero-padded hidden state."""
    from conftest import random_draft_head, random_text_head

    from edgespec import load_policy
    from edgespec.export.openvla_standin import make_openvla_standin
    from edgespec.export.standin import Shape
    from edgespec.text_head import TextHead, TextHeadWeights
    src = tmp_path / "src"
    src.mkdir()
    (src / "target").symlink_to(ckpt)
    (src / "draft").symlink_to(draft_lm)
    random_draft_head(1, 128, 256, 1, 7, seed=5).save(src / "draft_head.npz")
    ck = read_checkpoint(ckpt)
    fw = random_text_head(128, int(ck.text_config["vocab_size"]), seed=6)
    fw.vocab = np.arange(ck.vocab_end - ck.n_bins, ck.vocab_end)  # the action ids
    TextHeadWeights(fw.w_h, fw.w_e, fw.b_in, fw.w_out, fw.b_out, fw.embed, fw.embed[fw.vocab], fw.vocab).save(
        src / "feature_head.npz")
    make_openvla_standin(src, tmp_path / "big", shape=Shape(256, 8, 4, 64, 512, 3), progress=False)
    narrow, wide = TextHead.load(src / "feature_head.npz"), TextHead.load(tmp_path / "big" / "feature_head.npz")
    assert wide.w.embed.shape[1] == 256
    rng = np.random.default_rng(9)
    for _ in range(5):
        h, x = rng.normal(0, 1, 128).astype(np.float32), int(rng.integers(0, 100))
        a, b = narrow.first(h, x), wide.first(np.concatenate([h, np.zeros(128, np.float32)]), x)
        for _ in range(3):
            assert a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-5)
            a, b = narrow.next(a[0]), wide.next(b[0])
    kw = dict(unnorm_key="bridge_orig", progress=False)
    export_openvla(src / "target", tmp_path / "e-small", **kw)
    export_openvla(tmp_path / "big" / "target", tmp_path / "e-big", draft=tmp_path / "big" / "draft",
                   draft_head=tmp_path / "big" / "draft_head.npz", feature_head=tmp_path / "big" / "feature_head.npz",
                   **kw)
    small = load_policy(tmp_path / "e-small")
    bigs = [load_policy(tmp_path / "e-big"), load_policy(tmp_path / "e-big", draft=True),
            load_policy(tmp_path / "e-big", draft="head"), load_policy(tmp_path / "e-big", draft="feature-head")]
    assert bigs[0].target.m.hidden_size == 256 and bigs[0].target.m.num_layers == 3
    rng = np.random.default_rng(8)
    for instr in ("open the drawer", "put the spoon in the bowl"):
        img = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        want = small.act(img, None, instr)
        for p in bigs:
            np.testing.assert_array_equal(p.act(img, None, instr), want)


def test_feature_head_for_a_prompt_policy_is_exact(ckpt, tmp_path):
    """A feature head (train_feature_head.py: the target's greedy chunks and hidden states, as the runtime builds the
    prompt's prefix) exported with --feature-head: draft='head' uses it when there is no per-dimension head; its ids
    equal plain ones, and its drafted and accepted counts equal a replay of the rounds on the torch target's hidden
    states. A head of another target is refused by name."""
    from conftest import random_text_head

    from edgespec import load_policy
    from edgespec.export.training.train_feature_head import greedy_chunks, load_policy_model, replay_rounds
    from edgespec.export.training.train_text_head import HeadConfig, train
    from edgespec.export.vlm_policy import INSTRUCTIONS
    from edgespec.text_head import TextHead
    groups, lm, _, ids_range, end, n = load_policy_model(ckpt)
    assert end is None and n == 7
    rng = np.random.default_rng(4)

    def obs(k):
        s = read_checkpoint(ckpt).image_size
        return {"image": rng.integers(0, 256, (k, s, s, 3), dtype=np.uint8),
                "instruction": np.array([INSTRUCTIONS[i % 3] for i in range(k)])}
    data = greedy_chunks(groups, lm, obs(96), ids_range, end, n)
    assert data["valid"][:, :n].all()  # no END: every chunk has n ids
    embed, lm_w = lm.get_input_embeddings().weight.detach().numpy(), lm.lm_head.weight.detach().numpy()
    w, _ = train(data, data, embed, lm_w, HeadConfig(hidden=64, seq_len=n + 1, unroll=3, epochs=20, batch=64, lr=5e-3),
                 progress=False, vocab=np.unique(data["greedy"][data["valid"]]), report=lambda w, v: {})
    head = tmp_path / "feature_head.npz"
    w.save(head)
    meta = export_openvla(ckpt, tmp_path / "eng", unnorm_key="bridge_orig", feature_head=head, progress=False)
    assert meta["end_to_end_gate"]["passed"] and meta["feature_head_sha256"]
    plain = load_policy(tmp_path / "eng")
    spec = load_policy(tmp_path / "eng", draft="head", gamma=3, stop_below=0.0)
    assert spec.target.caps.hidden and spec.head.w.embed.shape == embed.shape
    test = obs(9)
    want = greedy_chunks(groups, lm, test, ids_range, end, n)
    drafted = accepted = 0
    for i in range(9):
        prefix = plain.encode(test["image"][i], None, str(test["instruction"][i]))
        ids, _ = plain.decode_ids(prefix)
        got, info = spec.decode_ids(prefix)
        assert got == ids == want["ids"][i, 1:].tolist()
        drafted, accepted = drafted + info["drafted"], accepted + info["accepted"]
    replay = replay_rounds(TextHead.load(head), want, 3)
    assert (drafted, accepted) == (replay["drafted"], replay["accepted"]) and accepted > 0
    random_text_head(64, embed.shape[0]).save(head)
    with pytest.raises(ValueError, match=r"--feature-head .* was trained on a target with a \(\d+, 64\) embedding"):
        export_openvla(ckpt, tmp_path / "bad", unnorm_key="bridge_orig", feature_head=head, progress=False)


def test_the_export_holds_one_copy_of_the_language_model(ckpt, draft_lm, tmp_path, monkeypatch):
    """Memory at real size: while export_engine runs, the torch reference's language model holds no weights (the
    exporter reads its own copy from disk); the gate's staged policies are loaded one at a time, after the
    reference ran; and the caller's model is whole again afterwards, equal to before."""
    import gc
    import weakref

    from edgespec import policy as policy_mod
    from edgespec.export import vlm_policy
    from edgespec.export.openvla import openvla_source
    from conftest import random_draft_head, random_text_head

    src = openvla_source(ckpt)
    before = {n: p.detach().clone() for n, p in src.language_model.named_parameters()}
    held_during_export = []
    real_export = vlm_policy.export_engine

    def export_engine(*a, **kw):
        if kw.get("role") == "target":
            held_during_export.append(sum(p.numel() for p in src.language_model.parameters()))
        return real_export(*a, **kw)

    live, most_live, reference_calls_after_a_policy, held_at_policy = weakref.WeakSet(), [0], [], []
    real_policy, real_ref = policy_mod.Policy, src.reference_action_ids

    class CountedPolicy(real_policy):
        def __init__(self, *a, **kw):
            gc.collect()
            held_at_policy.append(sum(p.numel() for p in src.language_model.parameters()))
            super().__init__(*a, **kw)
            live.add(self)
            most_live[0] = max(most_live[0], len(live))

    def reference_action_ids(*a, **kw):
        reference_calls_after_a_policy.append(len(live))
        return real_ref(*a, **kw)

    monkeypatch.setattr(vlm_policy, "export_engine", export_engine)
    monkeypatch.setattr(policy_mod, "Policy", CountedPolicy)
    monkeypatch.setattr(src, "reference_action_ids", reference_action_ids)
    head, feature = tmp_path / "draft_head.npz", tmp_path / "feature_head.npz"
    random_draft_head(1, 128, 256, 1, 7, seed=3).save(head)
    import dataclasses
    w = random_text_head(128, int(read_checkpoint(ckpt).text_config["vocab_size"]), seed=4)
    acts = np.arange(src.vocab_end - src.n_bins, src.vocab_end)  # a feature head proposes action ids only
    dataclasses.replace(w, lm=w.embed[acts], vocab=acts).save(feature)
    meta = vlm_policy.export_vlm_policy(src, tmp_path / "eng", unnorm_key="bridge_orig", draft=draft_lm,
                                        draft_head=head, feature_head=feature, progress=False)
    assert held_during_export == [0]
    assert most_live[0] == 1 and set(reference_calls_after_a_policy) == {0} and held_at_policy == [0, 0, 0]
    assert meta["end_to_end_gate"]["passed"] and meta["end_to_end_gate"]["ids_enforced"]
    after = dict(src.language_model.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_the_reference_reads_its_weights_without_a_memory_map(ckpt, tmp_path, monkeypatch):
    """load_state reads each tensor into its own array (SafetensorsFile), never through safetensors' memory map,
    whose pages stay resident beside the fp32 model (5 GB at 3B); a bf16 file loads as its exact float32 values."""
    import shutil

    import safetensors
    from safetensors.torch import load_file, save_file

    def no_map(*a, **k):
        raise AssertionError("load_state memory-mapped a weight file")
    src = load_file(str(ckpt / "model.safetensors"))
    bf = tmp_path / "bf16"
    shutil.copytree(ckpt, bf)
    save_file({k: v.to(torch.bfloat16) for k, v in src.items()}, str(bf / "model.safetensors"))
    ck = read_checkpoint(bf)  # reads the header (shapes) only
    monkeypatch.setattr(safetensors, "safe_open", no_map)
    state = build_reference(ck).state_dict()
    for k, v in src.items():
        if k in state:
            assert torch.equal(state[k], v.to(torch.bfloat16).float()), k

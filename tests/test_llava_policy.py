"""A VLA built from transformers' own classes (LlavaForConditionalGeneration: CLIP or SigLIP tower, Llama or Qwen2
language model) exported through the same path as OpenVLA's (export/llava.py, export/vlm_policy.py): the image rows
in place of the prompt's image token, ids equal to transformers' own forward pass, and its bad inputs refused."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from edgespec.export.llava import export_llava, write_llava_checkpoint  # noqa: E402
from edgespec.export.prismatic import VLMFormatError  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    return {"clip-qwen2": write_llava_checkpoint(root / "clip-qwen2"),
            "siglip-llama": write_llava_checkpoint(root / "siglip-llama", vision="siglip", text="llama", seed=1),
            "clip-mistral": write_llava_checkpoint(root / "clip-mistral", text="mistral", seed=2)}


@pytest.mark.parametrize("name", ["clip-qwen2", "siglip-llama", "clip-mistral"])
def test_export_matches_transformers_forward(ckpts, name, tmp_path):
    """The export's end-to-end gate compares against transformers' LlavaForConditionalGeneration (image token
    expanded, its own feature merge); here the loaded policy is checked once more on other observations."""
    from transformers import LlavaForConditionalGeneration

    from edgespec import load_policy
    meta = export_llava(ckpts[name], tmp_path / "eng", unnorm_key="bridge_orig", progress=False)
    gate = meta["end_to_end_gate"]
    assert gate["passed"] and gate["ids_equal"] == gate["ids"] == 28
    pol = load_policy(tmp_path / "eng")
    assert pol.prompt["image_token_id"] == 961 and pol.prefix_len == 16  # (56 / 14)^2 rows, the CLS row dropped
    model = LlavaForConditionalGeneration.from_pretrained(ckpts[name], dtype=torch.float32).eval()
    pre = json.loads((ckpts[name] / "preprocessor_config.json").read_text())
    mean, std = (torch.tensor(pre[k]).view(1, 3, 1, 1) for k in ("image_mean", "image_std"))
    rng = np.random.default_rng(4)
    for instr in ("open the drawer", "put the red block in the bowl"):
        img = rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
        prefix = pol.encode(img, None, instr)
        ids = pol.instruction_ids(instr)[0].tolist()
        at = ids.index(961)
        seq = torch.tensor([ids[:at] + [961] * 16 + ids[at + 1:]])
        pixels = (torch.from_numpy(img[None]).permute(0, 3, 1, 2).float() / 255 - mean) / std
        got, _ = pol.decode_ids(prefix)
        want = []
        with torch.no_grad():
            for _ in range(7):
                want.append(int(model(input_ids=seq, pixel_values=pixels).logits[0, -1, 960 - 256:960].argmax()) + 704)
                seq = torch.cat([seq, torch.tensor([[want[-1]]])], 1)
        assert got == want


def test_bad_llava_inputs(ckpts, tmp_path):
    src = ckpts["clip-qwen2"]
    with pytest.raises(VLMFormatError, match="must hold <image> once"):
        export_llava(src, tmp_path / "o1", unnorm_key="bridge_orig", prompt_template="do {instruction}",
                     progress=False)
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("norm_stats")
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VLMFormatError, match="has no norm_stats; give the action statistics with --action-stats"):
        export_llava(bare, tmp_path / "o2", progress=False)
    stats = tmp_path / "reacher.json"
    stats.write_text(json.dumps({"q01": [-0.2, -0.2], "q99": [0.2, 0.2]}))
    meta = export_llava(bare, tmp_path / "o3", action_stats=stats, action_names=["fingertip.x", "fingertip.y"],
                        action_units=["m", "m"], action_kind="cartesian_position", progress=False)
    assert (meta["dims"], meta["source"]["unnorm_key"]) == (2, "reacher")
    with pytest.raises(ValueError, match="need 2 entries each, got 1 and 2"):
        export_llava(bare, tmp_path / "o4", action_stats=stats, action_names=["x"], action_units=["m", "m"],
                     progress=False)
    (bare / "preprocessor_config.json").write_text("{}")
    with pytest.raises(VLMFormatError, match="needs image_mean and image_std"):
        export_llava(bare, tmp_path / "o5", action_stats=stats, progress=False)


def test_weights_that_do_not_fit_are_refused(ckpts, tmp_path):
    """transformers would fill a missing or misshapen weight randomly (and the gate, run against that same model,
    would pass): the import refuses it in one line naming the weight."""
    from safetensors.torch import load_file, save_file
    name = "language_model.model.layers.1.mlp.down_proj.weight"
    for case in ("missing", "shape", "extra"):
        d = tmp_path / case
        shutil.copytree(ckpts["clip-qwen2"], d)
        w = load_file(str(d / "model.safetensors"))
        if case == "missing":
            w.pop(name)
        elif case == "shape":
            w[name] = w[name][:, :8].contiguous()
        else:
            w["language_model.model.layers.9.mlp.up_proj.weight"] = w[name].clone()
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(VLMFormatError) as e:
            export_llava(d, tmp_path / f"o-{case}", unnorm_key="bridge_orig", progress=False)
        msg = str(e.value)
        assert "\n" not in msg and "the weights do not fit config.json's Llava model" in msg
        assert {"missing": "missing ['model.language_model.layers.1.mlp.down_proj.weight']",
                "shape": "of the wrong shape model.language_model.layers.1.mlp.down_proj.weight: expected (128, 256), "
                         "got (128, 8)",
                "extra": "unexpected ["}[case] in msg, msg
        assert not (tmp_path / f"o-{case}").exists()


def test_horizon_reshapes_repeating_statistics(ckpts, tmp_path):
    """A chunked fine-tune: 4 x 2 statistics repeating every step export as H=4, D=2; ones that do not repeat are
    refused."""
    stats = tmp_path / "chunk.json"
    stats.write_text(json.dumps({"q01": [-0.2, -0.1] * 4, "q99": [0.2, 0.1] * 4}))
    meta = export_llava(ckpts["clip-qwen2"], tmp_path / "h4", action_stats=stats, horizon=4,
                        action_names=["fingertip.x", "fingertip.y"], action_units=["m", "m"],
                        action_kind="cartesian_position", progress=False)
    assert (meta["horizon"], meta["dims"], meta["end_to_end_gate"]["ids"]) == (4, 2, 32)
    from edgespec import load_policy
    a = load_policy(tmp_path / "h4").act(np.zeros((56, 56, 3), np.uint8), None, "open the drawer")
    assert a.shape == (4, 2)
    stats.write_text(json.dumps({"q01": [-0.2, -0.1, -0.3, -0.1] * 2, "q99": [0.2, 0.1] * 4}))
    with pytest.raises(ValueError, match="do not repeat every 2"):
        export_llava(ckpts["clip-qwen2"], tmp_path / "h4b", action_stats=stats, horizon=4, progress=False,
                     action_names=["a", "b"], action_units=["m", "m"])


def test_cli_exports_llava(ckpts, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgespec", "export-policy", str(ckpts["siglip-llama"]), "--out",
                        str(tmp_path / "cli"), "--unnorm-key", "bridge_orig", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Llava checkpoint, statistics 'bridge_orig', 1 x 7 action tokens" in r.stdout

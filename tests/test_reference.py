"""The eager reference decoder matches transformers' own forward (fp32, 1e-4) on every supported family."""
import json

import pytest
import torch

from conftest import FAMILIES
from edgespec.export.checkpoint import CheckpointError, ModelSpec, load_checkpoint
from edgespec.export.reference import ReferenceDecoder


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_matches_transformers(tiny_checkpoints, family):
    path, hf = tiny_checkpoints[family]
    ref = ReferenceDecoder.from_pretrained(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ref(ids)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{family}: max |reference - transformers| = {err:.2e}"


def test_sliding_window_changes_the_output(tiny_checkpoints):
    """Guards the test above: a window of 8 over 40 tokens must matter, or the mistral-window case proves nothing."""
    path, _ = tiny_checkpoints["mistral-window"]
    ref = ReferenceDecoder.from_pretrained(path)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    windowed = ref(ids)
    for layer in ref.spec.layers:
        layer.window = None
    assert (ref(ids) - windowed)[:, 9:].abs().max() > 1e-3


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="gpt2.*supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3, smollm3"):
        load_checkpoint(tmp_path)


def test_missing_weight_file_is_named(tmp_path, tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)


def test_corrupt_weight_file_is_named(tmp_path, tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt"):
        load_checkpoint(tmp_path)


def test_config_inconsistent_with_weights_names_the_tensor(tmp_path, tiny_checkpoints):
    path, _ = tiny_checkpoints["llama"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight.*shape \\(48, 32\\).*\\(64, 32\\)"):
        load_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path, tiny_checkpoints):
    from safetensors.numpy import load_file, save_file
    path, _ = tiny_checkpoints["llama"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    del w["model.layers.1.self_attn.k_proj.weight"]
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight.*missing"):
        load_checkpoint(tmp_path)


def test_gqa_heads_must_divide():
    with pytest.raises(CheckpointError, match="multiple of"):
        ModelSpec.from_config({"model_type": "llama", "vocab_size": 8, "hidden_size": 12, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2})

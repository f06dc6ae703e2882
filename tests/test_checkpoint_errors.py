"""Bad checkpoints are refused with one line naming the file, the field or tensor, what was expected and what
was got: an unsupported family, a field the family needs, an option not implemented, a shard missing."""
import json
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from edgespec.export.checkpoint import CheckpointError, ModelSpec, load_checkpoint


def _cfg(tiny_checkpoints, family):
    return json.loads((tiny_checkpoints[family][0] / "config.json").read_text())


@pytest.mark.parametrize("model_type,why", [("gemma3", "multimodal"), ("mixtral", "mixture of experts"),
                                            ("gpt2", None)])
def test_an_unsupported_family_is_refused_with_the_supported_list(model_type, why):
    with pytest.raises(CheckpointError) as e:
        ModelSpec.from_config({"model_type": model_type}, source="ck/config.json")
    msg = str(e.value)
    assert msg.startswith("ck/config.json: unsupported architecture") and "\n" not in msg
    assert "supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3, smollm3" in msg
    assert why is None or why in msg


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3", "smollm3"])
@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"])
def test_a_missing_required_field_is_named(tiny_checkpoints, family, field):
    cfg = _cfg(tiny_checkpoints, family)
    del cfg[field]
    with pytest.raises(CheckpointError, match=f"x/config.json: missing required field '{field}' "
                                              f"\\(model_type '{cfg['model_type']}' needs it\\)"):
        ModelSpec.from_config(cfg, source="x/config.json")


@pytest.mark.parametrize("family,change,match", [
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true is not supported"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types must list one of"),
    ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types must list one of"),
    ("smollm3", {"no_rope_layers": [1]}, "no_rope_layers must hold one 0/1 per layer \\(2\\)"),
    ("llama", {"rope_parameters": {"rope_type": "su2", "rope_theta": 1.0}}, "rope type 'su2' is not supported"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "longrope needs short_factor"),
    ("llama", {"hidden_size": "big"}, "field 'hidden_size' must be int, got 'big'"),
    ("mistral", {"sliding_window": -4}, "sliding_window must be null or an integer > 0, got -4"),
])
def test_an_option_not_implemented_is_refused_by_name(tiny_checkpoints, family, change, match):
    cfg = {**_cfg(tiny_checkpoints, family), **change}
    with pytest.raises(CheckpointError, match=match):
        ModelSpec.from_config(cfg, source="x/config.json")


def test_a_missing_shard_is_named(tiny_checkpoints, tmp_path):
    """A checkpoint split into two shards with an index; one shard deleted."""
    path, _ = tiny_checkpoints["qwen3"]
    shutil.copy2(path / "config.json", tmp_path / "config.json")
    w = load_file(str(path / "model.safetensors"))
    names = sorted(w)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in parts.items():
        save_file({k: w[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    spec, weights = load_checkpoint(tmp_path)  # both shards there: loads
    assert spec.model_type == "qwen3" and "model.layers.1.self_attn.q_norm.weight" in weights
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard listed in "
                                              "model.safetensors.index.json is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object with a 'weight_map'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("family,tensor", [("phi3", "model.layers.0.self_attn.qkv_proj.weight"),
                                           ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
                                           ("gemma3", "model.layers.0.pre_feedforward_layernorm.weight")])
def test_a_family_tensor_missing_is_named(tiny_checkpoints, tmp_path, family, tensor):
    path, _ = tiny_checkpoints[family]
    shutil.copy2(path / "config.json", tmp_path / "config.json")
    w = load_file(str(path / "model.safetensors"))
    del w[tensor]
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{tensor}' is missing"):
        load_checkpoint(tmp_path)


def test_fused_shapes_disagreeing_with_the_config_are_named(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["phi3"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="qkv_proj.weight' has shape \\(64, 32\\) but config.json implies "
                                              "\\(96, 32\\)"):
        load_checkpoint(tmp_path)

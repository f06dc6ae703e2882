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
    ("llama", {"hidden_size": "big"}, "field 'hidden_size' must be an integer >= 1, got 'big'"),
    ("mistral", {"sliding_window": -4}, "field 'sliding_window' must be an integer >= 1, got -4"),
])
def test_an_option_not_implemented_is_refused_by_name(tiny_checkpoints, family, change, match):
    cfg = {**_cfg(tiny_checkpoints, family), **change}
    with pytest.raises(CheckpointError, match=match):
        ModelSpec.from_config(cfg, source="x/config.json")


@pytest.mark.parametrize("family,change,match", [
    ("llama", {"num_attention_heads": 0}, "field 'num_attention_heads' must be an integer >= 1, got 0"),
    ("llama", {"num_key_value_heads": 0}, "field 'num_key_value_heads' must be an integer >= 1, got 0"),
    ("llama", {"vocab_size": 0}, "field 'vocab_size' must be an integer >= 1, got 0"),
    ("llama", {"intermediate_size": -5}, "field 'intermediate_size' must be an integer >= 1, got -5"),
    ("llama", {"hidden_size": 64.5}, "field 'hidden_size' must be an integer >= 1, got 64.5"),
    ("llama", {"num_hidden_layers": "2"}, "field 'num_hidden_layers' must be an integer >= 1, got '2'"),
    ("llama", {"hidden_size": 66, "head_dim": None}, "hidden_size 66 is not a multiple of num_attention_heads"),
    ("llama", {"rope_scaling": "linear", "rope_parameters": None}, "field 'rope_scaling' must be an object"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": "big"}},
     "field rope 'rope_theta' must be a positive number, got 'big'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "x"}},
     "field rope 'factor' must be a positive number, got 'x'"),
    ("llama", {"rms_norm_eps": -1e-6}, "field 'rms_norm_eps' must be a positive number, got -1e-06"),
    ("gemma3", {"sliding_window_pattern": 0, "layer_types": None},
     "field 'sliding_window_pattern' must be an integer >= 1, got 0"),
    ("smollm3", {"no_rope_layer_interval": 0, "no_rope_layers": None},
     "field 'no_rope_layer_interval' must be an integer >= 1, got 0"),
    ("qwen3", {"max_window_layers": "x", "layer_types": None, "use_sliding_window": True, "sliding_window": 8},
     "field 'max_window_layers' must be an integer >= 0, got 'x'"),
    ("phi3", {"partial_rotary_factor": "half", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "field 'partial_rotary_factor' must be a positive number, got 'half'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "field 'partial_rotary_factor' must be in \\(0, 1\\], got 1.5"),
])
def test_a_malformed_value_is_refused_by_name(tiny_checkpoints, family, change, match):
    """A value of the wrong kind or range ends in one line naming the file and the field, never a traceback from
    a division by zero or a bare float()."""
    cfg = {**_cfg(tiny_checkpoints, family), **change}
    with pytest.raises(CheckpointError, match="x/config.json: .*" + match) as e:
        ModelSpec.from_config(cfg, source="x/config.json")
    assert "\n" not in str(e.value)


MINIMAL = dict(hidden_size=1024, num_attention_heads=32, num_hidden_layers=32, vocab_size=1000, intermediate_size=512)


@pytest.mark.parametrize("model_type", ["gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3"])
@pytest.mark.parametrize("extra", [{}, {"num_key_value_heads": 16, "use_sliding_window": True, "sliding_window": 64},
                                   {"sliding_window": None, "bos_token_id": None}])
def test_absent_fields_take_the_defaults_of_transformers_classes(model_type, extra):
    """A saved config.json holds only what differs from its class's defaults; the spec read from it must equal the
    one read from the same config completed by transformers (its to_dict: every field written out)."""
    from dataclasses import asdict
    transformers = pytest.importorskip("transformers")
    sparse = {"model_type": model_type, **MINIMAL, **extra}
    full = transformers.AutoConfig.for_model(model_type, **MINIMAL, **extra).to_dict()
    assert asdict(ModelSpec.from_config(sparse)) == asdict(ModelSpec.from_config(full))


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


def _legacy_configs() -> dict:
    """config.json as the Hub's checkpoints of each family write it (transformers 4: top-level rope_theta and
    rope_scaling, Gemma 3's rope_local_base_freq and sliding_window_pattern, SmolLM3's interval), at small sizes."""
    base = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=12, vocab_size=512,
                intermediate_size=512)
    return {
        "llama-3.2": {"model_type": "llama", **base, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
        "qwen2.5": {"model_type": "qwen2", **base, "rope_theta": 1000000.0, "use_sliding_window": False,
                    "sliding_window": 32768, "max_window_layers": 21, "max_position_embeddings": 32768},
        "gemma-3": {"model_type": "gemma3_text", **base, "head_dim": 32, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 20000.0, "sliding_window": 512, "sliding_window_pattern": 6,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "query_pre_attn_scalar": 32},
        "phi-4-mini": {"model_type": "phi3", **base, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
                       "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                       "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 12,
                                        "long_factor": [1.5] * 12}},
        "smollm3": {"model_type": "smollm3", **base, "rope_theta": 5000000.0, "no_rope_layer_interval": 4,
                    "max_position_embeddings": 65536},
    }


@pytest.mark.parametrize("name", sorted(_legacy_configs()))
def test_the_hubs_older_config_format_reads_as_transformers_reads_it(name):
    """transformers 5 turns the older keys into rope_parameters and layer_types; the spec read from the older file
    must equal the one read from transformers' own rewrite of it."""
    from dataclasses import asdict
    transformers = pytest.importorskip("transformers")
    legacy = _legacy_configs()[name]
    rewritten = transformers.AutoConfig.for_model(**legacy).to_dict()
    assert "rope_parameters" in rewritten
    spec = ModelSpec.from_config(legacy)
    assert asdict(spec) == asdict(ModelSpec.from_config(rewritten))
    assert spec.rope.theta == legacy["rope_theta"]

"""Every supported family (checkpoint.SUPPORTED_ARCHITECTURES) against transformers' own model, through both
graph flavours: greedy ids equal to transformers' generate(), a speculative run equal to plain decoding.

Each family is a small random-initialised config of its transformers class, with the options that make it
differ from Llama switched on (biases, q/k norms, windows on some layers, several rotaries, partial rotary,
layers without rotary). Head size 16 lets ONNX Runtime's GroupQueryAttention run the ort flavour fused; the
tiny head size 8 of conftest's FAMILIES exercises its standard-ops fallback.
"""
import numpy as np
import pytest
import torch
import transformers

import edgespec
from conftest import MODEL_CLASSES, char_tokenizer_json
from edgespec import contract as C
from edgespec.backends.ort import OrtEngine
from edgespec.export.onnx_export import export_engine

H16 = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**H16, attention_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": lambda: transformers.MistralConfig(**H16, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**H16, tie_word_embeddings=True, use_sliding_window=True,
                                              sliding_window=8, max_window_layers=2),
    "qwen3": lambda: transformers.Qwen3Config(**H16, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **H16, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    "phi3": lambda: transformers.Phi3Config(  # head size 32, 16 rotary dims (Phi-4-mini rotates 3/4 of them)
        **{**H16, "num_attention_heads": 2, "num_key_value_heads": 1}, original_max_position_embeddings=128,
        sliding_window=12, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5,
                                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                            "long_factor": [2.0] * 8}),
    "smollm3": lambda: transformers.SmolLM3Config(**H16, no_rope_layers=[1, 1, 0]),
}
PROMPTS = [[5, 17, 3, 60, 42, 9, 11], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], list(range(30, 52))]
NEW = 24


def _make(cfg, path, seed):
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[cfg.model_type])(cfg).eval()
    with torch.no_grad():  # HF inits small; widen so that differences show
        for p in model.parameters():
            p.normal_(0, 0.2)
        if getattr(cfg, "tie_word_embeddings", False):
            model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    char_tokenizer_json(path / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (checkpoint, transformers model, {flavor: engine folder})."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        model = _make(cfg(), root / "ck" / name, seed=40 + i)
        engines = {}
        for flavor in ("ort", "portable"):
            engines[flavor] = root / f"{name}-{flavor}"
            export_engine(root / "ck" / name, engines[flavor], max_context=96, flavor=flavor, progress=False)
        out[name] = (root / "ck" / name, model, engines)
    return out


def hf_greedy(model, prompt, n=NEW):
    """transformers' own greedy decoding (its KV cache, its masks): the new ids."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_ort_flavour_is_fused_for_every_family(families, name):
    m = C.Manifest.read(families[name][2]["ort"])
    assert m.flavor == "ort" and m.fusion["attention"] == "fused", m.fusion
    windows = [layer.window for layer in edgespec.export.checkpoint.ModelSpec.from_config(
        CONFIGS[name]().to_dict()).layers]
    assert m.layer_windows == (windows if any(windows) else None) and m.sliding_window is None


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_greedy_ids_equal_transformers_generate(families, name, flavor):
    ckpt, model, engines = families[name]
    gen = edgespec.load(engines[flavor])
    for prompt in PROMPTS:
        want = hf_greedy(model, prompt)
        got = gen.generate(prompt, max_new_tokens=NEW).token_ids
        assert got == want, (name, flavor, prompt)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_equals_plain(families, name):
    """The ort engine drafting for itself (every token accepted) and n-gram drafts (some rejected, so the
    cache rolls back across windowed and global layers): the same ids as plain decoding."""
    _, _, engines = families[name]
    plain = edgespec.load(engines["ort"])
    want = [plain.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
    for draft in (engines["portable"], "ngram"):
        gen = edgespec.load(engines["ort"], draft=draft, gamma=3)
        assert [gen.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS] == want, draft


NEW_FAMILIES = ["qwen2-window", "qwen3", "gemma3", "phi3", "smollm3"]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_ort_flavours_standard_attention_matches_transformers(tiny_checkpoints, tmp_path, family):
    """Head size 8: GroupQueryAttention's CPU kernel refuses it, so attention is standard ops (the fallback)."""
    ckpt, model = tiny_checkpoints[family]
    m = export_engine(ckpt, tmp_path / "e", max_context=48, flavor="ort", progress=False)
    assert m.fusion["attention"].startswith("standard ops")
    dec = OrtEngine(tmp_path / "e").decoder()
    ids = np.random.default_rng(3).integers(0, 96, size=(1, 40))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = np.array(dec(ids[:, :30]))
    dec.cache.commit(30)
    got = np.concatenate([got, np.array(dec(ids[:, 30:]))], axis=1)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_portable_graph_of_every_family_is_one_tensorrt_parses(families, name):
    """No GPU here: the portable graph is checked against what TensorRT 10's ONNX parser takes (its op list, opset
    range, constant axes). The ort flavour is refused by name: ONNX Runtime's contrib ops are not TensorRT layers."""
    import onnx

    from edgespec.export.tensorrt import tensorrt_problems
    engines = families[name][2]
    portable = onnx.load(str(engines["portable"] / "model.onnx"), load_external_data=False)
    assert tensorrt_problems(portable) == []
    ort = tensorrt_problems(onnx.load(str(engines["ort"] / "model.onnx"), load_external_data=False))
    assert "com.microsoft.GroupQueryAttention (not a standard ONNX op)" in ort


def test_tensorrt_problems_names_what_the_parser_refuses():
    import onnx
    from onnx import TensorProto, helper

    from edgespec.export.tensorrt import tensorrt_problems
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    starts = helper.make_tensor("starts", TensorProto.INT64, [1], [0])
    ends = helper.make_tensor("ends", TensorProto.INT64, [1], [2])
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"], name="cut"),
             helper.make_node("Det", ["s"], ["y"], name="det")]
    graph = helper.make_graph(nodes, "g", [x, axes], [y], initializer=[starts, ends])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert tensorrt_problems(model) == ["opset 21 (TensorRT 10 parses 9..20)", "Slice node 'cut': input 3 (axes) must "
                                        "be a constant", "Det (not an op TensorRT 10 parses)"]

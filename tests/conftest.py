"""Shared fixtures: tiny random checkpoints of each supported family, saved as HF folders."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the export tests need the export extra (torch)")
transformers = pytest.importorskip("transformers", reason="the export tests need the export extra (transformers)")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": lambda: transformers.LlamaConfig(**TINY, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-yarn-rope": lambda: transformers.LlamaConfig(**TINY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "mistral-window": lambda: transformers.MistralConfig(**TINY, sliding_window=8),
}
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def make_checkpoint(family: str, path, seed: int = 0):
    """Random-init a tiny HF model of `family`, save it (fp32 safetensors) under `path`; return the model."""
    cfg = FAMILIES[family]()
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[cfg.model_type])(cfg).eval()
    with torch.no_grad():  # HF inits small; widen so differences would show
        for p in model.parameters():
            p.normal_(0, 0.2)
        if getattr(cfg, "tie_word_embeddings", False):
            model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {fam: (root / fam, make_checkpoint(fam, root / fam, seed=i)) for i, fam in enumerate(FAMILIES)}

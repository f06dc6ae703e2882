"""Shared fixtures: tiny random checkpoints of each supported family, saved as HF folders."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("EDGESPEC_THREADS", "1")  # tiny test models gain nothing from more threads

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
    "qwen2-window": lambda: transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                                                     max_window_layers=1),  # layer 0 global, layer 1 windowed
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=8, attention_bias=True, tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(  # a windowed and a global layer, each with its rotary
        **TINY, head_dim=8, query_pre_attn_scalar=12, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    "phi3": lambda: transformers.Phi3Config(  # partial rotary, longrope (short factors up to 64 positions)
        **TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}),
    "smollm3": lambda: transformers.SmolLM3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                  no_rope_layers=[1, 0], attention_bias=True),
}
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM"}


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


CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # 96 symbols: a char-level tokenizer for the tiny models


def char_tokenizer_json(path, eos="\n"):
    """A tokenizers tokenizer.json mapping each of 96 characters to one id (id 95 = newline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


def set_eos(ckpt, eos):
    """The checkpoint's EOS in config.json and in generation_config.json (which save_pretrained writes from the
    config, and which transformers' generate() and the exporter read in place of config.json's)."""
    import json
    for name in ("config.json", "generation_config.json"):
        path = ckpt / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))


def _noisy_copy(src, dst, scale, seed):
    """A draft checkpoint: the target's weights plus Gaussian noise (partial, position-dependent acceptance)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    rng = np.random.default_rng(seed)
    w = load_file(str(src / "model.safetensors"))
    save_file({k: (v + rng.normal(0, scale, v.shape)).astype(v.dtype) for k, v in w.items()},
              str(dst / "model.safetensors"))


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory):
    """Engine folders: target, a noisy draft, the target as its own draft, a draft with another vocabulary,
    and a draft with a smaller context capacity. All share a char-level tokenizer (except 'other_vocab')."""
    import json
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("engines")
    ck = root / "ckpt"
    make_checkpoint("llama", ck / "target", seed=11)
    char_tokenizer_json(ck / "target" / "tokenizer.json")
    set_eos(ck / "target", 95)
    _noisy_copy(ck / "target", ck / "noisy", 0.05, seed=3)
    char_tokenizer_json(ck / "noisy" / "tokenizer.json")
    other = transformers.LlamaConfig(**{**TINY, "vocab_size": 128})
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(other).save_pretrained(ck / "other_vocab", safe_serialization=True)
    out = {}
    for name, src, cap in (("target", "target", 128), ("noisy", "noisy", 128), ("same", "target", 128),
                           ("other_vocab", "other_vocab", 128), ("short", "noisy", 48)):
        out[name] = root / name
        export_engine(ck / src, out[name], max_context=cap, progress=False)
    return out


import numpy as np  # noqa: E402


def policy_obs(seed: int):
    """A random (image, state, instruction) observation for the tiny policies."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), rng.normal(0, 1, 6),
            ["reach the red target", "go to the blue target", "touch the green target"][seed % 3])


def assert_fast_path_matches_reference(pol, seeds) -> None:
    """The policy's lean decoding and its generic-round reference give the same ids and statistics."""
    for seed in seeds:
        pre = pol.encode(*policy_obs(seed))
        fast, fi = pol.decode_ids(pre)
        ref, ri = pol.decode_ids(pre, reference=True)
        assert fast == ref
        for key in ("rounds", "drafted", "accepted", "target_calls", "draft_calls", "max_dev_bins"):
            assert fi[key] == ri[key], (key, fi, ri)


def random_draft_head(prefix_len: int, embed: int, n_ids: int, horizon: int, dims: int, hidden: int = 32,
                      radius: int = 6, seed: int = 0):
    """Random numpy draft-head weights (sharp logits, so argmax ties never happen)."""
    import numpy as np

    from edgespec.draft_head import DraftHeadWeights
    rng = np.random.default_rng(seed)

    def r(*shape, scale=1.0):
        return (rng.normal(0, 1, shape) * scale).astype(np.float32)
    r2 = 2 * radius + 1
    return DraftHeadWeights(r(prefix_len * embed, hidden, scale=0.05), r(hidden), r(horizon * dims, hidden),
                            r(n_ids + 1, hidden), r(n_ids + 1, hidden), r(r2 + 1, hidden), r(r2 + 1, hidden),
                            r(hidden, hidden, scale=0.2), r(hidden), r(hidden, n_ids, scale=2.0), r(n_ids),
                            r(hidden, r2, scale=2.0), r(r2), dims, horizon, radius)


def make_tiny_policy(model_dir, seed: int = 0, binary_dims=(), dims: int = 3):
    """A random-init VLA policy model folder in train_vla.py's format (tiny shapes), no training."""
    import json

    import torch

    from edgespec.actions import ActionStats
    from edgespec.export.vla_model import Pair, VLAConfig, save

    cfg = VLAConfig(hidden=64, heads=2, target_layers=2, target_inter=128, draft_layers=1, draft_inter=64,
                    keypoints=8, horizon=4, dims=dims)
    torch.manual_seed(seed)
    pair = Pair(cfg)
    with torch.no_grad():  # sharper logits than the default init, so argmax ties never happen
        for p in pair.target.lm_head.parameters():
            p.mul_(20)
    stats = ActionStats([-1.0, -2.0, 0.0][:dims], [1.0, 2.0, 1.0][:dims], [True, True, not binary_dims][:dims])
    save(pair, cfg, stats, model_dir, {"note": "random init, for tests"})
    random_draft_head(cfg.prefix_len, cfg.hidden, cfg.n_bins, cfg.horizon, dims, seed=seed).save(
        model_dir / "draft_head.npz")
    meta = json.loads((model_dir / "policy.json").read_text())
    meta["binary_dims"] = list(binary_dims)
    if dims != 2:  # save() declares the reacher's two fingertip actions: name D joint targets instead
        meta.update(action_kind="joint_position", action_names=[f"joint{j}.position" for j in range(dims)],
                    action_units=["rad"] * dims)
    (model_dir / "policy.json").write_text(json.dumps(meta))
    return cfg


def make_f16_policy(root):
    """An exported tiny random policy whose decoder weights are exactly float16 values (as the bundled
    reacher's), so its target and draft folders carry native weights: -> the policy folder."""
    from safetensors.numpy import load_file, save_file

    from edgespec.export.vla import export_policy
    make_tiny_policy(root / "model", seed=5)
    for part in ("target", "draft"):
        f = root / "model" / part / "model.safetensors"
        save_file({k: v.astype(np.float16).astype(v.dtype) for k, v in load_file(str(f)).items()}, str(f))
    export_policy(root / "model", root / "engine", progress=False)
    return root / "engine"


@pytest.fixture(scope="session")
def tiny_policies(tmp_path_factory):
    """Exported policy folders: 'plain' (random target + random draft) and 'self' (the target as its own
    draft, so every greedy draft is accepted)."""
    import shutil

    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("policies")
    make_tiny_policy(root / "model")
    export_policy(root / "model", root / "plain", progress=False)
    shutil.rmtree(root / "model" / "draft")
    shutil.copytree(root / "model" / "target", root / "model" / "draft")
    export_policy(root / "model", root / "self", progress=False)
    return {"plain": root / "plain", "self": root / "self", "model": root / "model"}


@pytest.fixture(scope="session")
def tiny_reacher_policy(tmp_path_factory):
    """An exported random-init policy with the reacher's action shape (D = 2 joint targets)."""
    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("reacher_policy")
    make_tiny_policy(root / "model", seed=3, dims=2)
    export_policy(root / "model", root / "engine", progress=False)
    return root / "engine"


@pytest.fixture(scope="session")
def bundled_policy_dir():
    """engines/vla-reacher, exported from models/vla-reacher if it is missing or stale (about a minute)."""
    from pathlib import Path

    from edgespec.export.bundled import ensure_policy_engines
    root = Path(__file__).resolve().parents[1]
    return ensure_policy_engines(root / "models", root / "engines")


def assert_a_failed_call_is_scrubbed(engine_dir, rows: int | None = None, nan_logits: bool = False):
    """On an inputs_embeds engine: commit [1, 2, 3], then a call whose second embedding is NaN. It must report
    NONFINITE_ID there (and NaN logits there, with nan_logits), leave the cache finite (its first `rows`
    rows; None: all of it) and the next call equal to a decoder that never saw the NaN.
    -> (that decoder, the clean one)."""
    from pathlib import Path

    import numpy as np

    from edgespec import contract as C
    from edgespec.backends.ort import OrtDecoder
    from edgespec.backends.ort import OrtEngine
    eng = OrtEngine(engine_dir)
    emb = np.load(Path(engine_dir) / eng.manifest.embedding_file)
    d, clean = OrtDecoder(eng, 1, emb), OrtDecoder(eng, 1, emb)
    for dec in (d, clean):
        dec.run(np.array([[1, 2, 3]]))
        dec.cache.commit(3)
    bad = emb[np.array([[4, 5]])].copy()
    bad[0, 1] = np.nan
    d.run(None, embeds=bad)
    assert d.last_ids()[0, 1] == C.NONFINITE_ID
    assert not nan_logits or np.isnan(d.last_logits()[0, 1]).all()
    # (row 0 may be NaN too: its query weighs row 1's NaN value by exactly 0, and 0 x NaN is NaN; the
    # whole call has failed, and all the rows it wrote are zeroed)
    for j in range(len(d.cache.buffers)):
        assert np.isfinite(d.cache.host(j)[:, :, :rows]).all()
    np.testing.assert_allclose(d(np.array([[7, 8]])), clean(np.array([[7, 8]])), atol=1e-5)
    return d, clean


def vllm_server(tmp_path_factory, model, **kw):
    """A real vLLM server for `model` on a free 127.0.0.1 port (edgespec serve-target's flags), as a fixture's
    generator: yields (url, process) and kills it after. Skips where no vLLM environment with the edgespec
    plugin exists (`edgespec serve-target --setup` makes one; the README's test command runs it)."""
    import socket

    from edgespec import serve
    try:
        serve.check_env(serve.find_python())
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"no vLLM environment with the edgespec plugin ({e}); make one with "
                    f"`edgespec serve-target --setup`")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    proc = serve.start(model, port, log=log, **kw)
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready(url, proc, timeout_s=600)
    except Exception:
        serve.stop(proc)
        raise RuntimeError(f"the vLLM server did not start; its log:\n{log.read_text()[-3000:]}")
    yield url, proc
    serve.stop(proc)


def make_f16_model(cfg, path, seed):
    """A random-init model of transformers config `cfg` whose weights are exactly float16 values (so the export
    writes native.npz), wide enough (std 0.2) that differences show; saved to `path` with a char tokenizer."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[cfg.model_type])(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.normal_(0, 0.2).half().float())
        if getattr(cfg, "tie_word_embeddings", False):
            model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    char_tokenizer_json(path / "tokenizer.json")
    return model


def random_text_head(e: int, v: int, seed: int = 0):
    """TextHeadWeights of random values for hidden size e and vocabulary v (every second id draftable)."""
    from edgespec.text_head import TextHeadWeights
    rng = np.random.default_rng(seed)
    r = lambda *shape: (rng.normal(0, 0.3, shape)).astype(np.float32)  # noqa: E731
    embed = r(v, e)
    vocab = np.arange(0, v, 2)
    return TextHeadWeights(r(e, 32), r(e, 32), r(32), r(32, e), r(e), embed, embed[vocab], vocab)


def plain_steps_like_reference(a, b, first: int, same_cache) -> None:
    """Decoder a's greedy_steps against decoder b's greedy_steps_reference (both prefilled alike, next id
    `first`): runs of 5, 30 and 40 steps, the caller closing the 30-step run after 12 ids; after each run the
    same ids and same_cache(a, b) (it asserts)."""
    pending = [first, first]
    for n, take in ((5, 5), (30, 12), (40, 40)):  # take < n: the caller closes the generator early
        got = []
        for d, steps in ((a, a.greedy_steps), (b, b.greedy_steps_reference)):
            gen, ids = steps(pending[d is b], n), []
            for tok in gen:
                ids.append(tok)
                if len(ids) == take:
                    break
            gen.close()
            got.append(ids)
        assert got[0] == got[1] and len(got[0]) == take
        same_cache(a, b)
        pending = [got[0][-1], got[1][-1]]
    assert a.calls == b.calls

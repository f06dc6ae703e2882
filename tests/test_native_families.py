"""Provider cpu-native for every family (export/checkpoint.py's SUPPORTED_ARCHITECTURES) against the ONNX Runtime
engine of the same folder and against transformers' own generate().

The configs are tests/test_families.py's (head size 16, each family's options on: biases, q/k norms, windows on
some layers, several rotaries, partial rotary, layers without rotary), with every weight exactly a float16 so
that the export writes native.npz, and sizes on native_step.c's multiples of 16 (head_dim of 8).
"""
from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from conftest import make_f16_model

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("provider cpu-native compiles its step with a C compiler; none here (apt-get install gcc)",
                allow_module_level=True)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import edgespec  # noqa: E402
from edgespec.contract import Manifest  # noqa: E402
from edgespec.backends.ort import OrtEngine
from edgespec.backends import open_engine  # noqa: E402

H16 = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
CONFIGS = {  # tests/test_families.py's
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
    "phi3": lambda: transformers.Phi3Config(  # head size 32, 16 rotary dims
        **{**H16, "num_attention_heads": 2, "num_key_value_heads": 1}, original_max_position_embeddings=128,
        sliding_window=12, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5,
                                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                            "long_factor": [2.0] * 8}),
    "smollm3": lambda: transformers.SmolLM3Config(**H16, no_rope_layers=[1, 1, 0]),
}
FEATURES = {  # what each folder's extra.native.features must record
    "llama3": ["qkv_bias", "o_bias"],
    "mistral": ["windows"],
    "qwen2": ["qkv_bias", "windows"],
    "qwen3": ["qk_norm"],
    "gemma3": ["qk_norm", "sandwich_norm", "gelu_tanh", "embed_scale", "attn_scale", "several_rotaries", "windows"],
    "phi3": ["partial_rotary", "windows"],
    "smollm3": ["layers_without_rotary"],
}
PROMPTS = [[5, 17, 3, 60, 42, 9, 11], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], list(range(30, 52))]
NEW = 24


_make = make_f16_model  # test_native_quant.py imports it by this name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (transformers model, engine folder)."""
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("native-families")
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        model = _make(cfg(), root / "ck" / name, seed=60 + i)
        export_engine(root / "ck" / name, root / name, max_context=96, progress=False)
        out[name] = (model, root / name)
    return out


def _calls():
    """A prefill shorter than the windows, single steps across them (8 and 12), a verify-sized call, a longer
    chunk, then single steps again: 60 rows."""
    toks = np.random.default_rng(5).integers(0, 96, (1, 60))
    cuts = [0, 5] + list(range(6, 16)) + [20, 44] + list(range(45, 61))
    return [toks[:, a:b] for a, b in zip(cuts, cuts[1:])]


def _against_ort(folder, march=None, monkeypatch=None):
    if march:
        monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", march)
    ref, nat = OrtEngine(folder).decoder(), open_engine(folder, "cpu-native").decoder()
    for chunk in _calls():
        a, b = np.array(ref(chunk)), np.array(nat(chunk))
        ref.cache.commit(chunk.shape[1])
        nat.cache.commit(chunk.shape[1])
        tol = 1e-3 * max(1.0, float(np.abs(a).max()))
        assert np.abs(b - a).max() <= tol, (folder.name, chunk.shape, float(np.abs(b - a).max()))
        assert (nat.last_ids() == ref.last_ids()).all(), (folder.name, chunk.shape)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_writes_native_weights_that_pass_their_gate(folders, name):
    m = Manifest.read(folders[name][1])
    info = m.extra["native"]
    assert info.get("file") == "native.npz", info
    assert info["gate"]["passed"] and info["gate"]["ids_agree"] == info["gate"]["ids"]
    assert info["features"] == FEATURES[name] and info["format"] == 3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_calls_match_onnx_runtime(folders, name):
    _against_ort(folders[name][1])


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2 without AVX-512; portable C
def test_native_calls_match_onnx_runtime_on_other_builds(folders, name, march, monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={march} is an x86 target; this machine is {platform.machine()}")
    _against_ort(folders[name][1], march, monkeypatch)


def _hf_greedy(model, prompt, n=NEW):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_equal_transformers_generate_and_speculative_equals_plain(folders, name):
    model, folder = folders[name]
    plain = edgespec.load(folder, provider="cpu-native")
    spec = edgespec.load(folder, draft="ngram", gamma=3, provider="cpu-native")
    for prompt in PROMPTS:
        want = _hf_greedy(model, prompt)
        assert plain.generate(prompt, max_new_tokens=NEW).token_ids == want, (name, prompt)
        assert spec.generate(prompt, max_new_tokens=NEW).token_ids == want, (name, prompt)


def test_a_windowed_row_does_not_depend_on_the_calls_s(folders):
    """Gemma 3 (windows, q/k norms, sandwich norms): a verify-sized call and single steps give the same bits."""
    d = open_engine(folders["gemma3"][1], "cpu-native").decoder()
    toks = np.random.default_rng(1).integers(0, 96, (1, 40))
    d(toks[:, :23])
    d.cache.commit(23)
    together = np.array(d(toks[:, 23:40]))[0]
    d.cache.rewind_to(23)
    one = []
    for i in range(23, 40):
        one.append(np.array(d(toks[:, i:i + 1]))[0, 0])
        d.cache.commit(1)
    assert np.array_equal(together, np.stack(one))


def test_rows_outside_the_window_are_never_read(folders):
    """Mistral (a window of 8 on every layer): rows older than the window, gone bad, change nothing."""
    d = open_engine(folders["mistral"][1], "cpu-native").decoder()
    toks = np.random.default_rng(2).integers(0, 96, (1, 30))
    d(toks[:, :20])
    d.cache.commit(20)
    clean = np.array(d(toks[:, 20:30]))
    d.cache.rewind_to(20)
    for j in range(len(d.cache.buffers)):
        d.cache.host(j)[0, :, :12] = np.nan  # rows 0..11: outside every window of rows 20..29
        d.cache.host(j)[0, :, 20:] = np.nan  # rejected drafts' rows
    np.testing.assert_array_equal(np.array(d(toks[:, 20:30])), clean)


def test_the_loader_checks_the_npz_against_engine_json(folders, tmp_path):
    from edgespec.contract import EngineError
    bad = tmp_path / "bad"
    shutil.copytree(folders["gemma3"][1], bad)
    m = Manifest.read(bad)
    m.extra["native"]["sha256"] = None
    m.extra["native"]["features"] = [f for f in m.extra["native"]["features"] if f != "sandwich_norm"]
    m.write(bad)
    with pytest.raises(EngineError, match=r"layers.0.post_attn: not expected"):
        open_engine(bad, "cpu-native")
    m.extra["native"]["features"] = FEATURES["gemma3"]
    m.layer_windows = [None, None, 8]
    m.write(bad)
    with pytest.raises(EngineError, match=r"layer_window \[8, 0, 8\] differs from engine.json's windows \[0, 0, 8\]"):
        open_engine(bad, "cpu-native", check_hashes=False)


ODD_VOCAB = 101  # a fine-tune's added tokens: not a multiple of native_step.c's panels of 16


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """-> (transformers model, engine folder): a Qwen2 (tied embeddings, biases) with 101 ids."""
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("odd-vocab")
    cfg = transformers.Qwen2Config(**{**H16, "vocab_size": ODD_VOCAB}, tie_word_embeddings=True)
    model = _make(cfg, root / "ck", seed=71)
    export_engine(root / "ck", root / "engine", max_context=96, progress=False)
    return model, root / "engine"


def test_a_vocabulary_off_the_panels_pads_the_lm_head_and_hands_out_its_own_columns(odd_vocab):
    model, folder = odd_vocab
    info = Manifest.read(folder).extra["native"]
    assert info["head_rows"] == 112 and info["gate"]["passed"], info
    _against_ort(folder)  # logits (1, S, 101) within the tolerance, ids equal
    nat = open_engine(folder, "cpu-native").decoder()
    logits = np.array(nat(np.array([[5, 17, 3]])))
    assert logits.shape == (1, 3, ODD_VOCAB)
    plain = edgespec.load(folder, provider="cpu-native")
    spec = edgespec.load(folder, draft="ngram", gamma=3, provider="cpu-native")
    for prompt in PROMPTS:
        want = _hf_greedy(model, prompt)
        assert plain.generate(prompt, max_new_tokens=NEW).token_ids == want, prompt
        assert spec.generate(prompt, max_new_tokens=NEW).token_ids == want, prompt


@pytest.fixture(scope="module")
def odd_vocab_twin(odd_vocab, tmp_path_factory):
    """The odd-vocabulary model with its table padded to 112 ids by zero rows, exported: its logits' first 101
    columns are the odd model's function, with no padding done by the exporter."""
    from edgespec.export.onnx_export import export_engine
    model, _ = odd_vocab
    root = tmp_path_factory.mktemp("odd-vocab-twin")
    twin = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**H16, "vocab_size": 112},
                                                                  tie_word_embeddings=True)).eval()
    state = model.state_dict()
    with torch.no_grad():
        for k, v in twin.state_dict().items():
            v.copy_(state[k] if state[k].shape == v.shape else
                    torch.cat([state[k], torch.zeros(v.shape[0] - state[k].shape[0], *v.shape[1:])]))
        twin.tie_weights()
    twin.save_pretrained(root / "ck", safe_serialization=True)
    shutil.copy(odd_vocab[1].parent / "ck" / "tokenizer.json", root / "ck" / "tokenizer.json")
    export_engine(root / "ck", root / "engine", max_context=96, progress=False)
    return root / "engine"


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
def test_every_weight_kind_pads_the_head_as_zero_rows(odd_vocab, odd_vocab_twin, tmp_path, kind):
    """The padded folder's logits equal, bit for bit, the first 101 columns of a model whose own table has the
    zero rows (quantization is per row, so the padding rows change no other row's blocks)."""
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import add_native
    logits = {}
    for name, src in (("odd", odd_vocab[1]), ("twin", odd_vocab_twin)):
        folder = tmp_path / name
        shutil.copytree(src, folder)
        if kind != "float16":
            spec, weights = load_checkpoint(src.parent / "ck")
            v = spec.vocab_size
            rows = [np.random.default_rng(3).integers(0, v, 40)]
            info = add_native(folder, spec, weights, None, kind, base=(rows, [np.zeros((40, v), np.float32)]),
                              role="draft")  # a draft's gate records, never refuses: the comparison is below
            assert info["weights"] == kind, info
        logits[name] = np.array(open_engine(folder, "cpu-native").decoder()(np.array([PROMPTS[2]])))
    assert Manifest.read(tmp_path / "odd").extra["native"]["head_rows"] == 112
    assert logits["odd"].shape == (1, len(PROMPTS[2]), ODD_VOCAB)
    assert np.array_equal(logits["odd"], logits["twin"][..., :ODD_VOCAB])
    assert not logits["twin"][..., ODD_VOCAB:].any()  # the zero rows' logits


def test_the_loader_checks_the_padded_head(odd_vocab, tmp_path):
    from edgespec.contract import EngineError
    bad = tmp_path / "bad"
    shutil.copytree(odd_vocab[1], bad)
    m = Manifest.read(bad)
    m.extra["native"]["sha256"] = None
    m.extra["native"]["head_rows"] = 128
    m.write(bad)
    with pytest.raises(EngineError, match=r"head_rows .* must be vocab_size 101 rounded up to a multiple of 16, "
                                          r"112; got 128"):
        open_engine(bad, "cpu-native", check_hashes=False)
    del m.extra["native"]["head_rows"]
    m.write(bad)
    with pytest.raises(EngineError, match=r"lm_head: expected \(6, 64, 16\), got \(7, 64, 16\)"):
        open_engine(bad, "cpu-native", check_hashes=False)


class _ReadLog(dict):
    """A weights dict that logs, at each read, which layers still have tensors in it."""

    def __init__(self, *a):
        super().__init__(*a)
        self.log = []

    def __getitem__(self, k):
        self.log.append((k, {int(n.split(".")[2]) for n in self if n.startswith("model.layers.")}))
        return super().__getitem__(k)


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_consuming_the_weights_builds_the_same_arrays_and_frees_each_layer_as_it_goes(folders, name, tmp_path):
    """native_arrays(consume=True): the same arrays as without, and a layer's tensors leave the dict once its
    arrays are built, so a float32 checkpoint and its packed copy are never both whole (an export's peak)."""
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import native_arrays
    spec, weights = load_checkpoint(folders[name][1].parent / "ck" / name)
    want = native_arrays(spec, dict(weights), "int8", exact=False)
    kept = dict(weights)
    native_arrays(spec, kept, "int8", exact=False)
    assert kept.keys() == weights.keys()  # without consume nothing is taken
    log = _ReadLog(weights)
    got = native_arrays(spec, log, "int8", exact=False, consume=True)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert not log  # every tensor the step reads was taken
    last = spec.num_layers - 1
    assert all(0 not in layers for k, layers in log.log if k.startswith(f"model.layers.{last}."))


def test_an_export_hands_its_loaded_weights_over_to_be_consumed(monkeypatch, tmp_path):
    """export_engine loads the checkpoint for native.npz and passes it with consume=True: the weights dict is
    empty once the arrays are built (the 3B policy export's peak was this dict beside the packed copy)."""
    from edgespec.export import native
    from edgespec.export.onnx_export import export_engine
    seen, real = [], native.native_arrays

    def spy(spec, weights, kind="float16", exact=True, consume=False):
        out = real(spec, weights, kind, exact, consume)
        seen.append((consume, len(weights)))
        return out
    monkeypatch.setattr(native, "native_arrays", spy)
    _make(CONFIGS["llama3"](), tmp_path / "ck", seed=5)
    export_engine(tmp_path / "ck", tmp_path / "engine", max_context=64, progress=False)
    assert seen == [(True, 0)]

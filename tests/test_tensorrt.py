"""TensorRT profiles and ORT TensorRT-EP options (pure Python, always run); the ORT TensorRT EP's parity
needs an NVIDIA GPU and skips elsewhere with the reason (the native plan's: tests/test_trt_runtime.py)."""
import numpy as np
import pytest

from edgespec import contract as C
from edgespec.export.tensorrt import ProfileSpec, default_profiles, ort_trt_options, profile_shapes


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tmp_path_factory):
    from edgespec.export.onnx_export import export_engine
    out = tmp_path_factory.mktemp("trt") / "e"
    export_engine(tiny_checkpoints["qwen2"][0], out, dtype="fp16", progress=False)
    return out


def test_the_verify_profile_covers_the_longest_round_a_speculation_config_makes():
    """A lookup round may verify lookup_gamma + 1 tokens, past gamma_max + 1: the plan built from the config
    must take it (a call outside every profile fails on the device, mid-decode)."""
    from edgespec.speculation import SpeculationConfig

    def verify_max(**kw):
        return next(p for p in default_profiles(2048, **kw) if p.name == "verify").seq[2]
    assert verify_max() == 9  # the default config: γ max 8
    assert verify_max(spec=SpeculationConfig(gamma_max=4)) == 5
    assert verify_max(spec=SpeculationConfig(gamma_max=4, lookup=2, lookup_gamma=12)) == 13
    assert verify_max(gamma_max=6) == 7  # an explicit γ max wins


def test_profiles_cover_decode_verify_prefill(engine):
    m = C.Manifest.read(engine)
    profs = default_profiles(m.max_context, gamma_max=8, prefill_max=64, batch=2)
    assert [p.name for p in profs] == ["decode", "verify", "prefill"]
    shapes = {p.name: profile_shapes(m, p) for p in profs}
    assert shapes["decode"][C.INPUT_IDS] == ((1, 1), (1, 1), (2, 1))
    assert shapes["verify"][C.INPUT_IDS][2] == (2, 9)  # S = γmax + 1
    assert shapes["verify"][C.ATTENTION_BIAS][2] == (2, 1, 9, m.max_context)  # over the bound cache rows
    assert shapes["verify"][C.past_key(0)][0] == (1, m.num_kv_heads, 2, m.head_dim)  # rows hold the new tokens
    for name in ("decode", "verify", "prefill"):  # at min and opt the bound rows hold the new tokens
        for k in (0, 1):
            assert shapes[name][C.past_key(0)][k][2] >= shapes[name][C.INPUT_IDS][k][1]
    assert set(shapes["decode"]) == {t.name for t in m.inputs}  # every dynamic input is given


def test_ort_options_repeat_each_input_once_per_profile(engine):
    m = C.Manifest.read(engine)
    opts = ort_trt_options(m, engine, default_profiles(m.max_context))
    mins = opts["trt_profile_min_shapes"].split(",")
    assert len(mins) == 3 * len(m.inputs)
    assert f"{C.INPUT_IDS}:1x1" in mins and opts["trt_engine_cache_enable"] and opts["trt_fp16_enable"]
    assert opts["trt_engine_cache_path"].endswith("trt_cache")


@pytest.mark.parametrize("max_context", [16, 64, 300])
def test_profiles_fit_a_short_context(max_context):
    for p in default_profiles(max_context):  # would raise on a max below its opt
        assert p.past[2] == max_context and p.seq[2] <= max_context


def test_bad_profile_is_refused():
    with pytest.raises(ValueError, match="seq needs 0 <= min <= opt <= max"):
        ProfileSpec("x", (4, 2, 8), (0, 0, 16))


@pytest.mark.gpu
def test_ort_tensorrt_provider_matches_cpu(engine):
    import onnxruntime as ort
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu with the TensorRT execution provider and an NVIDIA GPU")
    from edgespec.backends.ort import OrtDecoder
    from edgespec.backends.ort import OrtEngine
    m = C.Manifest.read(engine)
    trt_eng = OrtEngine(engine, provider="tensorrt",
                        provider_options=ort_trt_options(m, engine, default_profiles(m.max_context)))
    cpu_eng = OrtEngine(engine)
    ids = np.arange(20)[None] % m.vocab_size
    a, b = OrtDecoder(trt_eng)(ids), OrtDecoder(cpu_eng)(ids)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.99


@pytest.mark.filterwarnings("ignore:Specified provider 'TensorrtExecutionProvider' is not in available")
def test_load_with_tensorrt_starts_the_ep_with_profiles_and_an_engine_cache(engine, monkeypatch):
    """No plan in the folder: ONNX Runtime's TensorRT EP, started with ort_trt_options (faked provider list;
    this CPU build then runs the session on its CPU fallback)."""
    import onnxruntime as ort

    import edgespec
    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["TensorrtExecutionProvider"] + real)
    gen = edgespec.load(engine, provider="tensorrt")
    m = C.Manifest.read(engine)
    want = ort_trt_options(m, engine, default_profiles(m.max_context), fp16=True)
    assert gen.target.provider == "tensorrt" and gen.target.provider_options == want
    assert f"{C.past_key(0)}:1x{m.num_kv_heads}x1x{m.head_dim}" in want["trt_profile_min_shapes"]
    assert want["trt_engine_cache_enable"] and want["trt_engine_cache_path"] == str(engine / "trt_cache")


def test_tensorrt_without_the_runtime_says_what_to_install(engine):
    import onnxruntime as ort

    import edgespec
    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has the TensorRT EP")
    with pytest.raises(C.EngineError, match="provider 'tensorrt' is not available.*install onnxruntime-gpu"):
        edgespec.load(engine, provider="tensorrt")


def test_unknown_provider_is_refused(engine):
    import edgespec
    with pytest.raises(C.EngineError, match="provider must be one of"):
        edgespec.load(engine, provider="rocm")


def test_export_with_tensorrt_says_what_to_install(tiny_checkpoints, tmp_path, capsys):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    from edgespec.cli import main
    rc = main(["export", str(tiny_checkpoints["llama"][0]), "--out", str(tmp_path / "e"), "--tensorrt", "--quiet"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "error:" in err and "trt` extra" in err and "python3-libnvinfer" in err
    assert (tmp_path / "e" / "engine.json").is_file()  # the ONNX engine was still written

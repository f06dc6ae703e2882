"""Native TensorRT runtime (edgespec.cuda, edgespec.backends.trt).

Always run (CPU): profile selection, the clear errors (no tensorrt, no plan, a plan from another TensorRT /
GPU, a plan whose I/O differs from engine.json), gpu_available() without a GPU, CudaMemory's byte
arithmetic, and TrtDecoder end to end over CPU stand-ins for cuda-python and TensorRT (tests/trt_fakes.py):
ids equal to the ONNX Runtime decoder's through prefill / verify / decode / rollback, CUDA-graph capture
and replay per (S, parity), the capture-failure fallback, and greedy speculative == plain.
GPU (marked gpu, skip with the reason elsewhere): the same on a real plan built on this machine.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edgespec.cuda as ecuda
from edgespec import contract as C
from edgespec.contract import EngineError
from edgespec.export.tensorrt import default_profiles, profile_shapes
from edgespec.memory import HostMemory
from edgespec.backends.trt import PlanProfile, check_plan_io, select_profile, trt_dtype_name
from trt_fakes import FakeCudart, make_fake_tensorrt, write_fake_plan

ROOT = Path(__file__).resolve().parents[1]


def manifest(max_context=2048, dtype="float16") -> C.Manifest:
    ins, outs = C.decoder_io(2, 2, 16, 96, 32, cache_dtype=dtype)
    return C.Manifest("model.onnx", "llama", 2, 4, 2, 16, 32, 96, max_context, precision="fp16",
                      inputs=ins, outputs=outs)


def plan_profiles(m, specs, named=True) -> list[PlanProfile]:
    return [PlanProfile(k, p.name if named else f"profile{k}", profile_shapes(m, p)) for k, p in enumerate(specs)]


# -- profile selection --------------------------------------------------------------------------------------

@pytest.mark.parametrize("named", [True, False])
def test_profile_selection(named):
    m = manifest()
    profs = plan_profiles(m, default_profiles(2048, gamma_max=8, prefill_max=512), named)
    assert select_profile(profs, 1, 2048) == 0  # decode
    for s in range(2, 10):
        assert select_profile(profs, s, 2048) == 1  # verify: S = 2 .. γmax+1
    assert select_profile(profs, 10, 2048) == 2 and select_profile(profs, 512, 16) == 2  # prefill
    assert profs[1].seq == (2, 9) and profs[0].rows == (1, 2048) and profs[2].batch == (1, 1)


def test_profile_selection_errors_say_what_to_rebuild():
    profs = plan_profiles(manifest(), default_profiles(2048, prefill_max=512))
    with pytest.raises(EngineError, match=r"context of 4096 rows is longer than the plan's profile \(max 2048\); "
                                          r"rebuild with a larger --max-context / profile"):
        select_profile(profs, 1, 4096)
    with pytest.raises(EngineError, match=r"513 new tokens .* \(max 512\); feed the prompt in chunks"):
        select_profile(profs, 513, 2048)
    with pytest.raises(EngineError, match="batch 2 .* rebuild with --batch 2"):
        select_profile(profs, 1, 2048, batch=2)


# -- I/O checks and dtype names -----------------------------------------------------------------------------

def _io(m, dtype_of=lambda t: t.dtype):
    dyn = lambda shape: [d if isinstance(d, int) else "dynamic" for d in shape]  # noqa: E731
    return ([(t.name, dtype_of(t), dyn(t.shape)) for t in m.inputs],
            [(t.name, dtype_of(t), dyn(t.shape)) for t in m.outputs])


def test_plan_io_check_accepts_reordered_io_and_reports_differences():
    m = manifest()
    ins, outs = _io(m)
    assert check_plan_io(m, ins[::-1], outs[::-1]) == []  # TensorRT's order need not be the graph's
    ins32, _ = _io(m, lambda t: "float32" if t.name.startswith("past") else t.dtype)
    probs = check_plan_io(m, ins32, outs)
    assert probs and "past.0.key: dtype float32 != manifest float16" in probs[0]
    probs = check_plan_io(m, [i for i in ins if i[0] != C.POSITION_IDS], outs)
    assert probs == ["input names differ: missing ['position_ids'], unexpected []"]
    bad_v = [(n, d, s[:2] + [97]) if n == C.LOGITS else (n, d, s) for n, d, s in outs]
    assert any("logits: shape" in p for p in check_plan_io(m, ins, bad_v))


def test_trt_dtype_names():
    class DT:
        def __init__(self, name):
            self.name = name
    assert [trt_dtype_name(DT(n)) for n in ("FLOAT", "HALF", "INT64", "BF16")] == \
        ["float32", "float16", "int64", "bfloat16"]
    assert trt_dtype_name("DataType.INT32") == "int32"


# -- errors before any GPU work -----------------------------------------------------------------------------

@pytest.fixture()
def fake_folder(tmp_path):
    """An engine folder with a manifest, a placeholder model file and a placeholder plan (no hashes)."""
    m = manifest()
    m.tokenizer_file = None
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "model.plan").write_bytes(b"plan")
    m.write(tmp_path)
    return tmp_path


def test_missing_tensorrt_says_how_to_install(fake_folder, monkeypatch):
    from edgespec.backends.trt import TrtEngine
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(EngineError) as e:
        TrtEngine(fake_folder)
    msg = str(e.value)
    assert "`tensorrt` Python package" in msg and "`trt` extra" in msg and "python3-libnvinfer" in msg


def test_missing_plan_says_how_to_build(fake_folder):
    from edgespec.backends.trt import TrtEngine
    (fake_folder / "model.plan").unlink()
    with pytest.raises(EngineError, match=r"model.plan: no TensorRT plan .*`python -m edgespec.export.tensorrt "):
        TrtEngine(fake_folder)


def test_gpu_available_never_raises_without_a_gpu(monkeypatch):
    monkeypatch.setattr(ecuda, "_CUDART", None)
    ok, why = ecuda.gpu_available()  # this machine: no cuda-python or no driver
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if shutil.which("nvidia-smi") is None:
        assert ok is False
    monkeypatch.setattr(ecuda, "_CUDART", FakeCudart(no_driver=True))  # cuda-python >= 12.9: an error code
    assert ecuda.gpu_available() == (False, "no usable CUDA device: cudaErrorInsufficientDriver: CUDA driver "
                                            "version is insufficient for CUDA runtime version")

    class Dlopen(FakeCudart):  # cuda-python 12.6.0 without a driver raises
        def cudaGetDeviceCount(self):
            raise RuntimeError("Failed to dlopen libcuda.so.1")
    monkeypatch.setattr(ecuda, "_CUDART", Dlopen())
    ok, why = ecuda.gpu_available()
    assert not ok and "Failed to dlopen libcuda.so.1" in why
    monkeypatch.setattr(ecuda, "_CUDART", FakeCudart(devices=0))
    assert ecuda.gpu_available()[0] is False
    monkeypatch.setattr(ecuda, "_CUDART", FakeCudart())
    assert ecuda.gpu_available() == (True, "1 CUDA device(s); device 0: Fake GPU (compute 8.7)")


def test_check_raises_with_the_error_name(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(ecuda, "_CUDART", fake)
    assert ecuda.check(fake.cudaMalloc(8)) > 0 and ecuda.check(fake.cudaSetDevice(0)) is None
    with pytest.raises(RuntimeError, match="cudaErrorInsufficientDriver: CUDA driver version is insufficient"):
        ecuda.check((fake.cudaError_t.cudaErrorInsufficientDriver, None))


def test_device_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "device" / "device_check.sh")], check=True)
    subprocess.run([sys.executable, "-m", "py_compile", str(ROOT / "tools" / "device" / "device_check.py")], check=True)


# -- CudaMemory over the fake runtime -----------------------------------------------------------------------

def _memory_matches_host(mem) -> None:
    """A CudaMemory's zeros / write / to_host / grow / copy_from_host_async agree with HostMemory's."""
    host = HostMemory()
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 3, 5, 4)).astype(np.float16)  # (B, Hkv, T, D)
    buf = mem.zeros(a.shape, a.dtype)
    assert buf.ptr % 256 == 0 and not mem.to_host(buf).any()
    mem.write(buf, a)
    assert np.array_equal(mem.to_host(buf), a)
    hb = host.zeros(a.shape, a.dtype)
    host.write(hb, a)
    for rows in (8, 3):
        got = mem.to_host(mem.grow(buf, rows))
        assert got.shape == (2, 3, rows, 4) and np.array_equal(got, host.grow(hb, rows).handle)
    small = mem.zeros((1, 3), np.int64)
    mem.copy_from_host_async(small, np.array([[1, 2, 3]]))
    assert mem.to_host(small).tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"host array \(1, 2\) does not match the device buffer \(1, 3\)"):
        mem.copy_from_host_async(small, np.zeros((1, 2)))


def test_cuda_memory_roundtrip_and_grow_match_host_memory(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(ecuda, "_CUDART", fake)
    _memory_matches_host(ecuda.CudaMemory())
    isz = 2
    assert fake.copies_2d[0] == (8 * 4 * isz, 5 * 4 * isz, 5 * 4 * isz, 6)  # dpitch, spitch, width, B*Hkv


@pytest.mark.gpu
def test_cuda_memory_on_a_real_gpu_matches_host_memory(monkeypatch):
    """The same on the real CUDA runtime: needs cuda-python and a GPU, not TensorRT."""
    monkeypatch.setattr(ecuda, "_CUDART", None)
    try:
        ecuda.cudart()
    except ImportError as e:
        pytest.skip(f"needs cuda-python (the `trt` extra) and an NVIDIA GPU: {e}")
    ok, why = ecuda.gpu_available()
    if not ok:
        pytest.skip(f"needs an NVIDIA GPU: {why}")
    _memory_matches_host(ecuda.CudaMemory())


# -- TrtDecoder over the fakes (CPU) ------------------------------------------------------------------------

@pytest.fixture()
def fakes(monkeypatch):
    """(FakeCudart, fake tensorrt) installed where edgespec.cuda / edgespec.backends.trt import them."""
    cud = FakeCudart()
    monkeypatch.setattr(ecuda, "_CUDART", cud)
    trt = make_fake_tensorrt(cud)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return cud, trt


@pytest.fixture(scope="module")
def planned(tiny_engines, tmp_path_factory):
    """Copies of the tiny target / noisy draft engines with fake plans (profiles as build_engine makes)."""
    return _with_plans(tiny_engines, tmp_path_factory.mktemp("planned"), write_fake_plan)


def _with_plans(tiny_engines, root, build) -> dict:
    """Copies of the tiny target and noisy draft engines, each given a plan by build(folder, profiles)."""
    out = {}
    for name in ("target", "noisy"):
        out[name] = root / name
        shutil.copytree(tiny_engines[name], out[name])
        m = C.Manifest.read(out[name])
        build(out[name], default_profiles(m.max_context, gamma_max=8, prefill_max=64, opt_rows=m.max_context))
    return out


def _trt_engine(path):
    from edgespec.backends.trt import TrtEngine
    return TrtEngine(path)


def test_fake_plan_loads_and_reports_profiles(fakes, planned):
    eng = _trt_engine(planned["target"])
    assert eng.provider == "tensorrt-native"
    assert [p.name for p in eng.profiles] == ["decode", "verify", "prefill"]
    assert eng.profile_for(1, 128) == 0 and eng.profile_for(5, 128) == 1 and eng.profile_for(30, 128) == 2


def test_unloadable_plan_names_versions_and_gpu(fakes, planned, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(planned["target"], d)
    (d / "model.plan").write_bytes(b"\x00not a plan")
    with pytest.raises(EngineError) as e:
        _trt_engine(d)
    msg = str(e.value)
    for part in ("TensorRT 10.3.0 on Fake GPU (compute 8.7)", "built with TensorRT 10.3.0", "rebuild it on this device",
                 "python -m edgespec.export.tensorrt", "Version tag does not match"):
        assert part in msg, (part, msg)


def test_plan_whose_io_differs_from_the_manifest_is_refused(fakes, planned, tmp_path):
    d = tmp_path / "e"
    shutil.copytree(planned["target"], d)
    m = C.Manifest.read(d)
    write_fake_plan(d, default_profiles(m.max_context), rename={C.NEXT_IDS: "argmax"})
    with pytest.raises(EngineError, match=r"(?s)inputs/outputs do not match .*engine.json.*missing \['next_ids'\]"):
        _trt_engine(d)


def _ort_decoder(path):
    from edgespec.backends.ort import OrtDecoder
    from edgespec.backends.ort import OrtEngine
    return OrtDecoder(OrtEngine(path))


def _same_calls(a, b, rng, vocab, steps=12):
    """Drive two decoders through one script (prefill, verify with partial accept, decode, rollback)."""
    prompt = rng.integers(0, vocab, (1, 17))
    assert np.array_equal(a.ids(prompt), b.ids(prompt))
    a.cache.commit(17)
    b.cache.commit(17)
    for step in range(steps):
        s = int(rng.choice([1, 1, 3, 5, 9]))
        toks = rng.integers(0, vocab, (1, s))
        ia, ib = a.ids(toks), b.ids(toks)
        assert np.array_equal(ia, ib), (step, s, ia, ib)
        keep = int(rng.integers(1, s + 1))
        a.cache.commit(keep)
        b.cache.commit(keep)
        if step == 6:  # roll back a few rows
            a.cache.rewind_to(a.cache.lengths - 3)
            b.cache.rewind_to(b.cache.lengths - 3)
    la, lb = a(rng.integers(0, vocab, (1, 2))), b(rng.integers(0, vocab, (1, 2)))
    assert la.shape == lb.shape


@pytest.mark.parametrize("graphs", [True, False])
def test_trt_decoder_matches_the_onnx_runtime_decoder(fakes, planned, graphs, monkeypatch):
    from edgespec.backends import trt as trt_mod
    from edgespec.backends.trt import TrtDecoder
    cud, trt = fakes
    monkeypatch.setattr(trt_mod, "MIN_ROWS", 16)  # the tiny engines hold 128 rows: let the cache double in the test
    dec = TrtDecoder(_trt_engine(planned["target"]), cuda_graphs=graphs)
    ref = _ort_decoder(planned["target"])
    assert dec.cache.capacity == 16 and not dec.cache.in_place
    rng = np.random.default_rng(1)
    seen = []  # (capacity, bound rows) of each call: a call binds the cache's capacity, at most twice its rows
    real = dec._bind

    def bind(ctx, io, s):
        seen.append((dec.cache.capacity, io.bias.shape[3], int(dec.cache.lengths.max()) + s))
        return real(ctx, io, s)
    dec._bind = bind
    _same_calls(dec, ref, rng, dec.vocab_size)
    assert {c for c, _, _ in seen} >= {32, 64}  # it doubled, and the calls after each doubling still match
    assert all(bias == cap and cap <= max(16, 2 * rows) for cap, bias, rows in seen), seen
    # logits too (the same call on both)
    toks = rng.integers(0, dec.vocab_size, (1, 3))
    np.testing.assert_allclose(dec(toks), ref(toks), atol=1e-4)
    assert dec.calls == ref.calls and dec.engine_s > 0
    if graphs:
        assert cud.launches > 0 and dec.graph_fallback_reason is None
        assert all(k[1] <= dec.graph_max for k in dec._graphs)
        assert {k[2] for k in dec._graphs} == {0, 1}  # one graph per parity
    else:
        assert cud.launches == 0 and not dec._graphs


def test_a_refused_optimization_profile_is_an_error_naming_it(monkeypatch, planned):
    """set_optimization_profile_async returns False when TensorRT did not switch profiles: the call must not run
    under another profile's shapes."""
    from edgespec.backends.trt import TrtDecoder
    from edgespec.contract import EngineError
    cud = FakeCudart()
    monkeypatch.setattr(ecuda, "_CUDART", cud)
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt(cud, refuse_profile=True))
    dec = TrtDecoder(_trt_engine(planned["target"]))
    with pytest.raises(EngineError, match=r"refused optimization profile \d+ \('\w+'\)"):
        dec.ids(np.array([[1, 2, 3]]))


def test_capture_failure_falls_back_and_says_why(monkeypatch, planned):
    from edgespec.backends.trt import TrtDecoder
    cud = FakeCudart()
    monkeypatch.setattr(ecuda, "_CUDART", cud)
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt(cud, fail_capture=True))
    dec = TrtDecoder(_trt_engine(planned["target"]))
    _same_calls(dec, _ort_decoder(planned["target"]), np.random.default_rng(2), dec.vocab_size, steps=6)
    assert cud.launches == 0 and "capture failed" in dec.graph_fallback_reason


def _native_generator(target, draft, gamma):
    """A Generator over TrtEngines: it asks each engine for `.decoder(batch, embedding)` (TrtDecoders)."""
    from edgespec.generate import Generator
    from edgespec.tokenizer import TextTokenizer
    tok = TextTokenizer.from_engine(target.dir, target.manifest)
    return Generator(target, "model" if draft is not None else None, draft, tok, gamma)


def _spec_equals_plain(target_dir, draft_dir, prompts):
    from edgespec.backends.trt import TrtEngine
    tgt, dft = TrtEngine(target_dir), TrtEngine(draft_dir)
    plain, spec = _native_generator(tgt, None, 0), _native_generator(tgt, dft, 4)
    drafted = 0
    for p in prompts * 2:  # the second pass reuses the engines' decoders (graphs already captured)
        a, b = plain.generate(p, max_new_tokens=24), spec.generate(p, max_new_tokens=24)
        assert a.token_ids == b.token_ids, p
        drafted += b.stats.drafted
    assert drafted > 0
    for gen in (plain, spec):  # the generators reuse their decoders, not one per generate call
        assert sum(len(v) for v in gen._free.values()) == (1 if gen is plain else 2)
    return tgt, dft


def test_load_with_provider_tensorrt_native(fakes, planned):
    import edgespec
    gen = edgespec.load(planned["target"], draft=planned["noisy"], provider="tensorrt-native", gamma=4)
    plain = edgespec.load(planned["target"], provider="tensorrt-native")
    p = [5, 17, 33, 2, 8]
    assert gen.generate(p, max_new_tokens=20).token_ids == plain.generate(p, max_new_tokens=20).token_ids


def test_greedy_speculative_equals_plain_on_the_native_path(fakes, planned):
    rng = np.random.default_rng(3)
    _spec_equals_plain(planned["target"], planned["noisy"],
                       [rng.integers(0, 95, int(rng.integers(2, 20))).tolist() for _ in range(6)])


# -- on a real GPU ------------------------------------------------------------------------------------------

def _real_gpu():
    try:
        import tensorrt  # noqa: F401
    except ImportError as e:
        pytest.skip(f"needs TensorRT (the `trt` extra) and an NVIDIA GPU: {e}")
    ok, why = ecuda.gpu_available()
    if not ok:
        pytest.skip(f"needs an NVIDIA GPU: {why}")


@pytest.fixture(scope="module")
def real_plans(tiny_engines, tmp_path_factory):
    _real_gpu()
    from edgespec.export.tensorrt import build_engine
    # fp32: runtime correctness here; fp16 quality is tools/device/device_check.py's
    return _with_plans(tiny_engines, tmp_path_factory.mktemp("plans"), lambda d, p: build_engine(d, p, fp16=False))


@pytest.mark.gpu
def test_native_plan_top1_agreement_with_cpu(real_plans):
    from edgespec.backends.trt import TrtDecoder
    ecuda._CUDART = None  # the real runtime (a fake may have been installed by monkeypatch and removed)
    dec, ref = TrtDecoder(_trt_engine(real_plans["target"])), _ort_decoder(real_plans["target"])
    rng = np.random.default_rng(0)
    seq = rng.integers(0, dec.vocab_size, (1, 100))
    want = ref.ids(seq)[0]  # CPU fp32, teacher-forced in one prefill
    got = list(dec.ids(seq[:, :20])[0])  # native: prefill 20, then one token at a time (decode graphs)
    dec.cache.commit(20)
    for t in range(20, 100):
        got.append(int(dec.ids(seq[:, t:t + 1])[0, 0]))
        dec.cache.commit(1)
    agree = float(np.mean(np.asarray(got) == want))
    assert agree >= 0.99, agree


@pytest.mark.gpu
def test_native_greedy_speculative_equals_plain(real_plans):
    ecuda._CUDART = None
    rng = np.random.default_rng(4)
    _spec_equals_plain(real_plans["target"], real_plans["noisy"],
                       [rng.integers(0, 95, int(rng.integers(2, 20))).tolist() for _ in range(6)])

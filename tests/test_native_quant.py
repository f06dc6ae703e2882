"""The native step's integer weights, batches and thread pool (edgespec/native_step.c, edgespec/backends/native.py).

- packing: quantize_blocks / pack_blocks / unpack_blocks / dequantize against each other and the rounding rule;
- kernels (es_matmul): every weight kind against numpy on the dequantized matrix, and bit for bit the same
  row whatever the call's row count, thread count, and build (AVX-512 here, AVX2, portable C);
- whole models: int8 / int4 native engines against the torch reference run on the dequantized weights (the
  slow obvious reference), greedy ids equal; speculative decoding equal to plain;
- a batch of sequences at different lengths equal, bit for bit, to each sequence alone;
- a helper thread that stalls inside its chunks (the -DES_TEST_STALL build) changes no bit: the caller
  computes the chunk itself and the late result is dropped;
- the export's native gate and the loader's checks.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil

import numpy as np
import pytest

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("provider cpu-native compiles its step with a C compiler; none here (apt-get install gcc)",
                allow_module_level=True)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import edgespec  # noqa: E402
from edgespec.contract import EngineError, Manifest  # noqa: E402
from edgespec.backends import open_engine  # noqa: E402
from edgespec.backends.native_format import (QB, WEIGHT_KINDS, dequantize, matmul_reference, pack,  # noqa: E402
                                              pack_blocks, quantize_activations, quantize_blocks, unpack_blocks)
from edgespec.backends.native_lib import library  # noqa: E402
from test_native_families import CONFIGS, _make  # noqa: E402

KINDS = ["float16", "int8", "int4"]
X86 = platform.machine() in ("x86_64", "AMD64")


def _packed(w: np.ndarray, kind: str) -> np.ndarray:
    return pack(w.astype(np.float16)) if kind == "float16" else pack_blocks(*quantize_blocks(w, kind), kind)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_blocks_round_trip_and_round_to_nearest(kind):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (48, 4 * QB)).astype(np.float32)
    w[5, QB:2 * QB] = 0  # an all-zero block: scale 0, values 0
    q, s = quantize_blocks(w, kind)
    q2, s2 = unpack_blocks(pack_blocks(q, s, kind), kind)
    assert np.array_equal(q, q2) and np.array_equal(s.view(np.uint16), s2.view(np.uint16))
    lo, hi = (-127, 127) if kind == "int8" else (-8, 7)
    assert q.min() >= lo and q.max() <= hi and s[5, 1] == 0 and not q[5, QB:2 * QB].any()
    deq = dequantize(pack_blocks(q, s, kind), kind)
    scale = np.repeat(s.astype(np.float32), QB, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(scale != 0, w / scale, 0)
    inside = levels <= hi + 0.5  # int4: the top level, +7, takes what lies past it (q4_0 has 8 below 0, 7 above)
    assert np.all((np.abs(deq - w) <= np.abs(scale) / 2 + 1e-6 * np.abs(w))[inside]), "not rounded to nearest"
    assert np.all(q[~inside] == hi)
    blocks = w.reshape(48, -1, QB)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(2)[..., None], 2)[..., 0]
    if kind == "int4":  # the value of largest magnitude is exactly -8 levels (llama.cpp's q4_0 rule)
        qb = q.reshape(48, -1, QB)
        assert np.all(np.take_along_axis(qb, np.abs(blocks).argmax(2)[..., None], 2)[..., 0][top != 0] == -8)
    else:
        assert np.all(np.abs(q.reshape(48, -1, QB)).max(2)[top != 0] == 127)


def _matmul(lib, kind, x, packed, k, n, threads):
    t = x.shape[0]
    y = np.zeros((t, n), np.float32)
    x = np.ascontiguousarray(x, np.float32)
    rc = lib.es_matmul(WEIGHT_KINDS[kind], x.ctypes.data, t, packed.ctypes.data, k, n, y.ctypes.data, threads)
    assert rc == 0
    return y


def _kernel_results(kind):
    """-> (y of one 30-row call, 1 thread; the same rows as 1-, 5- and 13-row calls, 2 threads; numpy's)"""
    rng = np.random.default_rng(1)
    # 37 panels: the 4-panel and 2-panel kernels' tails; large enough (over native_step.c's MIN_PARALLEL even
    # for one row) that the 2-thread calls run on the pool, in chunks of several kernel passes
    k, n = 20 * QB, 16 * 37
    w = rng.normal(0, 0.2, (n, k)).astype(np.float32)
    x = rng.normal(0, 1, (30, k)).astype(np.float32)
    packed = _packed(w, kind)
    lib = library()
    whole = _matmul(lib, kind, x, packed, k, n, 1)
    parts = np.concatenate([_matmul(lib, kind, x[a:b], packed, k, n, 2)
                            for a, b in ((0, 1), (1, 6), (6, 19), (19, 30))])
    return whole, parts, (x, packed)


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_numpy_and_a_row_never_depends_on_the_call(kind):
    whole, parts, (x, packed) = _kernel_results(kind)
    exact = matmul_reference(x, packed, kind)  # the same arithmetic, the slow way
    np.testing.assert_allclose(whole, exact, rtol=0, atol=1e-6 * np.abs(exact).max())
    assert np.array_equal(whole, parts), "a row's bits depend on the call's row count or threads"
    floats = x.astype(np.float64) @ dequantize(packed, kind).astype(np.float64).T  # no activation rounding
    err = np.abs(whole - floats).max() / np.abs(floats).max()
    assert err < (1e-6 if kind == "float16" else 2e-2), err  # int8 activations: within a few 1/127 steps
    if kind != "float16":
        assert err > 1e-5  # and the integer path does round them (the reference above is not the float one)


@pytest.mark.skipif(not X86, reason="-march=haswell / x86-64 are x86 targets")
@pytest.mark.parametrize("kind", KINDS)
def test_every_build_computes_the_same_bits(kind, monkeypatch):
    here = _kernel_results(kind)[0]
    for march in ("haswell", "x86-64"):  # AVX2 without AVX-512; portable C
        monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", march)
        other = _kernel_results(kind)
        assert np.array_equal(other[0], here), (march, float(np.abs(other[0] - here).max()))
        assert np.array_equal(other[1], here), march


@pytest.mark.parametrize("kind", KINDS)
def test_prefetching_changes_no_bit(kind, monkeypatch):
    """The kernels ask for weight lines ahead from es_set_prefetch_rows' row count up: the same bits either way,
    on every SIMD build that prefetches (AVX-512 where the CPU has it, AVX2)."""
    for march in ("native", "haswell") if X86 else ("native",):
        monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", march)
        lib = library()
        try:
            assert lib.es_set_prefetch_rows(1) == 1
            always = _kernel_results(kind)
            assert lib.es_set_prefetch_rows(1000) == 1000
            never = _kernel_results(kind)
        finally:
            lib.es_set_prefetch_rows(0)
        assert np.array_equal(always[0], never[0]) and np.array_equal(always[1], never[1]), march


def test_the_prefetch_row_count_defaults_by_cpu_and_is_checked(monkeypatch):
    lib = library()
    vendor = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("vendor_id")), "")
    assert lib.es_set_prefetch_rows(0) == (7 if X86 and vendor == "AuthenticAMD" else 1)
    from edgespec.backends.native_lib import prefetch_rows_setting
    monkeypatch.setenv("EDGESPEC_PREFETCH_ROWS", "3")
    assert prefetch_rows_setting() == 3
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("EDGESPEC_PREFETCH_ROWS", bad)
        with pytest.raises(EngineError, match=f"EDGESPEC_PREFETCH_ROWS: expected an integer >= 1.*got '{bad}'"):
            prefetch_rows_setting()


def _cpu(field: str) -> str:
    return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith(field)), "")


@pytest.mark.parametrize("march", ["native", "haswell"] if X86 else ["native"])
def test_int4_one_row_panels_change_no_bit_and_default_by_cpu(march, monkeypatch):
    """es_set_q4_row_panels picks how many panels a one-row int4 product streams per pass (the x86 builds: AVX-512
    VNNI and AVX2; Arm and portable C stream one): 1, 2 and 4 give the same bits as numpy's reference and each
    other, at one row on the calling thread and on the pool; the default is 1 on AMD and 4 elsewhere; a value the
    kernel lacks is refused; EDGESPEC_INT4_ROW_PANELS is checked."""
    monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", march)
    lib = library()
    simd = X86 and "avx2" in _cpu("flags").split()  # an x86 build with SIMD: the kernel takes 1, 2 or 4
    rng = np.random.default_rng(5)
    k, n = 20 * QB, 16 * 37  # 37 panels: the 4- and 2-panel passes' tails
    packed = _packed(rng.normal(0, 0.2, (n, k)).astype(np.float32), "int4")
    x = rng.normal(0, 1, (3, k)).astype(np.float32)
    exact = matmul_reference(x, packed, "int4")
    first = None
    try:
        for panels in (1, 2, 4):
            assert lib.es_set_q4_row_panels(panels) == (panels if simd else 1)
            got = np.stack([_matmul(lib, "int4", x[r:r + 1], packed, k, n, threads)[0]
                            for threads in (1, 2) for r in range(3)])  # (6, n): one row a call
            np.testing.assert_allclose(got, np.concatenate([exact, exact]), rtol=0, atol=1e-6 * np.abs(exact).max())
            first = got if first is None else first
            assert np.array_equal(got, first), panels
        in_force = lib.es_q4_row_panels()
        assert lib.es_set_q4_row_panels(3) == -1 and lib.es_q4_row_panels() == in_force  # refused, unchanged
    finally:
        default = lib.es_set_q4_row_panels(0)
    assert default == (1 if not simd or _cpu("vendor_id") == "AuthenticAMD" else 4)
    from edgespec.backends.native_lib import q4_row_panels_setting
    monkeypatch.delenv("EDGESPEC_INT4_ROW_PANELS", raising=False)
    assert q4_row_panels_setting() == 0
    monkeypatch.setenv("EDGESPEC_INT4_ROW_PANELS", "2")
    assert q4_row_panels_setting() == 2
    for bad in ("3", "0", "four"):
        monkeypatch.setenv("EDGESPEC_INT4_ROW_PANELS", bad)
        with pytest.raises(EngineError, match=f"EDGESPEC_INT4_ROW_PANELS: expected 1, 2 or 4.*got '{bad}'"):
            q4_row_panels_setting()


# ---- whole models ----

@pytest.fixture(scope="module")
def quant_folders(tmp_path_factory):
    """(family, kind) -> (folder, spec, weights): fp32 exports with native weights of each kind."""
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import add_native
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("native-quant")
    out = {}
    for i, name in enumerate(("llama3", "gemma3", "phi3")):
        _make(CONFIGS[name](), root / "ck" / name, seed=80 + i)
        base = root / name / "fp32"
        export_engine(root / "ck" / name, base, max_context=96, progress=False)
        spec, weights = load_checkpoint(root / "ck" / name)
        out[(name, "float16")] = (base, spec, weights)
        rows = [np.random.default_rng(3).integers(0, 96, 40)]
        for kind in ("int8", "int4"):
            folder = root / name / kind
            shutil.copytree(base, folder)
            info = add_native(folder, spec, weights, None, kind, base=(rows, [np.zeros((40, 96), np.float32)]),
                              role="draft")  # a draft's gate records, never refuses: the test is the arithmetic
            assert info["weights"] == kind and info["head_weights"] == ("int8" if kind == "int4" else kind), info
            out[(name, kind)] = (folder, spec, weights)
    return out


def _dequantized(weights: dict, kind: str) -> dict:
    """The checkpoint with every matrix the native step quantizes replaced by what it holds (q * scale)."""
    out = dict(weights)
    for name, w in weights.items():
        if w.ndim == 2 and name != "model.embed_tokens.weight":
            as_kind = "int8" if (name == "lm_head.weight" and kind == "int4") else kind
            out[name] = dequantize(_packed(np.asarray(w, np.float32), as_kind), as_kind)
    return out


def _quantized_inputs_linear(monkeypatch):
    """The torch reference's every product with its input rounded as native_step.c rounds it (int8 per block
    of 32: quantize_activations), so that the reference on the dequantized weights is the integer engines'
    function."""
    from edgespec.export import reference
    linear = reference.F.linear

    def rounded(x, w, b=None):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.float32).numpy()
        xq, dx = quantize_activations(flat)
        back = (xq.reshape(flat.shape[0], -1, QB).astype(np.float32) * dx[..., None]).reshape(shape)
        return linear(torch.from_numpy(back), w, b)

    monkeypatch.setattr(reference.F, "linear", rounded)


@pytest.mark.parametrize("name", ["llama3", "gemma3", "phi3"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_engines_compute_the_reference_on_their_dequantized_weights(quant_folders, name, kind, monkeypatch):
    from edgespec.export.reference import ReferenceDecoder
    folder, spec, weights = quant_folders[(name, kind)]
    if "lm_head.weight" not in weights:  # tied: the checkpoint maker names it
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    ref = ReferenceDecoder(spec, _dequantized(weights, kind))
    toks = np.random.default_rng(4).integers(0, 96, (1, 50))
    unrounded = ref(torch.as_tensor(toks)).numpy()[0]  # the weights' function with float inputs
    _quantized_inputs_linear(monkeypatch)
    want = ref(torch.as_tensor(toks)).numpy()[0]
    dec = open_engine(folder, "cpu-native").decoder()
    got = []
    for a, b in ((0, 20), (20, 21), (21, 26), (26, 50)):  # prefill, a step, a verify-sized call, a chunk
        got.append(np.array(dec(toks[:, a:b]))[0])
        dec.cache.commit(b - a)
    got = np.concatenate(got)
    # the same function up to float summation order, except where an activation sits on a rounding boundary
    # and the two round it to neighbouring levels: one step of one input, which later rows then carry too
    scale = max(1.0, float(np.abs(want).max()))
    diff, off = np.abs(got - want), np.abs(got - unrounded)
    assert np.median(diff) <= 1e-4 * scale and diff.max() <= 2e-2 * scale, (name, kind, float(diff.max()))
    assert np.median(diff) < np.median(off) / 100  # far nearer the rounded reference than the unrounded one
    margin = np.sort(want, -1)[:, -1] - np.sort(want, -1)[:, -2]
    assert (got.argmax(-1) == want.argmax(-1))[margin > 4e-2 * scale].all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_weights_change_the_function_measurably(quant_folders, kind):
    """The dequantized-weights reference is not vacuous: the float16 engine differs from it."""
    from edgespec.export.reference import ReferenceDecoder
    folder, spec, weights = quant_folders[("llama3", kind)]
    toks = np.random.default_rng(4).integers(0, 96, (1, 20))
    want = ReferenceDecoder(spec, _dequantized(weights, kind))(torch.as_tensor(toks)).numpy()[0]
    f16 = np.array(open_engine(quant_folders[("llama3", "float16")][0], "cpu-native").decoder()(toks))[0]
    assert np.abs(f16 - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_decoding_equals_plain(quant_folders, kind):
    folder = quant_folders[("gemma3", kind)][0]
    plain = edgespec.load(folder, provider="cpu-native", threads=2)
    spec = edgespec.load(folder, draft="ngram", gamma=3, provider="cpu-native", threads=2)
    for prompt in ([5, 17, 3, 60, 42, 9, 11], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]):
        assert spec.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids


@pytest.mark.parametrize("kind", ["float16", "int4"])
def test_a_batch_equals_each_sequence_alone(quant_folders, kind):
    """Three sequences at different lengths in one call (the weights read once) give the bits each gives alone."""
    folder = quant_folders[("gemma3", kind)][0]
    eng = open_engine(folder, "cpu-native", threads=2)
    toks = np.random.default_rng(6).integers(0, 96, (3, 40))
    lens = [7, 19, 12]
    alone = []
    for b in range(3):
        d = eng.decoder(1)
        d(toks[b:b + 1, :lens[b]])
        d.cache.commit(lens[b])
        alone.append(np.array(d(toks[b:b + 1, lens[b]:lens[b] + 4]))[0])
    d = eng.decoder(3)
    for b in range(3):  # each sequence's prefix, padded: the rows past its length are never committed
        d(np.stack([toks[i, :lens[b]] for i in range(3)]))
        d.cache.commit(np.array([lens[b] if i == b else 0 for i in range(3)]))
    batch = np.array(d(np.stack([toks[b, lens[b]:lens[b] + 4] for b in range(3)])))
    for b in range(3):
        assert np.array_equal(batch[b], alone[b]), b


@pytest.mark.parametrize("name", ["llama3", "gemma3"])  # gemma3: the sandwich norms' other path to a product
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_in_the_norms_and_the_activation_changes_no_bit(quant_folders, name, kind, monkeypatch):
    """The norms and the activation quantize the rows they write (ES_FUSE_QUANT): every call's logits equal, bit
    for bit, those of the build where each product quantizes its input in a job of its own: on one thread, and on
    two with every job of several rows on the pool (-DES_MIN_PARALLEL=1), so a helper writes some of the rows."""
    folder = quant_folders[(name, kind)][0]
    toks = np.random.default_rng(6).integers(0, 96, (1, 60))
    for threads, extra in ((2, "-DES_MIN_PARALLEL=1"), (1, "")):
        monkeypatch.setenv("EDGESPEC_NATIVE_CFLAGS", extra)
        fused = open_engine(folder, "cpu-native", threads=threads).decoder()
        monkeypatch.setenv("EDGESPEC_NATIVE_CFLAGS", f"{extra} -DES_FUSE_QUANT=0")
        apart = open_engine(folder, "cpu-native", threads=threads).decoder()
        monkeypatch.delenv("EDGESPEC_NATIVE_CFLAGS")
        assert fused.engine.lib is not apart.engine.lib
        for a, b in ((0, 40), (40, 41), (41, 46), (46, 60)):
            x, y = np.array(fused(toks[:, a:b])), np.array(apart(toks[:, a:b]))
            fused.cache.commit(b - a)
            apart.cache.commit(b - a)
            assert np.array_equal(x, y), (name, kind, threads, a, float(np.abs(x - y).max()))


def test_a_stalling_helper_changes_no_bit(quant_folders, monkeypatch):
    """The -DES_TEST_STALL build: helpers sleep 2 ms inside every third chunk they hold. The caller computes
    those chunks itself (es_stolen counts them) and every output bit equals the one-thread run."""
    folder = quant_folders[("phi3", "int4")][0]
    toks = np.random.default_rng(7).integers(0, 96, (1, 30))

    def run(threads):
        d = open_engine(folder, "cpu-native", threads=threads).decoder()
        out = [np.array(d(toks[:, :20]))]
        d.cache.commit(20)
        for i in range(20, 30):
            out.append(np.array(d(toks[:, i:i + 1])))
            d.cache.commit(1)
        return out

    one = run(1)
    monkeypatch.setenv("EDGESPEC_NATIVE_CFLAGS", "-DES_TEST_STALL")
    lib = library()
    before = lib.es_stolen()
    rng = np.random.default_rng(1)  # 256 chunks of ~30 us: the helper holds some, stalls in a third of them
    k, n = 32 * QB, 16 * 256
    w = _packed(rng.normal(0, 0.2, (n, k)).astype(np.float32), "int4")
    x = rng.normal(0, 1, (12, k)).astype(np.float32)
    want = _matmul(lib, "int4", x, w, k, n, 1)
    for _ in range(20):  # the helper may be asleep, or wait for a busy core, through a whole call
        assert np.array_equal(_matmul(lib, "int4", x, w, k, n, 2), want)
        if lib.es_stolen() > before:
            break
    assert lib.es_stolen() > before, "no chunk was taken over: the stall path did not run"
    for _ in range(3):  # whole steps: a tiny model's jobs are a few chunks each, the helper joins some
        for a, b in zip(one, run(2)):
            assert np.array_equal(a, b)


def test_each_thread_takes_its_own_share_in_order(monkeypatch):
    """The -DES_TEST_CLAIMS build logs each claim of a pooled job. Every chunk is claimed exactly once; each
    thread's claims in its own share (thread t of 2: chunks [t n / 2, (t + 1) n / 2)) run from the share's
    start without a gap, and what it takes from the other's share runs down from that share's end."""
    monkeypatch.setenv("EDGESPEC_NATIVE_CFLAGS", "-DES_TEST_CLAIMS")
    lib = library()
    lib.es_claims.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.es_claims.restype = ctypes.c_int64
    rng = np.random.default_rng(3)
    k, n = 28 * QB, 16 * 512  # 512 int4 panels of 8 KB: 32 chunks on 2 threads
    w = _packed(rng.normal(0, 0.2, (n, k)).astype(np.float32), "int4")
    x = rng.normal(0, 1, (1, k)).astype(np.float32)
    want = _matmul(lib, "int4", x, w, k, n, 1)
    log = np.zeros((4096, 2), np.int64)
    helped = False
    for _ in range(50):  # until the helper (often asleep between calls) takes part in one
        lib.es_claims(log.ctypes.data, 0)  # clear
        assert np.array_equal(_matmul(lib, "int4", x, w, k, n, 2), want)
        count = lib.es_claims(log.ctypes.data, len(log))
        claims = log[:count]
        chunks = sorted(claims[:, 1].tolist())
        assert chunks == list(range(count)) and count >= 8, f"chunks claimed: {chunks}"
        half = [(0, count // 2), (count // 2, count)]
        for t in (0, 1):
            mine = claims[claims[:, 0] == t, 1].tolist()
            lo, hi = half[t]
            own = [c for c in mine if lo <= c < hi]
            other = [c for c in mine if not lo <= c < hi]
            assert own == list(range(lo, lo + len(own))), f"thread {t}'s own chunks {own}"
            olo, ohi = half[1 - t]
            assert other == list(range(ohi - 1, ohi - 1 - len(other), -1)), f"thread {t} took {other}"
        if (claims[:, 0] == 1).any():
            helped = True
            break
    assert helped, "the helper thread claimed nothing in 50 calls"


def test_the_native_precision_gate_refuses_a_target_and_records_a_draft(quant_folders, tmp_path):
    from edgespec.export.native import native_agreement_gate
    folder = quant_folders[("llama3", "int4")][0]
    rows = [np.random.default_rng(8).integers(0, 96, 32)]
    wrong = [np.random.default_rng(9).normal(0, 1, (32, 96)).astype(np.float32)]  # logits of another model
    gate = native_agreement_gate(folder, rows, wrong, "int4", "target", allow_lossy=False)
    assert not gate["passed"] and "precision" in gate["error"] and gate["top1_agreement"] < 0.5
    lossy = native_agreement_gate(folder, rows, wrong, "int4", "target", allow_lossy=True)
    assert lossy["passed"] and lossy["overridden"]
    draft = native_agreement_gate(folder, rows, wrong, "int4", "draft", allow_lossy=False)
    assert draft["passed"] and not draft["enforced"]


def test_the_loader_checks_integer_weights_against_engine_json(quant_folders, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(quant_folders[("llama3", "int4")][0], bad)
    m = Manifest.read(bad)
    m.extra["native"]["weights"] = "int8"  # the npz holds int4 blocks
    m.extra["native"]["sha256"] = None
    m.write(bad)
    with pytest.raises(EngineError, match=r"layers.0.wqkv: expected \(\d+, \d+, 544\), got \(\d+, \d+, 288\)"):
        open_engine(bad, "cpu-native")
    m.extra["native"]["weights"] = "int3"
    m.write(bad)
    with pytest.raises(EngineError, match=r"weights 'int3': the native step reads"):
        open_engine(bad, "cpu-native", check_hashes=False)


def test_integer_weights_need_inputs_in_whole_blocks(tiny_checkpoints):
    """conftest's tiny models have an MLP of 48: no int4 blocks of 32 fit; the record says why."""
    from edgespec.export.checkpoint import CheckpointError, load_checkpoint
    from edgespec.export.native import native_arrays
    spec, weights = load_checkpoint(tiny_checkpoints["llama"][0])
    with pytest.raises(CheckpointError, match=r"native int4 weights need inputs in multiples of 32.*intermediate_size"):
        native_arrays(spec, weights, "int4", exact=False)


def test_the_model_struct_matches_the_c_layout():
    """native_step.c's es_model and native.py's ctypes copy: the loader refuses a mismatch (checked here)."""
    from edgespec.backends.native_lib import _Model
    off = ctypes.c_int64()
    assert library().es_model_layout(ctypes.byref(off)) == ctypes.sizeof(_Model)
    assert off.value == _Model.inv_freq.offset


def test_the_threads_bench_judges_its_target_and_runs(quant_folders, tmp_path, monkeypatch, capsys):
    import json
    bench = _bench("bench_native_threads")
    ok = {(0, 1): 60.0, (0, 2): 100.0, (1, 1): 60.0, (1, 2): 61.0}
    assert bench.threads_checks(ok, 2)["met"]
    assert not bench.threads_checks({**ok, (1, 2): 59.0}, 2)["met"]  # below one thread beside the same load
    assert not bench.threads_checks({**ok, (0, 2): 130.0, (1, 1): 40.0, (1, 2): 64.0}, 2)["met"]  # < half quiet
    assert bench.threads_checks({(0, 1): 1.0, (0, 2): 2.0}, 2) == {}
    assert bench.threads_checks({**ok, (1, "auto"): 62.0}, "auto")["met"]  # the default may be auto
    out = tmp_path / "t.json"
    args = ["--engine", str(quant_folders[("llama3", "int4")][0]), "--out", str(out), "--hogs", "0", "--tokens", "3",
            "--repeats", "1", "--batches", "1,2"]
    with pytest.raises(SystemExit):  # auto (in the default --threads) needs the count left open
        bench.main(args)
    assert "unset EDGESPEC_THREADS" in capsys.readouterr().err
    monkeypatch.delenv("EDGESPEC_THREADS", raising=False)
    assert bench.main(args) == 0
    r = json.loads(out.read_text())
    assert [(x["hogs"], x["threads"]) for x in r["rows"]] == [(0, 1), (0, 2), (0, "auto")] and r["weights"] == "int4"
    assert r["rows"][2].get("auto_current", 1) in (1, os.cpu_count())  # absent on one core: no governor
    assert set(r["batches"]) == {"1", "2"} and "| auto, tok/s |" in out.with_suffix(".md").read_text()
    assert {"cpu", "vendor", "kernel_flags", "load_before"} <= set(r["machine"])  # AMD and Intel defaults differ


def test_the_governor_recovery_bench_runs_both_governors_from_one_thread(quant_folders, tmp_path, monkeypatch,
                                                                          capsys):
    import json
    bench = _bench("bench_governor_recovery")
    out = tmp_path / "r.json"
    args = ["--engine", str(quant_folders[("llama3", "int4")][0]), "--out", str(out), "--steps", "6", "--repeats", "2"]
    monkeypatch.setenv("EDGESPEC_THREADS", "2")
    with pytest.raises(SystemExit):
        bench.main(args)
    assert "unset EDGESPEC_THREADS" in capsys.readouterr().err
    monkeypatch.delenv("EDGESPEC_THREADS")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the engine opens without a governor")
    assert bench.main(args) == 0
    r = json.loads(out.read_text())
    assert set(r["summary"]) == set(r["trials"]) == {"watched", "schedule"}
    for k, trials in r["trials"].items():
        assert len(trials) == 2 and all(t["threads"][0] == 1 and len(t["step_ms"]) == 6 for t in trials)
    assert all(t["idle_probes"] == 0 for t in r["trials"]["schedule"])  # the schedule alone never reads idle time
    assert "| watched |" in out.with_suffix(".md").read_text()


def test_the_profile_counts_each_job_of_a_call(quant_folders):
    """One call of a 2-layer int4 model runs per layer 2 norms, 4 products, the cache rows and the attention, and
    the final norm, lm_head and argmax: the profile counts them. The norms and the activation quantize the rows
    they write for the product after them, so only the attention output's product has a quantize job."""
    from edgespec.backends import native_lib as native
    folder = quant_folders[("llama3", "int4")][0]
    dec = open_engine(folder, "cpu-native", threads=1).decoder()
    L = Manifest.read(folder).num_layers
    native.profile(reset=True)
    dec(np.arange(5)[None])
    p = native.profile(reset=True)
    want = {"norm": 2 * L + 1, "add_norm": 0, "matmul": 4 * L + 1, "kv": L, "attention": L, "activation": L,
            "argmax": 1, "quantize": L}
    assert {k: v["jobs"] for k, v in p.items()} == want
    assert all(v["ms"] > 0 for k, v in p.items() if want[k]) and p["matmul"]["wait_ms"] == 0  # one thread
    assert native.profile(reset=False)["matmul"]["jobs"] == 0  # the reset zeroed them


def test_the_profile_bench_accounts_for_each_call(quant_folders, tmp_path):
    """bench_native_profile.py on a tiny int4 folder: per call size, the job kinds' times add up to at most the
    wall time, the product count per call is the model's, and a folder without native weights is refused."""
    import json
    bench = _bench("bench_native_profile")
    folder = quant_folders[("llama3", "int4")][0]
    out = tmp_path / "p.json"
    assert bench.main(["--engine", str(folder), "--out", str(out), "--rows", "1,3", "--calls", "4", "--prompt", "8",
                       "--repeats", "1", "--membw-mib", "16"]) == 0
    r = json.loads(out.read_text())
    L = Manifest.read(folder).num_layers
    for rows in ("1", "3"):
        c = r["calls"][rows]
        assert c["kinds"]["matmul"]["jobs"] == 4 * L + 1 and c["kinds"]["quantize"]["jobs"] == L  # o-proj only
        assert 0 < c["native_ms"] <= c["ms_per_call"] and c["host_ms"] == pytest.approx(c["ms_per_call"] - c["native_ms"])
    assert r["weights"] == "int4" and out.with_suffix(".md").read_text().count("\n| ") == 3
    assert bench.main(["--engine", str(folder), "--out", str(out), "--rows", "1", "--calls", "2", "--prompt", "8",
                       "--repeats", "2", "--membw-mib", "16", "--int4-row-panels", "1,4"]) == 0
    r = json.loads(out.read_text())
    four = library().es_set_q4_row_panels(4)  # 1 where this build streams one panel (no AVX-512 VNNI)
    library().es_set_q4_row_panels(0)
    assert {k: v["int4_row_panels"] for k, v in r["variants"].items()} == {
        "hugepages=1 int4_row_panels=1": 1, "hugepages=1 int4_row_panels=4": four}
    assert all(len(v["raw"]["1"]) == 2 for v in r["variants"].values())
    assert bench.main(["--engine", str(folder), "--out", str(out), "--int4-row-panels", "3"]) == 2
    # two builds in one process, each variant counted by its own library (another's counters would read 0 jobs)
    assert bench.main(["--engine", str(folder), "--out", str(out), "--rows", "1", "--calls", "2", "--prompt", "8",
                       "--repeats", "2", "--membw-mib", "16", "--cflags=", "--cflags=-DES_ATTN_GROUP=1"]) == 0
    r = json.loads(out.read_text())
    assert {k: v["cflags"] for k, v in r["variants"].items()} == {
        "hugepages=1 cflags=''": "", "hugepages=1 cflags='-DES_ATTN_GROUP=1'": "-DES_ATTN_GROUP=1"}
    for v in r["variants"].values():
        assert v["calls"]["1"]["kinds"]["matmul"]["jobs"] == 4 * L + 1 and len(v["raw"]["1"]) == 2
    assert "EDGESPEC_NATIVE_CFLAGS '-DES_ATTN_GROUP=1'" in out.with_suffix(".md").read_text()
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    m = Manifest.read(bare)
    m.extra["native"] = {"unavailable": "none here"}
    m.write(bare)
    assert bench.main(["--engine", str(bare), "--out", str(tmp_path / "x.json")]) == 2


def test_the_products_bench_times_every_variant_and_checks_its_arguments(tmp_path, capsys):
    """bench_products.py on a few small matrices: a result per (kind, distance, rows) with its bytes and
    multiply-adds consistent with the time, the prefetch row count applied, and bad arguments refused by name."""
    import json
    bench = _bench("bench_products")
    out = tmp_path / "p.json"
    before = library().es_prefetch_rows()
    assert bench.main(["--out", str(out), "--kinds", "float16,int4", "--rows", "1,3", "--prefetch", "0,512",
                       "--panels-row1", "0,4", "--shape", "256x128", "--gb", "0.0005", "--repeats", "1",
                       "--prefetch-rows", "3"] + (["--marches", "native,x86-64"] if X86 else [])) == 0
    r = json.loads(out.read_text())
    marches = ("native", "x86-64") if X86 else ("native",)
    assert {x["pf_next_pass"] for x in r["results"]} == {1} and {x["stream_split"] for x in r["results"]} == {1}
    assert [(x["kind"], x["prefetch"], x["panels_row1"], x["march"], x["rows"]) for x in r["results"]] == [
        (k, d, f, m, n) for k in ("float16", "int4") for d in (0, 512) for f in (0, 4) for m in marches for n in (1, 3)]
    for x in r["results"]:
        assert x["matrices"] >= 1 and x["ms"] > 0
        assert x["gmacs"] == pytest.approx(x["matrices"] * x["rows"] * 256 * 128 / (x["ms"] / 1e3) / 1e9)
    assert r["shape"] == [256, 128] and r["prefetch_rows"] == 3 and r["prefetch_rows_cpu_default"] >= 1
    assert library().es_prefetch_rows() == before  # the variants are libraries of their own: the runtime's untouched
    for bad, what in ((["--shape", "100x128"], "--shape"), (["--shape", "big"], "--shape"),
                      (["--rows", "13"], "--rows"), (["--kinds", "int2"], "--kinds"),
                      (["--prefetch-rows", "0"], "--prefetch-rows"), (["--panels-row1", "3"], "--panels-row1"),
                      (["--pf-next-pass", "2"], "--pf-next-pass"), (["--stream-split", "3"], "--stream-split")):
        with pytest.raises(SystemExit):
            bench.main(["--out", str(tmp_path / "x.json"), *bad])
        assert what in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_one_row_products_give_the_same_bits_with_any_panels_per_pass(kind):
    """ES_QPANELS_ROW1 changes how many panels a one-row integer product streams at once, never a bit of the
    result: the libraries built with 1, 2 and 4 agree exactly with each other and with the default build, on one
    row and on the two and three rows they share."""
    from edgespec.backends.native_format import WEIGHT_KINDS, pack_blocks, quantize_blocks
    bench = _bench("bench_products")
    rng = np.random.default_rng(7)
    N, K = 16 * 13, 32 * 5  # 13 panels: groups of 2 and 4 leave a remainder
    w = pack_blocks(*quantize_blocks(rng.normal(0, 0.1, (N, K)).astype(np.float32), kind), kind)
    libs = [library()] + [bench.variant(0, f) for f in (1, 2, 4)]
    for rows in (1, 2, 3):
        x = rng.normal(0, 1, (rows, K)).astype(np.float32)
        outs = []
        for lib in libs:
            y = np.zeros((rows, N), np.float32)
            assert lib.es_matmul(WEIGHT_KINDS[kind], x.ctypes.data, rows, w.ctypes.data, K, N, y.ctypes.data, 2) == 0
            outs.append(y)
        for y in outs[1:]:
            np.testing.assert_array_equal(y, outs[0])


@pytest.mark.parametrize("kind", KINDS)
def test_split_streams_change_no_bit(kind):
    """ES_STREAM_SPLIT=1 (the default) gives each thread's share of a product kw address streams that run through
    it chunk after chunk, a pass reading one panel of each; 0 makes chunks and passes of consecutive panels. Only
    the order the panels are computed in changes: on every SIMD build, the libraries built each way agree exactly
    with each other and with the numpy reference, for calls of 1, 2, 5 and 12 rows on one and two threads, with
    several chunks per share and the matrix ending inside the last share's last stream."""
    from edgespec.backends.native_format import matmul_reference
    bench = _bench("bench_products")
    rng = np.random.default_rng(11)
    N, K = 16 * 301, 32 * 6  # 301 panels: no whole number of panels per stream (2 threads x 1, 2 or 4 streams)
    w = rng.normal(0, 0.1, (N, K)).astype(np.float32)
    packed = _packed(w, kind)
    for march in ("native", "haswell") if X86 else ("native",):
        libs = [bench.variant(0, 0, march, 1, split) for split in (0, 1)]
        for rows in (1, 2, 5, 12):
            x = rng.normal(0, 1, (rows, K)).astype(np.float32)
            exact = matmul_reference(x, packed, kind)
            for threads in (1, 2):
                got = [_matmul(lib, kind, x, packed, K, N, threads) for lib in libs]
                np.testing.assert_array_equal(got[1], got[0], err_msg=f"{march}, {rows} rows, {threads} threads")
                np.testing.assert_allclose(got[1], exact, rtol=0, atol=1e-6 * np.abs(exact).max())


def _bench(name: str):
    """bench/NAME.py as a module (the benches are scripts, not a package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench

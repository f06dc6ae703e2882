"""cuda_step.cu's kernels, run on the CPU: the source compiled with g++ against tests/cuda_emu/emu.h (a CUDA thread is
a fiber of one host thread, __syncthreads and the warp shuffles are barriers, a graph is the list of its captured
launches), loaded as provider cuda-native's library, and compared with provider cpu-native on the same folders.

This checks the kernels' indexing, reductions, masks and family options, and the graphs' capture and replay,
where there is no GPU; the summation order differs from native_step.c's, so logits agree to rounding
(relative 1e-5), and ids exactly on these folders. What only a GPU shows (speed, the hardware's memory model)
is the gpu-marked tests' and the device check's.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_cuda_native import folders  # noqa: F401 - the module-scoped fixture (a llama, gemma3, qwen2 and a draft)

import edgespec
from edgespec.backends import cuda_lib, cuda_native, open_engine

EMU = Path(__file__).parent / "cuda_emu"

if shutil.which("g++") is None:
    pytest.skip("the emulated kernels are compiled with g++ (C++20); none here (apt-get install g++)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu") / "cuda_step_emulated.so"
    cmd = ["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-x", "c++", "-include", str(EMU / "emu.h"),
           "-I", str(EMU), str(cuda_lib.SOURCE), "-o", str(out), "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return cuda_lib.CudaRuntime(lib=cuda_lib.load(out))


@pytest.fixture
def on_emulated(emulated, monkeypatch):
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: emulated)
    return emulated


def _close(a, b):
    scale = max(1.0, float(np.abs(a).max()))
    assert np.abs(a - b).max() <= 1e-5 * scale, np.abs(a - b).max()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2"])
def test_the_kernels_compute_what_cpu_native_computes(folders, on_emulated, name):  # noqa: F811
    """A prompt, steps and a verify-sized call with a rewind between: every family option of the folder
    (biases, q/k norms, sandwich norms, GeGLU, scaled embeddings, two rotaries, windows of 8 over 13+ rows)."""
    cpu, gpu = open_engine(folders[name], "cpu-native").decoder(), open_engine(folders[name], "cuda-native").decoder()
    rng = np.random.default_rng(3)
    for s, keep in ((8, 8), (1, 1), (3, 3), (1, 1)):  # positions up to 12: past the windows of 8
        t = rng.integers(0, 96, (1, s))
        _close(cpu(t), gpu(t))
        assert np.array_equal(cpu.last_ids(), gpu.last_ids())
        for d in (cpu, gpu):
            d.cache.commit(keep)
    n = int(gpu.cache.lengths[0])
    for j in (0, 1, 2 * gpu.m.num_layers - 1):  # keys and values written where native_step.c writes them
        np.testing.assert_allclose(gpu.cache.host(j)[:, :, :n], cpu.cache.host(j)[:, :, :n], rtol=1e-5, atol=1e-5)
    assert gpu.captures == 3 and gpu.launches == 4  # S = 8, 1, 3: the second S = 1 call replays its graph
    assert gpu.kernel_s > 0  # the events around the kernels are recorded inside the graphs


def test_a_batch_with_padding_and_the_hidden_state(folders, on_emulated):  # noqa: F811
    cpu, gpu = open_engine(folders["llama"], "cpu-native").decoder(2), open_engine(folders["llama"], "cuda-native").decoder(2)
    rng = np.random.default_rng(4)
    valid = np.array([[True] * 4, [True] * 2 + [False] * 2])
    t = rng.integers(0, 96, (2, 4))
    a, b = cpu(t, valid), gpu(t, valid)
    _close(a[0], b[0])
    _close(a[1, :2], b[1, :2])
    for d in (cpu, gpu):
        d.cache.commit(np.array([4, 2]))
    t = rng.integers(0, 96, (2, 2))
    _close(cpu(t), gpu(t))
    assert np.array_equal(cpu.last_ids(), gpu.last_ids())
    np.testing.assert_allclose(gpu.hidden_at(1, 3), cpu.hidden_at(1, 3), rtol=1e-5, atol=1e-5)


def test_a_nonfinite_row_gives_no_id_and_its_rows_are_zeroed(folders, on_emulated, tmp_path):  # noqa: F811
    """The argmax kernel's -1 (the contract's NONFINITE_ID) and the decoder's scrub of the rows it wrote."""
    gpu = open_engine(folders["llama"], "cuda-native").decoder()
    gpu.ids(np.array([[3, 4]]))
    gpu.cache.commit(2)
    w = gpu.engine.weights["norm"]  # the final norm's weights: every logit NaN
    gpu.memory.write(w, np.full(w.shape, np.nan, np.float32))
    assert gpu.ids(np.array([[5]])).tolist() == [[-1]]
    assert not gpu.cache.host(0)[0, :, 2].any()  # the row the failed call wrote, zeroed
    assert gpu.cache.host(0)[0, :, :2].any()


def test_a_policy_decoder_takes_its_prefix_rows(tmp_path_factory, on_emulated):
    """An inputs_embeds engine (a VLA policy's decoder): the call's rows copied to x instead of the embedding
    kernel, then steps by id (the rows of the folder's table) through the graphs."""
    from conftest import make_f16_policy, policy_obs
    folder = make_f16_policy(tmp_path_factory.mktemp("f16policy"))
    cpu = edgespec.load_policy(folder, provider="cpu-native")
    gpu = edgespec.load_policy(folder, provider="cuda-native")
    pre = cpu.encode(*policy_obs(1))  # (1, P, E)
    a, b = cpu.target, gpu.target
    _close(a(None, embeds=pre), b(None, embeds=pre))
    for d in (a, b):
        d.cache.commit(pre.shape[1])
    for tok in (a.last_ids()[0, -1], 3):
        _close(a(np.array([[tok]])), b(np.array([[tok]])))
        assert np.array_equal(a.last_ids(), b.last_ids())
        for d in (a, b):
            d.cache.commit(1)


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("normed", [False, True])
def test_the_matrix_kernels_equal_the_dequantized_reference(emulated, kind, glu, normed):
    """Every row tile (1, 2, 4, 8, 16 rows; 8 with glu) of each weight kind against numpy: x @ (q * scale), the rows
    first RMS-normed where the product fuses a norm."""
    from edgespec.backends.native_format import WEIGHT_KINDS, dequantize, pack, pack_blocks, quantize_blocks
    rng = np.random.default_rng(0)
    n, k = 64, 96
    w = rng.normal(0, 0.5, (n, k)).astype(np.float16)
    packed = pack(w) if kind == "float16" else pack_blocks(*quantize_blocks(w, kind), kind)
    ref_w = dequantize(packed, kind).astype(np.float64)
    for t in (1, 2, 3, 5, 9, 17):
        x = rng.normal(0, 1, (t, k)).astype(np.float32)
        nw = rng.normal(1, 0.3, k).astype(np.float32) if normed else None
        x64 = x.astype(np.float64)
        if normed:
            x64 = nw * (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6))
        y = x64 @ ref_w.T
        if glu:
            g, u = y[:, :n // 2], y[:, n // 2:]
            y = g / (1 + np.exp(-g)) * u
        got = emulated.matmul(WEIGHT_KINDS[kind], x, packed, glu=glu, norm=nw)
        np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-5 * np.abs(y).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_an_integer_model_decodes_as_cpu_native_does(folders, on_emulated, tmp_path, kind):  # noqa: F811
    """The whole step over integer blocks: the same ids as cpu-native, logits to the rounding of the rows (the
    CPU quantizes them to int8 per block, the GPU multiplies them as they are)."""
    q = tmp_path / kind
    shutil.copytree(folders["llama"], q)
    from edgespec.export.native import main as add_native
    add_native([str(q), "--checkpoint", str(folders["llama"].parent / "ck-llama"), "--weights", kind,
                "--allow-lossy"])
    cpu, gpu = open_engine(q, "cpu-native").decoder(), open_engine(q, "cuda-native").decoder()
    t = np.array([[5, 17, 3, 60, 42, 9]])
    a, b = cpu(t), gpu(t)
    assert np.abs(a - b).max() <= 0.02 * max(1.0, float(np.abs(a).max()))
    assert (cpu.last_ids() == gpu.last_ids()).mean() >= 5 / 6


def test_a_profiled_call_times_every_kernel_by_kind(folders, on_emulated):  # noqa: F811
    """profile(): the same call without a graph, an event after each kernel; its counts are the step's kernels."""
    gpu = open_engine(folders["gemma3"], "cuda-native").decoder()
    cpu = open_engine(folders["gemma3"], "cpu-native").decoder()
    t = np.array([[5, 17, 3]])
    prof = gpu.profile(t)
    _close(cpu(t), np.asarray(gpu.last_logits()))  # the profiled call computed the same thing
    L = gpu.m.num_layers
    # gemma3: 4 products per layer + the lm_head; sandwich norms add two per layer, then the final norm
    assert {k: v["kernels"] for k, v in prof.items()} == {
        "embed": 1, "matmul": 4 * L + 1, "rope_kv": L, "attention": L, "attention_merge": L, "norm": 2 * L + 1,
        "argmax": 1}
    assert all(v["ms"] >= 0 for v in prof.values()) and gpu.captures == 0

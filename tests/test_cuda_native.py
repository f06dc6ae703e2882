"""Provider cuda-native (edgespec/backends/cuda_native.py, cuda_step.cu).

Without a GPU: cuda_step.cu compiles with this machine's nvcc for the architectures of cuda_lib.ARCHS it knows,
and the decoder's host side (the parameter block, the buffer layout, lengths after accept and rewind, the graphs
and when they are dropped) runs on a stand-in runtime (tests/cuda_standin.py) that does each call through
native_step.c from the addresses the decoder laid out: every output must equal provider cpu-native's bit for bit.
On a GPU (marker gpu): the real kernels against cpu-native on the same folders.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from conftest import char_tokenizer_json, make_f16_model, random_text_head
from cuda_standin import StandIn

import edgespec
from edgespec.backends import cuda_lib, cuda_native, draft_provider, open_engine
from edgespec.backends.cuda_native import GRAPH_MAX_S, MIN_ROWS_S, CudaNativeEngine, scratch_layout, splits_for
from edgespec.contract import EngineError

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("the stand-in runs native_step.c, compiled with a C compiler; none here (apt-get install gcc)",
                allow_module_level=True)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=95)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Engine folders with native weights: a llama target (with its hidden state), its noisy draft (float16 too),
    and the two families with the most options (gemma3: q/k norms, sandwich norms, GeGLU, scaled embeddings, two
    rotaries, windows; qwen2: q/k/v biases, windows on some layers)."""
    from conftest import _noisy_copy
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("cudanative")
    cfgs = {
        "llama": transformers.LlamaConfig(**SIZES),
        "gemma3": transformers.Gemma3TextConfig(
            **SIZES, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
        "qwen2": transformers.Qwen2Config(**SIZES, tie_word_embeddings=True, use_sliding_window=True,
                                          sliding_window=8, max_window_layers=2),
    }
    out = {}
    for i, (name, cfg) in enumerate(cfgs.items()):
        make_f16_model(cfg, root / f"ck-{name}", 30 + i)
        if name == "llama":  # a text head over its hidden state travels into the --hidden folder
            random_text_head(64, 96).save(root / f"ck-{name}" / "text_head.npz")
        out[name] = root / name
        export_engine(root / f"ck-{name}", out[name], max_context=256, progress=False, hidden=name == "llama")
    # a draft of float16 values near the target's: noise rounded to float16
    _noisy_copy(root / "ck-llama", root / "ck-draft", 0.02, seed=4)
    from safetensors.numpy import load_file, save_file
    w = load_file(str(root / "ck-draft" / "model.safetensors"))
    save_file({k: v.astype(np.float16).astype(v.dtype) for k, v in w.items()}, str(root / "ck-draft" / "model.safetensors"))
    char_tokenizer_json(root / "ck-draft" / "tokenizer.json")
    out["draft"] = root / "draft"
    export_engine(root / "ck-draft", out["draft"], max_context=256, progress=False)
    return out


@pytest.fixture
def standin(monkeypatch):
    """provider cuda-native on the stand-in runtime (the same one for every engine of the test)."""
    rt = StandIn()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)
    return rt


def _pair(folder, batch=1):
    return open_engine(folder, "cpu-native").decoder(batch), open_engine(folder, "cuda-native").decoder(batch)


def _same_call(cpu, gpu, tokens, valid=None):
    a, b = cpu(tokens, valid), gpu(tokens, valid)
    assert np.array_equal(a, b), np.abs(a - b).max()
    assert np.array_equal(cpu.last_ids(), gpu.last_ids())
    assert np.array_equal(cpu.cache.lengths, gpu.cache.lengths)
    return cpu.last_ids()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2"])
def test_calls_equal_cpu_native_bit_for_bit_through_accepts_and_rewinds(folders, standin, name):
    cpu, gpu = _pair(folders[name])
    rng = np.random.default_rng(0)
    _same_call(cpu, gpu, rng.integers(0, 96, (1, 11)))
    for d in (cpu, gpu):
        d.cache.commit(11)
    for step in range(12):  # verify-like calls of varying S, a varying share kept, sometimes a rewind
        s = 1 + step % 5
        _same_call(cpu, gpu, rng.integers(0, 96, (1, s)))
        keep = int(rng.integers(0, s + 1))
        for d in (cpu, gpu):
            d.cache.commit(keep)
        if step % 4 == 3:
            back = int(cpu.cache.lengths[0]) - 3
            for d in (cpu, gpu):
                d.cache.rewind_to(back)
    for j in range(0, 2 * cpu.m.num_layers):  # the committed cache rows themselves
        n = int(cpu.cache.lengths[0])
        assert np.array_equal(cpu.cache.host(j)[:, :, :n], gpu.cache.host(j)[:, :, :n])


def test_a_batch_at_different_lengths_with_padding_equals_cpu_native(folders, standin):
    cpu, gpu = _pair(folders["llama"], batch=2)
    rng = np.random.default_rng(1)
    valid = np.array([[True] * 9, [True] * 5 + [False] * 4])
    _same_call(cpu, gpu, rng.integers(0, 96, (2, 9)), valid)
    for d in (cpu, gpu):
        d.cache.commit(np.array([9, 5]))
    for s in (3, 1, 4):
        _same_call(cpu, gpu, rng.integers(0, 96, (2, s)))
        for d in (cpu, gpu):
            d.cache.commit(np.array([s, 1]))
    _same_call(cpu, gpu, rng.integers(0, 96, (2, 2)))  # the hidden state comes back on demand, as cpu-native's
    for b in (0, 1):
        pos = int(gpu.last_start[b]) + 1
        assert np.array_equal(cpu.hidden_at(b, pos), gpu.hidden_at(b, pos))


def test_one_graph_per_s_replayed_while_the_lengths_move(folders, standin):
    cpu, gpu = _pair(folders["llama"])
    _same_call(cpu, gpu, np.arange(1, 6)[None])
    for d in (cpu, gpu):
        d.cache.commit(5)
    for i in range(6):
        _same_call(cpu, gpu, np.array([[7 + i]]))
        _same_call(cpu, gpu, np.array([[3, 4, 5]]))
        for d in (cpu, gpu):
            d.cache.commit(1)
    captures = [s for kind, s in standin.log if kind == "capture"]
    assert sorted(captures) == [1, 3, 5]  # once per S, never again: the lengths come from the parameter block
    assert gpu.captures == 3 and gpu.launches == 13 and gpu.enqueues == 0


def test_a_call_with_more_rows_reallocates_the_scratch_and_drops_the_graphs(folders, standin):
    cpu, gpu = _pair(folders["llama"])
    assert gpu._io.rows == MIN_ROWS_S
    _same_call(cpu, gpu, np.array([[5]]))
    for d in (cpu, gpu):
        d.cache.commit(1)
    _same_call(cpu, gpu, np.arange(MIN_ROWS_S + 3)[None] % 90)  # more rows than the scratch holds
    assert gpu._io.rows == MIN_ROWS_S + 3 and gpu.graphs.keys() == {MIN_ROWS_S + 3}
    for d in (cpu, gpu):
        d.cache.commit(2)
    _same_call(cpu, gpu, np.array([[9]]))  # S = 1 again: captured anew over the new scratch
    assert [s for kind, s in standin.log if kind == "capture"] == [1, MIN_ROWS_S + 3, 1]


def test_a_stale_graph_is_caught_by_the_standin(folders, standin):
    """The stand-in's own check: a graph replayed over freed scratch fails (the test above relies on it)."""
    gpu = open_engine(folders["llama"], "cuda-native").decoder()
    gpu.ids(np.array([[5]]))
    gpu._drop_graphs = lambda: None  # a decoder that forgets to drop its graphs when the scratch moves
    gpu._alloc(40)
    import gc
    gc.collect()
    with pytest.raises(AssertionError, match="freed"):
        gpu.ids(np.array([[6]]))


def test_calls_longer_than_the_graphs_are_enqueued(folders, standin):
    cpu, gpu = _pair(folders["llama"])
    _same_call(cpu, gpu, (np.arange(GRAPH_MAX_S + 6)[None] * 7) % 96)
    assert gpu.enqueues == 1 and gpu.captures == 0
    for d in (cpu, gpu):
        d.cache.commit(GRAPH_MAX_S + 6)
    _same_call(cpu, gpu, np.array([[1]]))
    assert gpu.captures == 1


def test_a_decoder_without_graphs_enqueues_every_call(folders, standin):
    gpu = CudaNativeEngine(folders["llama"], rt=standin).decoder(graphs=False)
    cpu = open_engine(folders["llama"], "cpu-native").decoder()
    for s in (4, 1, 1):
        _same_call(cpu, gpu, np.arange(s)[None] + 10)
        for d in (cpu, gpu):
            d.cache.commit(s)
    assert gpu.enqueues == 3 and gpu.captures == gpu.launches == 0


@pytest.mark.parametrize("draft", ["model", "ngram", "head"])
def test_speculative_generation_equals_cpu_native_and_plain(folders, standin, draft):
    prompts = ["the cat sat on", "abcabcabc", "x = 1; y ="]
    d = {"model": folders["draft"], "ngram": "ngram", "head": "head"}[draft]
    assert draft_provider("cuda-native", folders["draft"]) == "cuda-native"  # the draft has native weights
    cpu = edgespec.load(folders["llama"], d, provider="cpu-native", gamma=3)
    gpu = edgespec.load(folders["llama"], d, provider="cuda-native", gamma=3)
    plain = edgespec.load(folders["llama"], provider="cpu-native")
    for p in prompts:
        want = plain.generate(p, max_new_tokens=20).token_ids
        assert gpu.generate(p, max_new_tokens=20).token_ids == want
        assert cpu.generate(p, max_new_tokens=20).token_ids == want
    if draft != "head":  # the head drafts one sequence at a time
        batch = gpu.generate(prompts, max_new_tokens=12)
        assert [r.token_ids for r in batch] == [plain.generate(p, max_new_tokens=12).token_ids for p in prompts]
    if draft != "head":  # sampled acceptance (the head drafts for greedy decoding only)
        sampled = gpu.generate(prompts[0], max_new_tokens=12, temperature=0.8, seed=3)
        assert sampled.token_ids == cpu.generate(prompts[0], max_new_tokens=12, temperature=0.8, seed=3).token_ids


def test_a_draft_without_native_weights_runs_on_the_cpu(tmp_path, folders):
    import json
    dst = tmp_path / "draft"
    shutil.copytree(folders["draft"], dst)
    m = json.loads((dst / "engine.json").read_text())
    m["extra"]["native"] = {"unavailable": "for the test"}
    (dst / "engine.json").write_text(json.dumps(m))
    assert draft_provider("cuda-native", dst) == "cpu"


def test_scratch_layout_is_aligned_and_disjoint():
    lay = scratch_layout(E=64, H=4, Hkv=2, D=16, I=96, V=96, rows=17, nsplit=2)
    spans = sorted(lay.offsets.values())
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a % cuda_native.ALIGN == 0 and a + n <= b
    assert spans[-1][0] + spans[-1][1] <= lay.nbytes
    assert lay.offsets["part"][1] == 17 * 4 * 2 * (16 + 2) * 4
    assert lay.offsets["params"][1] >= (1 + 17) * 8  # start (B) + ids (B S) for any B <= rows
    assert [splits_for(c) for c in (1, 128, 129, 4096, 10 ** 6)] == [1, 1, 2, 32, 32]


def test_what_cuda_native_cannot_run_is_refused_by_name(folders, standin, tmp_path):
    gpu = open_engine(folders["llama"], "cuda-native").decoder()
    with pytest.raises(ValueError, match="embeds"):
        gpu.run(None, embeds=np.zeros((1, 1, 64), np.float32))
    with pytest.raises(ValueError, match="0..95"):
        gpu.ids(np.array([[96]]))
    with pytest.raises(ValueError, match="max context is 256"):
        gpu.ids(np.zeros((1, 257), np.int64))


def test_a_vocabulary_off_the_panels_equals_cpu_native(standin, tmp_path):
    """101 ids: the lm_head padded to 112 rows; the logits handed out are the vocabulary's columns, bit for bit
    cpu-native's, through accepts and rewinds, and a speculative run equals plain."""
    from edgespec.export.onnx_export import export_engine
    make_f16_model(transformers.LlamaConfig(**{**SIZES, "vocab_size": 101, "eos_token_id": 100}), tmp_path / "ck", 40)
    export_engine(tmp_path / "ck", tmp_path / "odd", max_context=64, progress=False)
    cpu, gpu = _pair(tmp_path / "odd")
    assert gpu.engine.head_rows == 112
    assert gpu.layout.offsets["logits"][1] == gpu.layout.rows * 112 * 4  # the step writes every padded row
    _same_call(cpu, gpu, np.array([[5, 17, 3, 60, 42]]))
    assert gpu.last_logits().shape == (1, 5, 101)
    for d in (cpu, gpu):
        d.cache.commit(3)
    _same_call(cpu, gpu, np.array([[7, 100]]))
    plain = edgespec.load(tmp_path / "odd", provider="cuda-native")
    spec = edgespec.load(tmp_path / "odd", draft="ngram", gamma=3, provider="cuda-native")
    want = edgespec.load(tmp_path / "odd", provider="cpu-native").generate([5, 17, 3, 5, 17], max_new_tokens=20)
    assert plain.generate([5, 17, 3, 5, 17], max_new_tokens=20).token_ids == want.token_ids
    assert spec.generate([5, 17, 3, 5, 17], max_new_tokens=20).token_ids == want.token_ids


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_weights_upload_as_blocks_and_equal_cpu_native(folders, standin, tmp_path, kind):
    """native.npz's int8 / int4 blocks uploaded as they are (the stand-in runs them through native_step.c)."""
    q = tmp_path / kind
    shutil.copytree(folders["llama"], q)
    from edgespec.export.native import main as add_native
    add_native([str(q), "--checkpoint", str(folders["llama"].parent / "ck-llama"), "--weights", kind,
                "--allow-lossy"])
    gpu = open_engine(q, "cuda-native")
    assert gpu.weights["layers.0.wqkv"].dtype == np.uint8
    cpu, dec = open_engine(q, "cpu-native").decoder(), gpu.decoder()
    _same_call(cpu, dec, np.arange(9)[None] + 3)
    for d in (cpu, dec):
        d.cache.commit(9)
    _same_call(cpu, dec, np.array([[7]]))


def test_no_nvcc_is_a_clear_error(folders, monkeypatch):
    monkeypatch.setattr(cuda_lib, "nvcc", lambda: None)
    monkeypatch.setattr(cuda_native, "_RUNTIMES", {})
    with pytest.raises(EngineError, match="found no nvcc: install the CUDA toolkit"):
        open_engine(folders["llama"], "cuda-native")


@pytest.mark.skipif(cuda_lib.nvcc() is None, reason="no nvcc on this machine (CUDA toolkit)")
def test_no_gpu_is_a_clear_error(folders, monkeypatch, tmp_path):
    """Built (for the default architecture: nvcc finds no GPU to ask), loaded, and the device refused by name."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda_native, "_RUNTIMES", {})
    try:
        cuda_lib.CudaRuntime()
    except EngineError as e:
        assert "provider 'cuda-native' needs an NVIDIA GPU and its driver: cudaGetDeviceCount" in str(e)
    else:
        pytest.skip("this machine has a GPU")


# ---- the CUDA source itself ----

@pytest.mark.skipif(cuda_lib.nvcc() is None, reason="no nvcc on this machine (CUDA toolkit): the .cu compile is "
                                                    "checked where one is")
@pytest.mark.parametrize("arch", cuda_lib.ARCHS)
def test_cuda_step_compiles_for_the_edge_and_server_gpus(arch, tmp_path, monkeypatch):
    known = cuda_lib.nvcc_archs(cuda_lib.nvcc())
    if arch not in known:
        pytest.skip(f"this nvcc does not know sm_{arch} (it knows {known})")
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    path = cuda_lib.build_library(arch)
    assert path.is_file() and f"sm_{arch}" in path.name
    if shutil.which("cuobjdump"):
        listed = subprocess.run(["cuobjdump", "--list-elf", str(path)], capture_output=True, text=True).stdout
        assert f"sm_{arch}" in listed
    assert cuda_lib.build_library(arch) == path  # cached: the second build is the same file


def test_the_architecture_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("EDGESPEC_CUDA_ARCH", "sm_87")
    assert cuda_lib.gpu_arch() == "87"
    monkeypatch.setenv("EDGESPEC_CUDA_ARCH", "9.0")
    assert cuda_lib.gpu_arch() == "90"
    monkeypatch.setenv("EDGESPEC_CUDA_ARCH", "orin")
    with pytest.raises(EngineError, match="like 90 or sm_87"):
        cuda_lib.gpu_arch()
    assert "-arch=native" in cuda_lib.build_command("nvcc", "native", "x.so")


# ---- on a GPU ----

def _gpu_or_skip():
    try:
        return cuda_lib.CudaRuntime()
    except EngineError as e:
        pytest.skip(f"needs an NVIDIA GPU and nvcc: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2"])
def test_on_a_gpu_the_kernels_match_cpu_native(folders, name, monkeypatch):
    rt = _gpu_or_skip()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)
    cpu, gpu = _pair(folders[name])
    rng = np.random.default_rng(2)
    for s in (13, 1, 1, 4, 1, 9, 1):
        t = rng.integers(0, 96, (1, s))
        a, b = cpu(t), gpu(t)
        scale = max(1.0, float(np.abs(a).max()))
        assert np.abs(a - b).max() <= 1e-4 * scale, (s, np.abs(a - b).max())
        # ids equal, except where the CPU's best two logits are within the two steps' rounding of each other
        top2 = np.sort(a[0], axis=-1)[:, -2:]
        near_tie = (top2[:, 1] - top2[:, 0]) <= 2e-4 * scale
        assert ((cpu.last_ids()[0] == gpu.last_ids()[0]) | near_tie).all()
        for d in (cpu, gpu):
            d.cache.commit(s)


@pytest.mark.gpu
def test_on_a_gpu_speculative_equals_plain(folders, monkeypatch):
    rt = _gpu_or_skip()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)
    spec = edgespec.load(folders["llama"], folders["draft"], provider="cuda-native", gamma=4)
    plain = edgespec.load(folders["llama"], provider="cuda-native")
    for p in ("the cat sat on", "abcabcabc"):
        assert spec.generate(p, max_new_tokens=24).token_ids == plain.generate(p, max_new_tokens=24).token_ids


def test_the_draft_may_run_on_the_cpu_beside_a_gpu_target(folders, standin):
    from edgespec.backends.native import NativeEngine
    gen = edgespec.load(folders["llama"], folders["draft"], provider="cuda-native", gamma=3,
                        draft_provider="cpu-native")
    assert isinstance(gen.draft, NativeEngine) and isinstance(gen.target, CudaNativeEngine)
    plain = edgespec.load(folders["llama"], provider="cpu-native")
    assert gen.generate("the cat sat on", max_new_tokens=16).token_ids == \
        plain.generate("the cat sat on", max_new_tokens=16).token_ids


def test_the_cli_takes_the_drafts_provider(folders, standin, capsys):
    from edgespec.cli import main
    rc = main(["generate", "--target", str(folders["llama"]), "--draft", str(folders["draft"]), "--prompt", "ab",
               "--max-new-tokens", "4", "--provider", "cuda-native", "--draft-provider", "cpu-native", "--json"])
    assert rc == 0 and '"token_ids"' in capsys.readouterr().out

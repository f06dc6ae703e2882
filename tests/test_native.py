"""Provider cpu-native (edgespec/backends/native.py, native_step.c) against the ONNX Runtime engine of the same folder."""
from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest

from conftest import char_tokenizer_json, set_eos

import edgespec
from edgespec.contract import EngineError, Manifest
from edgespec.backends.ort import OrtEngine
from edgespec.backends import open_engine

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("provider cpu-native compiles its step with a C compiler; none here (apt-get install gcc)",
                allow_module_level=True)


def _f16_checkpoint(path, seed, heads=4, kv_heads=2, hidden=128):
    """A small llama whose weights are float16 values (as the bundled checkpoints'), a char tokenizer, EOS 95.
    Sized so that native_step.c's kernels all run: 16 panels of logits (8 at a time for one or two rows, 4
    for three to five), 20 of gate/up (a remainder), a head_dim of 32 (the attention's register path)."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=512)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.normal_(0, 0.2).half().float())
    model.save_pretrained(path, safe_serialization=True)
    char_tokenizer_json(path / "tokenizer.json")
    set_eos(path, 95)


@pytest.fixture(scope="module")
def native_engines(tmp_path_factory):
    from conftest import _noisy_copy

    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("native")
    _f16_checkpoint(root / "ck-target", 21)
    _noisy_copy(root / "ck-target", root / "ck-draft", 0.05, seed=4)  # not float16 values: no native weights
    char_tokenizer_json(root / "ck-draft" / "tokenizer.json")
    for name in ("target", "draft"):
        export_engine(root / f"ck-{name}", root / name, max_context=256, progress=False)
    return root / "target", root / "draft"


def _run_both(target, chunks, march=None, monkeypatch=None):
    if march:
        monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", march)
    ref, nat = OrtEngine(target).decoder(), open_engine(target, "cpu-native").decoder()
    for chunk in chunks:
        a, b = np.array(ref(chunk)), np.array(nat(chunk))
        ref.cache.commit(chunk.shape[1])
        nat.cache.commit(chunk.shape[1])
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
        assert (nat.last_ids() == ref.last_ids()).all()
    return ref, nat


def test_export_writes_native_weights_that_pass_their_gate(native_engines, capsys):
    from edgespec.cli import main
    target, draft = native_engines
    info = Manifest.read(target).extra["native"]
    assert info["file"] == "native.npz" and info["gate"]["passed"] and info["gate"]["ids_agree"] == info["gate"]["ids"]
    assert "not exactly float16" in Manifest.read(draft).extra["native"]["unavailable"]
    with pytest.raises(EngineError, match="no native weights.*not exactly float16"):
        open_engine(draft, "cpu-native")
    assert main(["inspect", str(target)]) == 0 and main(["inspect", str(draft)]) == 0
    out = capsys.readouterr().out
    assert "providers cpu-native and cuda-native: native.npz, float16 weights and float32 math" in out and "ids 64/64" in out
    assert "providers cpu-native and cuda-native: not available (model.embed_tokens.weight:" in out


@pytest.mark.parametrize("march", [None, "haswell", "x86-64"])  # this CPU; AVX2 without AVX-512; portable C
def test_native_calls_match_onnx_runtime_across_a_regrowth(native_engines, march, monkeypatch):
    if march and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={march} is an x86 target; this machine is {platform.machine()}")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 96, (1, 200))
    chunks = [toks[:, :60]] + [toks[:, i:i + 1] for i in range(60, 66)] + [toks[:, 66:68], toks[:, 68:72],
                                                                             toks[:, 72:79], toks[:, 79:200]]
    ref, nat = _run_both(native_engines[0], chunks, march, monkeypatch)
    assert nat.cache.capacity >= 200 and nat.cache.generation >= 1  # grew past its first 128 rows
    for a, b in zip(ref.cache.rows(0), nat.cache.rows(0)):  # the committed K/V rows agree too
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,hidden", [(8, 2, 256), (6, 2, 192), (16, 2, 256), (14, 2, 224), (10, 2, 160)])
def test_grouped_attention_changes_no_bit(tmp_path, heads, kv_heads, hidden, monkeypatch):
    """Attention chunks take 4, 2 or 1 query heads of one kv head together (native_step.c's attn_group: 4 for 4
    and 8 heads per kv head, 1 for 3): every call's logits equal, bit for bit, those of the build with one head
    per chunk (-DES_ATTN_GROUP=1), and ONNX Runtime's within the tolerance. head_dim 32 or 16: the register
    path and the column tail."""
    from edgespec.export.onnx_export import export_engine
    _f16_checkpoint(tmp_path / "ck", 5, heads, kv_heads, hidden)
    export_engine(tmp_path / "ck", tmp_path / "e", max_context=256, progress=False)
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 96, (1, 60))
    chunks = [toks[:, :37]] + [toks[:, i:i + 1] for i in range(37, 42)] + [toks[:, 42:48], toks[:, 48:60]]
    ref, grouped = _run_both(tmp_path / "e", chunks)
    monkeypatch.setenv("EDGESPEC_NATIVE_CFLAGS", "-DES_ATTN_GROUP=1")
    one = open_engine(tmp_path / "e", "cpu-native").decoder()
    grouped.cache.rewind_to(0)
    for chunk in chunks:
        a, b = np.array(grouped(chunk)), np.array(one(chunk))
        grouped.cache.commit(chunk.shape[1])
        one.cache.commit(chunk.shape[1])
        assert np.array_equal(a, b)


def _native_twins(target, prompt, chunk=16):
    """Two native decoders of one engine with `prompt` prefilled, caches growing by `chunk` rows (regrowth inside
    a run of steps) -> (a, b, the first new id)."""
    from edgespec.kvcache import KVCache
    eng = open_engine(target, "cpu-native")
    m = eng.manifest
    twins = []
    for _ in range(2):
        d = eng.decoder()
        d.cache = KVCache(m.num_layers, 1, m.num_kv_heads, m.head_dim, m.max_context, "float32", d.memory,
                          chunk=chunk)
        first = int(d.ids(np.array([prompt]))[0, -1])
        d.cache.commit(len(prompt))
        twins.append(d)
    return twins[0], twins[1], first


def _same_native_cache(a, b):
    assert a.cache.lengths.tolist() == b.cache.lengths.tolist()
    n = int(a.cache.lengths[0])
    for ra, rb in zip(a.cache.buffers, b.cache.buffers):
        assert np.array_equal(ra.handle[:, :, :n], rb.handle[:, :, :n])


def test_native_plain_steps_equal_the_reference_call_by_call(native_engines):
    """NativeDecoder.greedy_steps (es_forward back to back, lengths committed at the end) against
    greedy_steps_reference (ids() and commit() per call): the same ids, the same committed rows and last
    logits, bit for bit, also when the caller stops early and goes on, and across cache regrowths."""
    from conftest import plain_steps_like_reference

    def same(a, b):
        _same_native_cache(a, b)
        assert np.array_equal(a.last_logits(), b.last_logits())
        assert a.last_start.tolist() == b.last_start.tolist()

    a, b, first = _native_twins(native_engines[0], [5, 17, 3, 60, 42, 9, 11, 2, 8])
    plain_steps_like_reference(a, b, first, same)
    assert a.cache.generation > 1
    v = a.m.vocab_size
    with pytest.raises(ValueError, match=f"token ids must be in 0..{v - 1}, got {v}..{v}"):
        next(a.greedy_steps(v, 3))
    with pytest.raises(ValueError, match="one sequence; this decoder runs batches of 2"):
        next(a.engine.decoder(2).greedy_steps(1, 3))


def test_native_plain_steps_stop_at_nan_with_the_row_zeroed(native_engines):
    """The 3rd call of a run of steps gives NaN logits: FloatingPointError naming the step, the two good rows
    committed, the failed row zeroed, and the next steps equal to a decoder that never saw the NaN."""
    from edgespec import contract as C
    a, b, first = _native_twins(native_engines[0], [1, 2, 3, 4, 5])
    real, calls = a._forward, []

    def poison_third(bb, s, ids, x_in, start, out):
        t = real(bb, s, ids, x_in, start, out)
        calls.append(int(start[0]))
        if len(calls) == 3:
            for buf in a.cache.buffers:
                buf.handle[0, :, int(start[0])] = np.nan
            out.ids.handle[...] = C.NONFINITE_ID
        return t

    a._forward = poison_third
    got = []
    with pytest.raises(FloatingPointError, match="target engine produced NaN/inf logits at step 8"):
        for tok in a.greedy_steps(first, 10):
            got.append(tok)
    del a._forward
    want = list(b.greedy_steps_reference(first, 2))
    assert got == want and a.cache.lengths.tolist() == [7] and calls == [5, 6, 7]
    assert all(np.isfinite(buf.handle).all() for buf in a.cache.buffers)
    _same_native_cache(a, b)
    assert list(a.greedy_steps(want[-1], 6)) == list(b.greedy_steps_reference(want[-1], 6))


def test_native_plain_generation_equals_the_generic_round(native_engines):
    """Plain greedy generation on cpu-native runs greedy_steps; Generator.lean = False the generic round: the
    same tokens and finish reasons."""
    lean = edgespec.load(native_engines[0], provider="cpu-native")
    generic = edgespec.load(native_engines[0], provider="cpu-native")
    generic.lean = False
    for p in ([1, 2, 3], list(range(30, 52)), [9] * 40):
        for kw in (dict(max_new_tokens=40), dict(max_new_tokens=30, stop=["A", "B"]), dict(max_new_tokens=1)):
            x, y = lean.generate(p, **kw), generic.generate(p, **kw)
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            assert x.stats.target_calls == y.stats.target_calls


def test_a_row_does_not_depend_on_the_calls_s(native_engines):
    """Verify (S = k+1) and plain steps (S = 1) compute each row bit for bit alike (S = 17: a group of 12 rows
    and one of 5)."""
    d = open_engine(native_engines[0], "cpu-native").decoder()
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


def test_a_batch_with_padding_matches_onnx_runtime_on_its_real_rows(native_engines):
    ref, nat = (open_engine(native_engines[0], p).decoder(batch=2) for p in ("cpu", "cpu-native"))
    rng = np.random.default_rng(3)
    for d in (ref, nat):
        d.ids(rng.integers(0, 96, (2, 12)) * 0 + np.arange(12) % 96)
        d.cache.commit(np.array([12, 9]))  # the sequences now differ in length
    feed = rng.integers(0, 96, (2, 5))
    feed[1, 3:] = -7  # padding: never a real token
    valid = np.array([[True] * 5, [True, True, True, False, False]])
    a, b = np.array(ref(feed, valid)), np.array(nat(feed, valid))
    np.testing.assert_allclose(b[0], a[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(b[1, :3], a[1, :3], atol=1e-4, rtol=0)
    assert (nat.last_ids()[valid] == ref.last_ids()[valid]).all()
    with pytest.raises(ValueError, match="token ids must be in 0..255"):
        nat(feed)  # the same ids, all marked real


def test_stale_rows_never_reach_the_output(native_engines):
    d = open_engine(native_engines[0], "cpu-native").decoder()
    toks = np.random.default_rng(2).integers(0, 96, (1, 20))
    d(toks[:, :10])
    d.cache.commit(10)
    clean = np.array(d(toks[:, 10:20]))
    d.cache.rewind_to(10)
    for j in range(len(d.cache.buffers)):
        d.cache.host(j)[0, :, 10:] = np.nan  # rejected drafts' rows, gone bad
    np.testing.assert_array_equal(np.array(d(toks[:, 10:20])), clean)


def test_nonfinite_logits_give_no_id_and_their_rows_are_zeroed(native_engines, tmp_path):
    import shutil
    shutil.copytree(native_engines[0], tmp_path / "e")  # its own weights: loads of one file share theirs
    d = open_engine(tmp_path / "e", "cpu-native").decoder()
    d.ids(np.array([[1, 2, 3]]))
    d.cache.commit(3)
    w = d.engine.arrays["layers.1.ln1"]  # the weights the C step reads
    w.flags.writeable = True
    w[:] = np.inf
    ids = d.ids(np.array([[4, 5]]))
    assert (ids == -1).all()
    for j in range(len(d.cache.buffers)):
        assert np.all(d.cache.host(j)[0, :, 3:5] == 0)  # scrubbed: no later call reads inf


def test_generation_on_cpu_native_is_identical_to_cpu(native_engines):
    target, draft = native_engines
    prompts = ["def f(x):\n", "hello world", "abc" * 20]
    plain = edgespec.load(target, provider="cpu")
    nat = edgespec.load(target, provider="cpu-native")
    spec = edgespec.load(target, draft=draft, provider="cpu-native", gamma=4)  # the draft runs on cpu
    assert spec.draft.provider == "cpu" and spec.target.provider == "cpu-native"
    for p in prompts:
        want = plain.generate(p, max_new_tokens=40).token_ids
        assert nat.generate(p, max_new_tokens=40).token_ids == want
        assert spec.generate(p, max_new_tokens=40).token_ids == want


def test_adding_native_weights_to_a_folder_checks_the_checkpoint(native_engines, tmp_path, capsys):
    from edgespec.export.native import main
    target, _ = native_engines
    folder = tmp_path / "t"
    shutil.copytree(target, folder)
    (folder / "native.npz").unlink()
    m = Manifest.read(folder)
    del m.extra["native"]
    m.write(folder)
    assert main([str(folder), "--checkpoint", str(target.parent / "ck-draft")]) == 2
    assert "exported from another checkpoint" in capsys.readouterr().err
    assert main([str(folder), "--checkpoint", str(target.parent / "ck-target")]) == 0
    assert Manifest.read(folder).extra["native"]["gate"]["passed"] and (folder / "native.npz").is_file()


def test_folder_problems_are_clear_errors(native_engines, tmp_path, monkeypatch):
    target, _ = native_engines
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    with np.load(bad / "native.npz") as z:
        arrays = dict(z)
    arrays["layers.0.wo"] = arrays["layers.0.wo"][:1]  # one panel of eight
    np.savez(bad / "native.npz", **arrays)
    with pytest.raises(EngineError, match="sha256 differs"):
        open_engine(bad, "cpu-native")
    m = Manifest.read(bad)
    m.extra["native"]["sha256"] = None
    m.write(bad)
    with pytest.raises(EngineError, match=r"layers.0.wo: expected \(8, 128, 16\), got \(1, 128, 16\)"):
        open_engine(bad, "cpu-native")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(EngineError, match="no C compiler.*provider 'cpu'"):
        open_engine(target, "cpu-native")


def test_a_folder_with_format_1_native_weights_still_loads(native_engines, tmp_path):
    """native.npz as exported before the families (one rotary over all dims, scalars = eps and its scaling,
    no per-layer tables, no format in engine.json): read as format 2, the same logits."""
    target, _ = native_engines
    old = tmp_path / "old"
    shutil.copytree(target, old)
    with np.load(old / "native.npz") as z:
        arrays = dict(z)
    assert arrays["layer_window"].tolist() == [0, 0] and arrays["layer_rope"].tolist() == [0, 0]
    arrays["scalars"] = np.array([arrays["scalars"][0], arrays["rope_scale"][0]], np.float32)
    arrays["inv_freq"] = arrays["inv_freq"][0]
    for k in ("rope_scale", "layer_rope", "layer_window"):
        del arrays[k]
    np.savez(old / "native.npz", **arrays)
    m = Manifest.read(old)
    for k in ("format", "features", "rotary_dim", "ropes", "activation"):
        del m.extra["native"][k]
    m.extra["native"]["sha256"] = None
    m.write(old)
    toks = np.random.default_rng(4).integers(0, 96, (1, 30))
    new, fmt1 = (open_engine(f, "cpu-native").decoder() for f in (target, old))
    assert np.array_equal(np.array(new(toks)), np.array(fmt1(toks)))


def test_two_loads_of_one_folder_share_its_weights_until_both_are_gone(native_engines, tmp_path):
    """A second load of the same native.npz (another draft mode of one policy) reads no second copy: its arrays
    are the first load's, read-only; a copy of the folder elsewhere gets its own; and once no engine holds them,
    the next load reads the file again (the sharing pins nothing)."""
    import gc
    import shutil
    a, b = (open_engine(native_engines[0], "cpu-native") for _ in range(2))
    key = "layers.0.wq" if "layers.0.wq" in a.arrays else next(iter(a.arrays))
    assert a.arrays[key].ctypes.data == b.arrays[key].ctypes.data
    assert not a.arrays[key].flags.writeable
    shutil.copytree(native_engines[0], tmp_path / "copy")
    c = open_engine(tmp_path / "copy", "cpu-native")
    assert c.arrays[key].ctypes.data != a.arrays[key].ctypes.data
    ids = np.array([[1, 2, 3, 4]])
    assert np.array_equal(a.decoder().ids(ids), b.decoder().ids(ids))
    from edgespec.backends import native_folder
    n = len(native_folder._SHARED)
    del a, b
    gc.collect()
    assert len(native_folder._SHARED) == n - 1  # c's entry stays while c lives

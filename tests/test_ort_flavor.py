"""The `ort` flavour (export/graph.py: GroupQueryAttention with the cache in place, skip + simplified layer
norm) against the portable graph and the torch reference: same greedy ids, speculative = plain, mixed-length
batches, rollback, NaN scrubbing, the per-op fallback (a head size GroupQueryAttention's CPU kernel refuses)."""
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

import edgespec
from edgespec import contract as C
from edgespec.contract import EngineError
from edgespec.backends.ort import OrtDecoder
from edgespec.backends.ort import OrtEngine
from edgespec.backends import open_engine
from edgespec.kvcache import KVCache
from edgespec.export.onnx_export import export_engine
from edgespec.export.reference import ReferenceDecoder

from tests.conftest import _noisy_copy, assert_a_failed_call_is_scrubbed, char_tokenizer_json, random_text_head

H16 = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)  # head_dim 16: GroupQueryAttention runs it
H8 = dict(H16, hidden_size=32, intermediate_size=48)  # head_dim 8: the CPU kernel refuses it (fallback)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**H16, tie_word_embeddings=False, eos_token_id=95),
    "qwen2": lambda: transformers.Qwen2Config(**H16, tie_word_embeddings=True),  # q/k/v biases
    "mistral-window": lambda: transformers.MistralConfig(**H16, sliding_window=8),
    "llama-d8": lambda: transformers.LlamaConfig(**H8),
}
CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}


def _checkpoint(name, path, seed):
    cfg = CONFIGS[name]()
    torch.manual_seed(seed)
    model = CLASSES[cfg.model_type](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        if getattr(cfg, "tie_word_embeddings", False):
            model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    char_tokenizer_json(path / "tokenizer.json")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(checkpoint or engine name, flavour) -> folder; 'noisy' is a draft for the llama target."""
    root = tmp_path_factory.mktemp("ort_flavor")
    out = {}
    for i, name in enumerate(CONFIGS):
        _checkpoint(name, root / "ck" / name, seed=20 + i)
        out[name, "ckpt"] = root / "ck" / name
    _noisy_copy(root / "ck" / "llama", root / "ck" / "noisy", 0.05, seed=3)
    char_tokenizer_json(root / "ck" / "noisy" / "tokenizer.json")
    for name in list(CONFIGS) + ["noisy"]:
        for flavor in ("ort", "portable"):
            out[name, flavor] = root / f"{name}-{flavor}"
            export_engine(root / "ck" / name, out[name, flavor], max_context=96, flavor=flavor, progress=False)
    return out


def test_manifest_records_the_flavour_and_the_fallback(engines):
    fused = C.Manifest.read(engines["llama", "ort"])
    assert fused.flavor == "ort" and fused.fusion == {"attention": "fused", "rotary": "fused", "norm": "fused"}
    assert [t.name for t in fused.inputs[:4]] == [C.INPUT_IDS, C.SEQLENS_K, C.QUERY_SEQLENS, C.TOTAL_SEQUENCE_LENGTH]
    fallback = C.Manifest.read(engines["llama-d8", "ort"])
    assert fallback.flavor == "ort" and fallback.fusion["norm"] == "fused"
    assert fallback.fusion["attention"].startswith("standard ops") and "multiple of 16" in fallback.fusion["attention"]
    assert C.Manifest.read(engines["llama", "portable"]).flavor == "portable"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_greedy_ids_equal_the_torch_reference(engines, name, flavor):
    """A prefill, then single steps and a 3-token step: the ids each call returns are the reference's argmax."""
    ref = ReferenceDecoder.from_pretrained(engines[name, "ckpt"])
    dec = OrtEngine(engines[name, flavor]).decoder()
    ids = [5, 17, 3, 60, 42, 9, 11]
    got = list(dec.ids(np.array([ids]))[0])
    dec.cache.commit(len(ids))
    seq = list(ids)
    for step in range(14):
        s = 3 if step % 4 == 3 else 1  # a verify-sized call now and then: causal inside the new tokens
        new = [(seq[-1] * 7 + j * 13 + step) % 96 for j in range(s)]
        got += list(dec.ids(np.array([new]))[0])
        dec.cache.commit(s)
        seq += new
    want = ref(torch.tensor([seq])).numpy()[0, :len(seq)].argmax(-1)  # (T,)
    assert got == list(want)  # a window of 8 is crossed by the mistral-window engine


@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_speculative_with_an_ort_pair_equals_plain(engines, gamma):
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1], [50, 7], list(range(30, 52))]
    plain_portable = edgespec.load(engines["llama", "portable"])
    want = [plain_portable.generate(p, max_new_tokens=30).token_ids for p in prompts]
    assert [edgespec.load(engines["llama", "ort"]).generate(p, max_new_tokens=30).token_ids for p in prompts] == want
    for draft in (engines["noisy", "ort"], engines["llama", "ort"], "ngram"):
        gen = edgespec.load(engines["llama", "ort"], draft=draft, gamma=gamma)
        assert [gen.generate(p, max_new_tokens=30).token_ids for p in prompts] == want, draft
        assert [o.token_ids for o in gen.generate(prompts, max_new_tokens=30)] == want, draft  # one mixed batch


@pytest.mark.parametrize("name", ["llama", "llama-d8"])
def test_batch_of_mixed_lengths_equals_each_sequence_alone(engines, name):
    eng = OrtEngine(engines[name, "ort"])
    batch = OrtDecoder(eng, 2)
    rng = np.random.default_rng(0)
    ctx = [list(rng.integers(0, 95, 4)), list(rng.integers(0, 95, 9))]
    for s, counts in ((9, [4, 9]), (3, [1, 3]), (1, [1, 1]), (4, [2, 4]), (4, [4, 1])):
        feed = np.zeros((2, s), np.int64)
        valid = np.arange(s)[None] < np.array(counts)[:, None]
        for b in range(2):
            if s != 9:
                ctx[b] = ctx[b] + list(rng.integers(0, 95, counts[b]))
            feed[b, :counts[b]] = ctx[b][len(ctx[b]) - counts[b]:]
        logits = batch(feed, valid).copy()
        batch.cache.commit(counts)
        for b in range(2):
            alone = OrtDecoder(eng, 1)
            want = alone(np.array([ctx[b]]))[0, -counts[b]:]
            np.testing.assert_allclose(logits[b, :counts[b]], want, atol=1e-4)
            for got_rows, want_rows in zip(batch.cache.rows(b), alone.cache.rows(0, len(ctx[b]))):
                np.testing.assert_allclose(got_rows, want_rows, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "mistral-window", "llama-d8"])
def test_rollback_then_continue_equals_a_fresh_prefill(engines, name):
    """Write 5 rows, keep 2 (the rest stay in the buffer, stale), continue: as if the 3 were never fed."""
    eng = OrtEngine(engines[name, "ort"])
    d = OrtDecoder(eng, 1)
    d(np.array([[3, 1, 4, 1, 5, 9, 2, 6]]))
    d.cache.commit(8)
    d(np.array([[5, 3, 5, 8, 9]]))
    d.cache.commit(2)  # rows 10..12 are stale now
    got = d(np.array([[7, 7, 1]])).copy()
    d.cache.commit(3)
    d.cache.rewind_to(11)  # and rewinding below a committed row
    again = d(np.array([[2]])).copy()
    fresh = OrtDecoder(eng, 1)
    want = fresh(np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 7, 7, 1]]))
    np.testing.assert_allclose(got[0], want[0, 10:13], atol=1e-4)
    want2 = OrtDecoder(eng, 1)(np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 7, 2]]))
    np.testing.assert_allclose(again[0, 0], want2[0, 11], atol=1e-4)


def test_a_failed_call_is_scrubbed_on_an_ort_embeds_engine(engines, tmp_path):
    m = export_engine(engines["llama", "ckpt"], tmp_path / "emb", input_mode="embeds", max_context=64,
                      flavor="ort", progress=False)
    assert m.flavor == "ort" and m.fusion["attention"] == "fused"
    _, clean = assert_a_failed_call_is_scrubbed(tmp_path / "emb", rows=5)
    ids_engine = OrtDecoder(OrtEngine(engines["llama", "ort"]), 1)  # embeds and ids engines agree (7, 8 not kept)
    np.testing.assert_allclose(clean(np.array([[9]])), ids_engine(np.array([[1, 2, 3, 9]]))[:, -1:], atol=1e-4)


def test_auto_takes_portable_when_attention_cannot_be_fused(engines, tmp_path):
    m = export_engine(engines["llama-d8", "ckpt"], tmp_path / "auto", max_context=32, progress=False)
    assert m.flavor == "portable" and "multiple of 16" in m.fusion["attention"]
    assert export_engine(engines["llama", "ckpt"], tmp_path / "auto16", max_context=32, progress=False).flavor == "ort"
    emb = export_engine(engines["llama", "ckpt"], tmp_path / "emb", input_mode="embeds", max_context=32, progress=False)
    assert emb.flavor == "ort"  # inputs_embeds engines (VLA policy decoders) too


def test_padding_must_be_on_the_right_for_ort_engines(engines):
    d = OrtEngine(engines["llama", "ort"]).decoder(2)
    with pytest.raises(ValueError, match="right padding"):
        d(np.zeros((2, 3), np.int64), np.array([[True, False, True], [True, True, True]]))


def test_tensorrt_refuses_an_ort_engine_and_says_what_to_export(engines):
    for provider in ("tensorrt-native", "tensorrt-ep"):
        with pytest.raises(EngineError, match="--flavor portable"):
            open_engine(engines["llama", "ort"], provider)
    from edgespec.export.tensorrt import build_engine
    with pytest.raises(ValueError, match="TensorRT builds the portable graph: re-export with .*--flavor portable"):
        build_engine(engines["llama", "ort"], [])  # refused before TensorRT is even needed


def test_a_folder_from_before_flavours_loads_as_portable(engines, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(engines["llama", "portable"], old)
    data = json.loads((old / C.MANIFEST_FILE).read_text())
    del data["flavor"], data["fusion"]
    (old / C.MANIFEST_FILE).write_text(json.dumps(data))
    gen = edgespec.load(old)
    assert gen.target.manifest.flavor == "portable"
    want = edgespec.load(engines["llama", "portable"]).generate([1, 2, 3], max_new_tokens=8).token_ids
    assert gen.generate([1, 2, 3], max_new_tokens=8).token_ids == want


def test_inspect_shows_the_flavour_and_each_fallback(engines, capsys):
    from edgespec.cli import main
    assert main(["inspect", str(engines["llama-d8", "ort"])]) == 0
    out = capsys.readouterr().out
    assert "flavor ort" in out and "attention: standard ops: ONNX Runtime" in out and "norm: fused" in out
    assert "in  seqlens_k" in out and "OK" in out


@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_hidden_output_is_the_reference_final_hidden_state(engines, tmp_path, flavor):
    """--hidden adds the final hidden state (the LM head's input); hidden_at reads the row of the last call
    that emitted the next token, also after a verify call on top of a cache."""
    out = export_engine(engines["llama", "ckpt"], tmp_path / "h", max_context=96, flavor=flavor, hidden=True,
                        progress=False)
    assert out.has_hidden and not C.Manifest.read(engines["llama", flavor]).has_hidden
    ref = ReferenceDecoder.from_pretrained(engines["llama", "ckpt"])
    ids = [5, 17, 3, 60, 22, 9, 41]
    want = ref.hidden(torch.tensor([ids]))[0].numpy()  # (T, E)
    d = OrtEngine(tmp_path / "h").decoder(1)
    d.ids(np.array([ids[:4]]))
    d.cache.commit(4)
    for pos in range(4):
        np.testing.assert_allclose(d.hidden_at(0, pos), want[pos], atol=1e-4)
    d.ids(np.array([ids[4:]]))  # a verify-shaped call: rows 4..6
    for pos in range(4, 7):
        np.testing.assert_allclose(d.hidden_at(0, pos), want[pos], atol=1e-4)
    with pytest.raises(ValueError, match="not a row of the last call"):
        d.hidden_at(0, 3)
    with pytest.raises(EngineError, match="re-export it with .*--hidden"):
        OrtEngine(engines["llama", flavor]).decoder(1).hidden_at(0, 0)


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_text_head_drafts_from_the_engines_hidden_state_and_greedy_output_is_plain(engines, tmp_path, gamma):
    """The head saved beside the checkpoint travels into the --hidden engine folder, where draft="head" finds it."""
    ckpt, eng = tmp_path / "ckpt", tmp_path / "h"
    shutil.copytree(engines["llama", "ckpt"], ckpt)
    spec = json.loads((ckpt / "config.json").read_text())
    random_text_head(spec["hidden_size"], spec["vocab_size"]).save(ckpt / "text_head.npz")
    export_engine(ckpt, tmp_path / "no-hidden", max_context=96, progress=False)
    assert not (tmp_path / "no-hidden" / "text_head.npz").exists()  # only an engine with the hidden output
    export_engine(ckpt, eng, max_context=96, hidden=True, progress=False)
    assert (eng / "text_head.npz").read_bytes() == (ckpt / "text_head.npz").read_bytes()
    plain, head = edgespec.load(eng), edgespec.load(eng, draft="head", gamma=gamma)
    unsure = edgespec.load(eng, draft="head", gamma=gamma, stop_below=0.9)  # a random head is rarely this sure
    drafted, per_round = 0, {}
    for p in ([1, 2, 3], [7, 7, 7, 7, 9], list(range(20, 40))):
        want = plain.generate(p, max_new_tokens=24).token_ids
        for name, gen in (("head", head), ("unsure", unsure)):
            out = gen.generate(p, max_new_tokens=24)
            assert out.token_ids == want
            d, r = per_round.get(name, (0, 0))
            per_round[name] = (d + out.stats.drafted, r + out.stats.rounds)
        drafted = per_round["head"][0]
    assert drafted > 0
    rate = {k: d / r for k, (d, r) in per_round.items()}  # proposals a round
    assert rate["unsure"] < 1.1 and (gamma == "auto" or rate["unsure"] < rate["head"] - 0.5), rate  # auto: γ 0-3
    seen = []
    gen = edgespec.load(eng, draft="head", gamma=3)
    real = gen._drafter

    def spy(batch, target=None):  # the head reads the hidden state of the row that emitted ctx[-1]
        d = real(batch, target)
        inner = d.features

        def features(ctx):
            h = inner(ctx)
            seen.append((list(ctx), h.copy()))
            return h
        d.features = features
        return d
    gen._drafter = spy
    gen.generate([1, 2, 3], max_new_tokens=12)
    assert len(seen) >= 2 and len(seen[0][0]) == 4  # prompt of 3 + the prefill's token
    ref = ReferenceDecoder.from_pretrained(engines["llama", "ckpt"])
    for ctx, h in seen:
        np.testing.assert_allclose(h, ref.hidden(torch.tensor([ctx[:-1]]))[0, -1].numpy(), atol=1e-4)


def test_text_head_needs_a_hidden_output_and_one_greedy_sequence(engines, tmp_path):
    eng = tmp_path / "h"
    m = export_engine(engines["llama", "ckpt"], eng, max_context=96, hidden=True, progress=False)
    random_text_head(m.hidden_size, m.vocab_size).save(tmp_path / "head.npz")
    with pytest.raises(EngineError, match="re-export it with .*--hidden"):
        edgespec.load(engines["llama", "ort"], draft=tmp_path / "head.npz", gamma=2)
    gen = edgespec.load(eng, draft=tmp_path / "head.npz", gamma=2)
    with pytest.raises(ValueError, match="greedy decoding"):
        gen.generate([1, 2, 3], max_new_tokens=4, temperature=0.8)
    with pytest.raises(ValueError, match="one sequence at a time"):
        gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)


def _twins(engine_dir, prompt, chunk=16, in_place=True):
    """Two decoders of one engine with `prompt` prefilled, caches growing by `chunk` rows (regrowth inside a
    run of steps) -> (a, b, the first new id)."""
    eng = OrtEngine(engine_dir)
    m = eng.manifest
    twins = []
    for _ in range(2):
        d = OrtDecoder(eng, 1)
        d.cache = KVCache(m.num_layers, 1, m.num_kv_heads, m.head_dim, m.max_context, chunk=chunk,
                          in_place=in_place)  # before any call: no binding holds the old one
        first = int(d.ids(np.array([prompt]))[0, -1])
        d.cache.commit(len(prompt))
        twins.append(d)
    return twins[0], twins[1], first


def _same_cache(a: OrtDecoder, b: OrtDecoder) -> None:
    assert a.cache.lengths.tolist() == b.cache.lengths.tolist()
    for ra, rb in zip(a.cache.rows(0), b.cache.rows(0)):
        np.testing.assert_allclose(ra, rb, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "mistral-window", "llama-d8"])
@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_plain_steps_equal_the_reference_call_by_call(engines, name, flavor):
    """OrtDecoder.greedy_steps (the calls back to back, lengths committed at the end) against
    greedy_steps_reference (ids() and commit() per call): the same ids, the same committed rows, also when
    the caller stops early and goes on, and across cache regrowths (16-row chunks, 9 + 70 rows)."""
    from conftest import plain_steps_like_reference
    a, b, first = _twins(engines[name, flavor], [5, 17, 3, 60, 42, 9, 11, 2, 8])
    plain_steps_like_reference(a, b, first, _same_cache)
    assert a.cache.capacity == 80


def test_plain_steps_fall_back_where_calls_cannot_repeat_one_binding(engines):
    """A cache that is not written in place (two buffer sets, as ONNX Runtime's TensorRT EP needs) flips
    bindings every call: greedy_steps then runs the reference, with the same ids."""
    a, b, first = _twins(engines["llama", "ort"], [4, 8, 15, 16, 23, 42], in_place=False)
    assert list(a.greedy_steps(first, 20)) == list(b.greedy_steps_reference(first, 20))
    _same_cache(a, b)
    with pytest.raises(ValueError, match="one sequence; this decoder runs batches of 2"):
        next(OrtDecoder(a.engine, 2).greedy_steps(1, 3))


class _PoisonAt:
    """An InferenceSession stand-in whose n-th run_with_iobinding gives what the graph gives for NaN logits:
    NONFINITE_ID and a NaN row in every cache buffer at the row it wrote."""

    def __init__(self, dec: OrtDecoder, n: int):
        self.dec, self.real, self.n, self.calls = dec, dec.engine.session, n, 0

    def run_with_iobinding(self, bind):
        self.real.run_with_iobinding(bind)
        self.calls += 1
        if self.calls == self.n:
            row = int(self.dec.cache.lengths[0]) + self.n - 1  # lengths: committed when the steps end
            for buf in self.dec.cache.buffers:
                buf.handle[0, :, row] = np.nan
            self.dec._bindings[1, 0].ids.handle[...] = C.NONFINITE_ID

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_plain_steps_stop_at_nan_with_the_row_zeroed(engines):
    """The 3rd call of a run of steps gives NaN logits: FloatingPointError naming the step, the two good rows
    committed, the failed row zeroed, and the next steps equal to a decoder that never saw the NaN."""
    a, b, first = _twins(engines["llama", "ort"], [1, 2, 3, 4, 5])
    eng = a.engine
    real = eng.session
    eng.session = _PoisonAt(a, 3)
    try:
        got = []
        with pytest.raises(FloatingPointError, match="target engine produced NaN/inf logits at step 8"):
            for tok in a.greedy_steps(first, 10):
                got.append(tok)
    finally:
        eng.session = real
    want = list(b.greedy_steps_reference(first, 2))
    assert got == want and a.cache.lengths.tolist() == [7]
    for j in range(len(a.cache.buffers)):
        assert np.isfinite(a.cache.host(j)).all()
    _same_cache(a, b)
    assert list(a.greedy_steps(want[-1], 6)) == list(b.greedy_steps_reference(want[-1], 6))


@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_plain_generation_equals_the_generic_round(engines, flavor):
    """Plain greedy decoding of one prompt runs greedy_steps (Generator._plain_rounds); Generator.lean = False
    the generic round: the same tokens, finish reasons (length, EOS 95, stop strings, capacity) and statistics."""
    lean, generic = edgespec.load(engines["llama", flavor]), edgespec.load(engines["llama", flavor])
    generic.lean = False
    finishes = set()
    for i, p in enumerate([[1, 2, 3], [50, 7], list(range(30, 52)), [9] * 40, [3, 1, 4, 1, 5, 9, 2, 6]]):
        for kw in (dict(max_new_tokens=40), dict(max_new_tokens=200), dict(max_new_tokens=30, stop=["A", "B"]),
                   dict(max_new_tokens=1)):  # 1: the prefill's token ends it, no step runs
            x, y = lean.generate(p, **kw), generic.generate(p, **kw)
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            finishes.add(x.finish_reason)
            for key in ("new_tokens", "rounds", "histogram", "target_calls", "gamma_history"):
                assert getattr(x.stats, key) == getattr(y.stats, key), key
    assert {"length", "capacity"} <= finishes
    assert lean.generate([1, 2, 3], max_new_tokens=1).stats.target_calls == 1
    first = lean.generate([1, 2, 3], max_new_tokens=5).token_ids[0]
    lean.eos = {first}  # the prefill's token is an EOS: no step runs after it
    out = lean.generate([1, 2, 3], max_new_tokens=5)
    assert (out.token_ids, out.finish_reason, out.stats.target_calls) == ([first], "eos", 1)

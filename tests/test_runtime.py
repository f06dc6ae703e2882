"""The speculative runtime on tiny random engines: exactness, distributions, cache state, bad input."""
import numpy as np
import pytest

import edgespec
from edgespec import contract as C
from edgespec.contract import EngineError
from edgespec.backends.ort import OrtDecoder
from edgespec.kvcache import KVCache
from edgespec.drafts import DraftModel, LookupDraft, NgramDraft
from edgespec.sampling import SamplingConfig
from edgespec.speculative import fast_round, reference_round, speculative_round

N_PROMPTS = 50


def prompts(n=N_PROMPTS, seed=0, lo=1, hi=24):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:  # repetitive prompts give the n-gram draft something to find
            base = list(rng.integers(0, 95, 4))
            out.append((base * 6)[: rng.integers(lo, hi)])
        else:
            out.append(list(rng.integers(0, 95, rng.integers(lo, hi))))
    return out


@pytest.fixture(scope="module")
def plain(tiny_engines):
    return edgespec.load(tiny_engines["target"])


@pytest.fixture(scope="module")
def plain_outputs(plain):
    return [plain.generate(p, max_new_tokens=24).token_ids for p in prompts()]


@pytest.mark.parametrize("gamma", [1, 2, 4, 8, "auto"])
@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_greedy_speculative_equals_plain(tiny_engines, plain_outputs, draft, gamma):
    gen = edgespec.load(tiny_engines["target"], draft="ngram" if draft == "ngram" else tiny_engines[draft], gamma=gamma)
    drafted = accepted = 0
    for p, want in zip(prompts(), plain_outputs):
        out = gen.generate(p, max_new_tokens=24)
        assert out.token_ids == want, f"prompt {p}"
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    assert drafted > 0 and 0 < accepted < drafted  # both acceptances and rejections were exercised


def test_rejection_at_first_position_and_full_acceptance(tiny_engines, plain):
    p = prompts()[1]
    want = plain.generate(p, max_new_tokens=30).token_ids
    full = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"], gamma=4).generate(p, max_new_tokens=30)
    assert full.token_ids == want
    assert full.stats.acceptance_rate == 1.0 and full.stats.histogram[4] == full.stats.rounds - (full.stats.drafted % 4 > 0)
    # a draft that never agrees: every round rejects at position 0 and emits exactly the correction
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=3)

    class Contrary(DraftModel):  # proposes (its argmax + 1) % V, on the generic and on the lean path
        def propose(self, contexts, gamma, pick, active):
            prop = super().propose(contexts, gamma, pick, active)
            prop.tokens = (prop.tokens + 1) % 96
            return prop

        def draft(self, ctx, gamma, out):
            c = super().draft(ctx, gamma, out)
            out[:c] = (out[:c] + 1) % 96
            return c
    gen._drafter = lambda b, target=None: Contrary(gen._decoder(gen.draft, b))
    out = gen.generate(p, max_new_tokens=30)
    assert out.token_ids == want
    assert out.stats.accepted == 0 and out.stats.histogram[0] == out.stats.rounds


@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_running_into_the_context_capacity(tiny_engines, plain, draft):
    p = prompts()[3]
    want = plain.generate(p, max_new_tokens=500)
    assert want.finish_reason == "capacity" and len(p) + len(want.token_ids) == 128 + 1
    gen = edgespec.load(tiny_engines["target"], draft="ngram" if draft == "ngram" else tiny_engines[draft], gamma=8)
    out = gen.generate(p, max_new_tokens=500)
    assert out.finish_reason == "capacity" and out.token_ids == want.token_ids


def test_draft_with_smaller_capacity_is_handled(tiny_engines, plain):
    p = prompts()[2]
    want = plain.generate(p, max_new_tokens=90).token_ids
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["short"], gamma=4)
    out = gen.generate(p, max_new_tokens=90)
    assert out.token_ids == want
    assert out.stats.gamma_history[-1][1] == 0  # past the draft's 48 rows the runtime decodes plainly


@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_batches_of_mixed_lengths_are_exact_per_sequence(tiny_engines, plain_outputs, draft):
    gen = edgespec.load(tiny_engines["target"], draft="ngram" if draft == "ngram" else tiny_engines[draft], gamma=3)
    ps = prompts()[:12]
    outs = gen.generate(ps, max_new_tokens=24)
    assert [o.token_ids for o in outs] == plain_outputs[:12]


def test_batch_with_early_finishers(tiny_engines, plain):
    """Sequences of one batch that stop at different rounds (a stop string) keep the others exact."""
    ps = prompts()[:6]
    texts = [plain.generate(p, max_new_tokens=30).text for p in ps]
    stop = next(c for c in "etaoinsrhl" if 1 <= sum(c in t[:25] for t in texts) < len(texts))
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=2)
    outs = gen.generate(ps, max_new_tokens=30, stop=[stop])
    reasons = set()
    for p, o in zip(ps, outs):
        want = plain.generate(p, max_new_tokens=30, stop=[stop])
        assert (o.token_ids, o.text, o.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        reasons.add(o.finish_reason)
    assert "stop" in reasons and len(reasons) > 1  # some stopped early, some ran on


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6, 7, 8, "auto"])
@pytest.mark.parametrize("draft", ["noisy", "ngram"])
def test_coupled_same_seed_same_output_with_and_without_speculation(tiny_engines, plain, draft, gamma):
    gen = edgespec.load(tiny_engines["target"], draft="ngram" if draft == "ngram" else tiny_engines[draft], gamma=gamma)
    for seed, p in enumerate(prompts(8, seed=4)):
        kw = dict(max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.95, seed=seed, acceptance="coupled")
        assert gen.generate(p, **kw).token_ids == plain.generate(p, **kw).token_ids


def test_coupled_differs_across_seeds(plain):
    kw = dict(max_new_tokens=20, temperature=1.0, acceptance="coupled")
    outs = {tuple(plain.generate([1, 2, 3], seed=s, **kw).token_ids) for s in range(5)}
    assert len(outs) > 1


@pytest.mark.parametrize("stop_below", [0.0, 0.3])
def test_cache_rows_after_random_accept_reject_equal_a_fresh_prefill(tiny_engines, stop_below):
    """Also with a dynamic draft length, where the two sequences stop drafting at different proposals."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    target, draft = OrtDecoder(gen.target, 2), DraftModel(OrtDecoder(gen.draft, 2), stop_below=stop_below)
    rng = np.random.default_rng(0)
    ctx = [list(rng.integers(0, 95, 5)), list(rng.integers(0, 95, 9))]
    feed = np.zeros((2, 8), np.int64)  # prefill all but the pending token, right-padded
    feed[0, :4], feed[1, :8] = ctx[0][:-1], ctx[1][:-1]
    target(feed, np.arange(8)[None] < np.array([[4], [8]]))
    target.cache.commit([len(c) - 1 for c in ctx])
    cfg, active = SamplingConfig(), np.ones(2, bool)
    timer = edgespec.profiling.Timer()
    pick = lambda logits, pos: (logits.argmax(-1), None)  # noqa: E731
    patterns, counts = set(), set()
    for r in range(12):
        g = int(rng.integers(1, 6))
        new, k, n = speculative_round(target, draft, ctx, active, g, "greedy", cfg, None, None, pick, timer)
        patterns.update(k.tolist())
        counts.update((n < g).tolist())
        for i in range(2):
            ctx[i] += new[i]
            fresh = OrtDecoder(gen.target, 1)
            fresh(np.array([ctx[i][:-1]]))
            for got, want in zip(target.cache.rows(i), fresh.cache.rows(0, len(ctx[i]) - 1)):
                np.testing.assert_allclose(got, want, atol=1e-5)
            nd = int(draft.dec.cache.lengths[i])
            fresh_d = OrtDecoder(gen.draft, 1)
            fresh_d(np.array([ctx[i][:nd]]))
            for got, want in zip(draft.dec.cache.rows(i), fresh_d.cache.rows(0, nd)):
                np.testing.assert_allclose(got, want, atol=1e-5)
    assert len(patterns) >= (3 if stop_below == 0 else 2)  # several different accept counts were exercised
    assert counts == ({False} if stop_below == 0 else {False, True})  # rounds that stopped early, and not


@pytest.mark.parametrize("lookup, lookup_gamma", [(1, 0), (2, 0), (3, 0), (2, 9)])
def test_lookup_draft_keeps_its_model_cache_true_on_both_paths(tiny_engines, lookup, lookup_gamma):
    """LookupDraft through fast_round (draft(): the model skips lookup rounds) and through the generic round
    (propose(): the model runs, its rows are dropped): the same ids and counts every round, rounds drafted
    by lookup and by the model, and after every round each draft cache's committed rows are those a fresh
    draft decoder computes over the same context. With lookup_gamma 9, lookup rounds propose more than γ
    (the round's span) on both paths, the model never more than γ."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    rng = np.random.default_rng(lookup)
    prompt = list(rng.integers(0, 95, 4)) * 3 + list(rng.integers(0, 95, 5))
    twins = []
    for _ in range(2):
        target = OrtDecoder(gen.target, 1)
        drafter = LookupDraft(OrtDecoder(gen.draft, 1), lookup, max_ngram=4, lookup_gamma=lookup_gamma)
        first = target.ids(np.array([prompt]))[0, -1]
        target.cache.commit(len(prompt))
        twins.append((target, drafter, prompt + [int(first)]))
    model_rounds, longer = 0, 0
    for r in range(14):
        g = int(rng.integers(1, 6))
        out = []
        for (target, drafter, ctx), round_ in zip(twins, (fast_round, reference_round)):
            hits = drafter.hits
            new, k, c = round_(target, drafter, ctx, g, span=drafter.span(g))
            model_round = drafter.hits == hits
            model_rounds += round_ is fast_round and model_round
            longer += round_ is fast_round and c > g
            assert c <= (g if model_round else max(g, lookup_gamma))
            ctx += new
            out.append((new, k, c))
        assert out[0] == out[1], (r, g, out)
        for _, drafter, ctx in twins:
            n = int(drafter.dec.cache.lengths[0])
            assert n <= len(ctx) - 1
            if n:
                fresh = OrtDecoder(gen.draft, 1)
                fresh(np.array([ctx[:n]]))
                for got, want in zip(drafter.dec.cache.rows(0), fresh.cache.rows(0, n)):
                    np.testing.assert_allclose(got, want, atol=1e-5)
    hits = [d.hits for _, d, _ in twins]
    assert hits[0] == hits[1] and 0 < hits[0] and model_rounds > 0  # both kinds of round happened
    assert (longer > 0) == (lookup_gamma > 0)


def test_lookup_decodes_exactly_with_fewer_draft_calls(tiny_engines, plain):
    """Greedy decoding with lookup before the draft model: the plain output, one prompt (lean loop) and a
    batch (generic round); repetitive prompts draft by lookup, so the draft model runs less."""
    ps = prompts(9)
    kw = dict(draft=tiny_engines["noisy"], gamma=4)
    model, lookup = edgespec.load(tiny_engines["target"], **kw), edgespec.load(tiny_engines["target"], lookup=2, **kw)
    calls = {"model": 0, "lookup": 0}
    for p in ps:
        want = plain.generate(p, max_new_tokens=24).token_ids
        for name, gen in (("model", model), ("lookup", lookup)):
            out = gen.generate(p, max_new_tokens=24)
            assert out.token_ids == want
            calls[name] += out.stats.draft_calls
    assert calls["lookup"] < calls["model"]
    batch = lookup.generate(ps, max_new_tokens=16)
    assert [o.token_ids for o in batch] == [plain.generate(p, max_new_tokens=16).token_ids for p in ps]


def test_lookup_propose_widens_tokens_and_draft_distributions(tiny_engines):
    """The generic round's propose() with span past γ: a lookup row gets span proposals, each with a one-hot
    draft distribution (the rejection rule's q), and a model row keeps γ proposals with the model's q."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    drafter = LookupDraft(OrtDecoder(gen.draft, 2), 2, max_ngram=4, lookup_gamma=9)
    rep, other = [5, 6, 7, 8] * 3, [1, 2, 3, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # lookup finds only rep's

    def pick(logits, positions):
        q = np.exp(logits - logits.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        return q.argmax(-1), q
    prop = drafter.propose([rep, other], 3, pick, np.ones(2, bool), span=9)
    v = gen.draft.manifest.vocab_size
    assert prop.tokens.shape == (2, 9) and prop.q.shape == (2, 9, v)
    assert prop.counts.tolist() == [9, 3]
    assert prop.tokens[0].tolist() == [5, 6, 7, 8, 5, 6, 7, 8, 5]
    np.testing.assert_array_equal(prop.q[0], np.eye(v)[prop.tokens[0]])
    np.testing.assert_allclose(prop.q[1, :3].sum(-1), 1.0, rtol=1e-5)
    assert (prop.q[1, :3].argmax(-1) == prop.tokens[1, :3]).all()


def test_longer_lookup_rounds_decode_exactly(tiny_engines, plain):
    """lookup_gamma past γ: the plain output for one prompt (lean loop), a batch (generic round) and auto γ;
    rounds drafted by lookup propose more than γ (the stats' longest draft), with fewer verify calls than
    lookup at γ; a sampled batch with coupled acceptance gives plain decoding's tokens, and one with
    rejection sampling (one-hot lookup drafts, widened for the longer rounds) runs through."""
    ps = prompts(9)
    kw = dict(draft=tiny_engines["noisy"], lookup=2)  # gamma_max 8: lookup_gamma is not bounded by it
    short = edgespec.load(tiny_engines["target"], gamma=3, **kw)
    long = edgespec.load(tiny_engines["target"], gamma=3, lookup_gamma=12, **kw)
    auto = edgespec.load(tiny_engines["target"], gamma="auto", lookup_gamma=12, **kw)
    calls = {"short": 0, "long": 0}
    drafted = 0
    for p in ps:
        want = plain.generate(p, max_new_tokens=40).token_ids
        for name, gen in (("short", short), ("long", long), ("auto", auto)):
            out = gen.generate(p, max_new_tokens=40)
            assert out.token_ids == want, name
            calls[name] = calls.get(name, 0) + out.stats.target_calls
        tried = long.generate(p, max_new_tokens=40).stats.tried_by_position  # proposals at position j
        drafted = max(drafted, max((j + 1 for j, n in enumerate(tried) if n), default=0))
    assert calls["long"] < calls["short"] and drafted > 3
    batch = long.generate(ps, max_new_tokens=24)
    assert [o.token_ids for o in batch] == [plain.generate(p, max_new_tokens=24).token_ids for p in ps]
    kw = dict(max_new_tokens=24, temperature=0.9, seed=1, acceptance="coupled")  # same noise: same tokens
    assert [o.token_ids for o in long.generate(ps[:3], **kw)] == [o.token_ids for o in plain.generate(ps[:3], **kw)]
    rejection = long.generate(ps[:3], max_new_tokens=24, temperature=0.8, seed=1)  # one-hot q, widened
    assert all(0 < len(o.token_ids) <= 24 for o in rejection)


@pytest.mark.parametrize("kw, match", [
    (dict(draft="ngram", lookup=2), "lookup=2 goes with a draft engine folder"),
    (dict(lookup=2), "lookup=2 goes with a draft engine folder"),
    (dict(draft="noisy", lookup=5), "lookup must be an int in 0..max_ngram \\(4\\)"),
    (dict(draft="noisy", lookup=-1), "lookup must be an int in 0..max_ngram"),
    (dict(draft="noisy", lookup=2, lookup_gamma=17), "lookup_gamma must be an int in 0..16"),
    (dict(draft="noisy", lookup=2, lookup_gamma=-1), "lookup_gamma must be an int in 0..16"),
    (dict(draft="noisy", lookup_gamma=4), "lookup_gamma=4 goes with lookup="),
])
def test_lookup_refuses_what_it_cannot_do(tiny_engines, kw, match):
    if kw.get("draft") == "noisy":
        kw = {**kw, "draft": tiny_engines["noisy"]}
    with pytest.raises(ValueError, match=match):
        edgespec.load(tiny_engines["target"], **kw)


@pytest.mark.parametrize("draft", ["model", "model-stop", "ngram"])
def test_fast_round_matches_the_generic_round_step_by_step(tiny_engines, draft):
    """fast_round and reference_round (the generic speculative_round) on twin decoders: the same emitted
    ids, kept and drafted counts every round, and the same cache rows in the target and the draft."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"])
    rng = np.random.default_rng(3)
    prompt = list(rng.integers(0, 95, 4)) * 3  # repetitive: the n-gram draft finds continuations
    twins = []
    for _ in range(2):
        target = OrtDecoder(gen.target, 1)
        drafter = NgramDraft(1) if draft == "ngram" else \
            DraftModel(OrtDecoder(gen.draft, 1), stop_below=0.3 if draft == "model-stop" else 0.0)
        first = target.ids(np.array([prompt]))[0, -1]
        target.cache.commit(len(prompt))
        twins.append((target, drafter, prompt + [int(first)]))
    kept = set()
    for r in range(10):
        g = int(rng.integers(0, 6))
        out = []
        for (target, drafter, ctx), round_ in zip(twins, (fast_round, reference_round)):
            new, k, c = round_(target, drafter if g else None, ctx, g)
            ctx += new
            out.append((new, k, c))
        assert out[0] == out[1], (r, g, out)
        kept.add(out[0][1])
        (t0, d0, c0), (t1, d1, c1) = twins
        assert c0 == c1 and (t0.cache.lengths == t1.cache.lengths).all()
        for a, b in zip(t0.cache.rows(0), t1.cache.rows(0)):
            np.testing.assert_allclose(a, b, atol=1e-6)
        if draft != "ngram":
            assert (d0.dec.cache.lengths == d1.dec.cache.lengths).all()
            for a, b in zip(d0.dec.cache.rows(0), d1.dec.cache.rows(0)):
                np.testing.assert_allclose(a, b, atol=1e-6)
    assert len(kept) >= 2  # rounds that kept different numbers of drafts


@pytest.mark.parametrize("draft, gamma", [("noisy", 3), ("noisy", "auto"), ("ngram", 3), ("ngram", "auto"),
                                         (None, None), ("lookup", 3)])
def test_lean_text_decoding_equals_the_generic_round(tiny_engines, draft, gamma):
    """Greedy decoding of one prompt runs fast_round; Generator.lean = False runs the generic round:
    the same tokens and the same statistics (draft calls aside for lookup: the generic round runs the model
    on lookup rounds too)."""
    kw = {} if draft is None else dict(draft="ngram" if draft == "ngram" else tiny_engines["noisy"], gamma=gamma)
    if draft == "lookup":
        kw["lookup"] = 2
    lean, generic = edgespec.load(tiny_engines["target"], **kw), edgespec.load(tiny_engines["target"], **kw)
    generic.lean = False
    for gen in (lean, generic):
        gen.refine_costs = False  # auto γ from the same load-time costs: measured times must not steer it
    generic.cost = lean.cost
    for i, p in enumerate(prompts(8)):
        kw = dict(max_new_tokens=24, stop=["M{", "6l="] if i % 2 else None)  # stops end some generations early
        a, b = lean.generate(p, **kw), generic.generate(p, **kw)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for key in ("new_tokens", "rounds", "drafted", "accepted", "rejections", "histogram", "accepted_by_position",
                    "target_calls", "draft_calls", "gamma_history"):
            if not (key == "draft_calls" and draft == "lookup"):
                assert getattr(a.stats, key) == getattr(b.stats, key), key


def test_bound_call_equals_plain_session_run(tiny_engines):
    eng = edgespec.load(tiny_engines["target"]).target
    a, b = OrtDecoder(eng, 2), OrtDecoder(eng, 2)
    rng = np.random.default_rng(1)
    for s in (7, 1, 3, 1, 5):
        ids = rng.integers(0, 95, (2, s))
        valid = np.array([[True] * s, [True] * (s - 1) + [s == 1]])
        np.testing.assert_allclose(a(ids, valid), b.reference_call(ids, valid), atol=1e-5)
        for d in (a, b):
            d.cache.commit(valid.sum(1))


def test_growing_cache_keeps_committed_rows(tiny_engines):
    eng = edgespec.load(tiny_engines["target"]).target
    d = OrtDecoder(eng, 1)
    m = eng.manifest
    d.cache = KVCache(m.num_layers, 1, m.num_kv_heads, m.head_dim, m.max_context, chunk=16)
    ids = np.arange(40)[None] % 95
    full = OrtDecoder(eng, 1)(ids).copy()
    steps = []
    for t in range(40):
        steps.append(d(ids[:, t:t + 1])[:, 0].copy())
        d.cache.commit(1)
    assert d.cache.capacity == 48
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-5)


def test_draft_with_another_vocabulary_is_refused(tiny_engines):
    with pytest.raises(EngineError, match="vocabulary size 128 but target .* has 96"):
        edgespec.load(tiny_engines["target"], draft=tiny_engines["other_vocab"])


def test_draft_with_another_tokenizer_is_refused(tiny_engines, tmp_path):
    import json
    import shutil
    d = tmp_path / "draft"
    shutil.copytree(tiny_engines["noisy"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    m = json.loads((d / "engine.json").read_text())
    m["tokenizer_sha256"] = edgespec.contract.file_sha256(d / "tokenizer.json")
    (d / "engine.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="different tokenizers"):
        edgespec.load(tiny_engines["target"], draft=d)


def test_text_prompt_stream_and_stop_strings(tiny_engines):
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=3)
    out = gen.generate("def f(x):", max_new_tokens=40)
    assert out.text == gen.tok.decode(out.token_ids) and len(out.token_ids) >= 1
    assert "".join(gen.stream("def f(x):", max_new_tokens=40)) == out.text
    stop = out.text[5:7]
    cut = gen.generate("def f(x):", max_new_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.find(stop)]
    assert "".join(gen.stream("def f(x):", max_new_tokens=40, stop=[stop])) == cut.text


def test_eos_stops_generation(tiny_engines, plain):
    """EOS (95) ends a sequence: it is the last token and never an earlier one, also when a speculative
    round accepts drafts past it (a perfect draft, γ = 8: the round is cut at the EOS)."""
    spec = edgespec.load(tiny_engines["target"], draft=tiny_engines["same"], gamma=8)
    for p in prompts(40, seed=9):
        out = plain.generate(p, max_new_tokens=100)
        if out.finish_reason != "eos":
            assert 95 not in out.token_ids  # an EOS would have ended it
            continue
        assert out.token_ids[-1] == 95 and 95 not in out.token_ids[:-1] and len(out.token_ids) < 100
        fast = spec.generate(p, max_new_tokens=100)
        assert (fast.token_ids, fast.finish_reason) == (out.token_ids, "eos")
        assert fast.stats.accepted > 0  # drafts were kept, so the EOS came from inside a round
        return
    pytest.fail("no prompt reached the EOS token (95): the test needs another seed")


def test_stats_are_consistent(tiny_engines):
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=4)
    s = gen.generate(prompts()[4], max_new_tokens=40).stats
    assert s.new_tokens == 40 and sum(s.histogram) == s.rounds and s.accepted <= s.drafted
    assert s.new_tokens == 1 + s.accepted + s.rounds  # first token from the prefill, then k+1 per round
    assert sum(s.tried_by_position) == s.drafted and sum(s.accepted_by_position) == s.accepted
    assert s.target_calls == s.rounds + 1 and s.draft_calls >= s.drafted
    t = s.time_s
    assert t["draft"] + t["verify"] + t["sampling"] + t["other"] == pytest.approx(t["decode"], rel=1e-6)
    d = s.to_dict()
    assert d["acceptance_by_position"][0] is not None and 0 <= d["acceptance_rate"] <= 1


def test_ngram_draft_proposes_the_latest_continuation():
    ng = NgramDraft(1, max_ngram=3)
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ng.lookup(0, ctx, 3) == [7, 5, 1]  # the latest earlier "1 2 3" was followed by 7 5 1
    ctx += [7, 5]
    assert ng.lookup(0, ctx, 2) == [1, 2]  # the index grows with the context
    # a continuation that reaches the context's end runs on into its own proposals (period 4 here)
    assert NgramDraft(1, max_ngram=2).lookup(0, [8, 1, 2, 3, 4, 1, 2], 7) == [3, 4, 1, 2, 3, 4, 1]
    assert NgramDraft(1).lookup(0, [6, 6], 3) == [6, 6, 6]  # period 1
    assert NgramDraft(1).lookup(0, [5, 6, 7], 4) == []  # nothing repeats
    assert NgramDraft(1, min_ngram=2).lookup(0, [5, 6, 7, 5], 4) == []  # a 1-gram match is below min_ngram


def test_load_sets_the_ngram_drafts_longest_lookup(tiny_engines, plain_outputs):
    gen = edgespec.load(tiny_engines["target"], draft="ngram", gamma=3, max_ngram=2)
    assert gen._drafter(1).max_n == 2
    for p, want in zip(prompts()[:6], plain_outputs):
        assert gen.generate(p, max_new_tokens=24).token_ids == want
    with pytest.raises(ValueError, match="need 1 <= min_ngram <= max_ngram, got 1, 0"):
        edgespec.load(tiny_engines["target"], draft="ngram", gamma=3, max_ngram=0)


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature must be a finite number >= 0, got True"),
    (dict(temperature=1e-310), "temperature must be 0 \\(greedy\\) or >= 0.0001, got 1e-310"),
    (dict(temperature=5e-5, acceptance="coupled"), "temperature must be 0 \\(greedy\\) or >= 0.0001"),
    (dict(top_k=-2, temperature=1), "top_k must be an integer >= 0"),
    (dict(top_p=0.0, temperature=1), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5, temperature=1), "top_p"),
    (dict(seed=-1), "seed must be a non-negative integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(acceptance="magic"), "acceptance must be one of"),
    (dict(acceptance="greedy", temperature=0.7), "needs temperature 0"),
    (dict(gamma=99), "gamma must be 'auto' or an integer in \\[0, 8\\]"),
    (dict(stop="x"), "stop must be a list of non-empty strings"),
])
def test_invalid_parameters_name_the_parameter(plain, kw, match):
    with pytest.raises(ValueError, match=match):
        plain.generate([1, 2, 3], **kw)


@pytest.mark.parametrize("prompt,error,match", [
    (b"def f(x):", TypeError, "prompt must be text \\(str\\) or a list of token ids, got bytes; decode"),
    (bytearray(b"def"), TypeError, "got bytearray"),
    ([b"def", b"class"], TypeError, "got bytes"),  # a batch of bytes
    ([1, 2.7], TypeError, "token ids must be integers, got \\[2.7\\]"),
    ([1, True], TypeError, "token ids must be integers, got \\[True\\]"),
    (42, TypeError, "prompt must be text \\(str\\) or a list of token ids, got int"),
    ("def \udcff(x):", ValueError, "the prompt is not valid UTF-8 text: '\\\\udcff' at character 4"),
])
def test_prompts_that_are_neither_text_nor_ids_are_refused(plain, prompt, error, match):
    with pytest.raises(error, match=match):
        plain.generate(prompt, max_new_tokens=4)


def test_the_temperature_floor_samples_like_greedy(plain):
    """At TEMPERATURE_MIN every logit gap is hundreds of nats: sampling picks the argmax (the floor's
    justification), with finite probabilities, not the NaN of 1e-310."""
    from edgespec.sampling import TEMPERATURE_MIN
    greedy = plain.generate([1, 2, 3], max_new_tokens=12).token_ids
    for acceptance in ("rejection", "coupled"):
        out = plain.generate([1, 2, 3], max_new_tokens=12, temperature=TEMPERATURE_MIN, seed=0, acceptance=acceptance)
        assert out.token_ids == greedy


def test_empty_and_too_long_prompts_are_refused_before_compute(plain):
    with pytest.raises(ValueError, match="prompt is empty"):
        plain.generate("")
    with pytest.raises(ValueError, match="prompt has 200 tokens but the engine's context capacity is 128"):
        plain.generate([1] * 200)
    with pytest.raises(ValueError, match="token ids must be in \\[0, 96\\)"):
        plain.generate([1, 500])


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # greedy reads next_ids, sampling the logits
def test_nan_logits_raise_naming_engine_and_step(tiny_engines, monkeypatch, temperature):
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=2)
    real = OrtDecoder.run
    calls = {"n": 0}

    def poisoned(self, tokens, valid=None, embeds=None):  # the outputs the graph gives for NaN logits
        real(self, tokens, valid, embeds)
        if self.engine is gen.target:
            calls["n"] += 1
            if calls["n"] == 3:
                self._last.logits.handle[...] = np.nan
                self._last.ids.handle[...] = C.NONFINITE_ID
    monkeypatch.setattr(OrtDecoder, "run", poisoned)
    with pytest.raises(FloatingPointError, match="target engine produced .*NaN/inf logits at step"):
        gen.generate([1, 2, 3], max_new_tokens=20, temperature=temperature, seed=0)


def test_demo_engines_from_an_older_contract_are_re_exported(tiny_checkpoints, tmp_path, monkeypatch):
    import json
    import shutil

    from edgespec.export import bundled
    models, engines = tmp_path / "models", tmp_path / "engines"
    monkeypatch.setattr(bundled, "DEMO_ENGINES", {"t": ("ck", "fp32"), "d": ("ck", "fp32")})
    shutil.copytree(tiny_checkpoints["llama"][0], models / "ck")
    cfg = json.loads((models / "ck" / "config.json").read_text())
    (models / "ck" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))  # the demo's
    eng, _ = bundled.ensure_demo_engines(models, engines)
    manifest = json.loads((eng / "engine.json").read_text())
    manifest["contract_version"] = C.CONTRACT_VERSION - 1
    (eng / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="re-export"):
        edgespec.load(eng)
    bundled.ensure_demo_engines(models, engines)
    assert json.loads((eng / "engine.json").read_text())["contract_version"] == C.CONTRACT_VERSION
    assert len(edgespec.load(eng).generate([1, 2, 3], max_new_tokens=3).token_ids) == 3
    # a folder from an earlier demo recipe (before flavours and weight-only int8) is re-exported too
    manifest = json.loads((eng / "engine.json").read_text())
    assert manifest["extra"]["demo_recipe"] == bundled.DEMO_RECIPE
    del manifest["extra"]["demo_recipe"]
    (eng / "engine.json").write_text(json.dumps(manifest))
    stamp = (eng / "engine.json").stat().st_mtime_ns
    bundled.ensure_demo_engines(models, engines)
    assert json.loads((eng / "engine.json").read_text())["extra"]["demo_recipe"] == bundled.DEMO_RECIPE
    assert (eng / "engine.json").stat().st_mtime_ns != stamp


def test_generator_reuses_its_decoders_but_never_shares_one(tiny_engines):
    """Each generate() holds its own decoders (a fresh cache), and gives them back for the next one."""
    gen = edgespec.load(tiny_engines["target"], draft=tiny_engines["noisy"], gamma=3)
    first = gen.generate([1, 2, 3], max_new_tokens=12)
    pooled = {id(d) for v in gen._free.values() for d in v}
    assert len(pooled) == 2  # target and draft
    again = gen.generate([1, 2, 3], max_new_tokens=12)
    assert again.token_ids == first.token_ids and {id(d) for v in gen._free.values() for d in v} == pooled
    it1 = iter(gen._run([[4, 5, 6]], 12, SamplingConfig(), "greedy", 3, []))
    next(it1)  # one generation in flight holds a target and a draft decoder ...
    assert sum(len(v) for v in gen._free.values()) == 0
    other = gen.generate([1, 2, 3], max_new_tokens=12)  # ... so this one gets new ones
    assert other.token_ids == first.token_ids
    it1.close()
    assert sum(len(v) for v in gen._free.values()) == 4


def test_a_native_draft_gets_the_targets_threads_and_an_ort_draft_one():
    from edgespec.generate import DRAFT_THREADS, draft_threads_for
    assert draft_threads_for("cpu-native", None, 2) == 2  # one shared pool: no fight for the cores
    assert draft_threads_for("cpu", None, 2) == DRAFT_THREADS == 1  # a second ORT pool would fight the target's
    assert draft_threads_for("cpu-native", 1, 2) == 1 and draft_threads_for("cpu", 3, 2) == 3  # the caller's choice


def test_a_dynamic_stop_drafts_less_and_decodes_exactly(tiny_engines, plain):
    """stop_below on a text draft model (load's keyword, the CLI's --stop-below): a round stops drafting after a
    proposal the draft is unsure of, so fewer proposals a round, and the output stays the plain one on the lean
    loop (one prompt), the generic round (a batch) and with lookup first; a draft with no confidence is refused."""
    ps = prompts(12)
    kw = dict(draft=tiny_engines["noisy"], gamma=6)
    full = edgespec.load(tiny_engines["target"], **kw)
    stop = edgespec.load(tiny_engines["target"], stop_below=0.6, **kw)
    looked = edgespec.load(tiny_engines["target"], stop_below=0.6, lookup=2, **kw)
    per_round = {"full": [0, 0], "stop": [0, 0]}
    for p in ps:
        want = plain.generate(p, max_new_tokens=24).token_ids
        for name, gen in (("full", full), ("stop", stop)):
            out = gen.generate(p, max_new_tokens=24)
            assert out.token_ids == want
            per_round[name][0] += out.stats.drafted
            per_round[name][1] += out.stats.rounds
        assert looked.generate(p, max_new_tokens=24).token_ids == want
    assert per_round["stop"][0] / per_round["stop"][1] < per_round["full"][0] / per_round["full"][1] - 0.5
    assert [o.token_ids for o in stop.generate(ps, max_new_tokens=16)] == \
        [plain.generate(p, max_new_tokens=16).token_ids for p in ps]
    with pytest.raises(ValueError, match="stop_below=0.6 stops a draft model's or the text head's run.*'ngram'"):
        edgespec.load(tiny_engines["target"], draft="ngram", stop_below=0.6)
    with pytest.raises(ValueError, match="stop_below must be a probability in \\[0, 1\\), got 1.5"):
        edgespec.load(tiny_engines["target"], stop_below=1.5, **kw)


def test_the_text_flags_carry_the_dynamic_stop():
    import argparse
    from edgespec.speculation import from_args, speculation_flags
    p = argparse.ArgumentParser()
    speculation_flags(p)
    assert from_args(p.parse_args(["--stop-below", "0.3"])).stop_below == 0.3
    assert from_args(p.parse_args([])).stop_below == 0.0

"""export/training/train_attn_head.py: the attention head's incremental drafting step computes what its batched
passes compute, the acceptance protocol counts as it says, and a short run trains, validates and resumes."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgespec.export.training import train_attn_head as T


def small_head(seed=0, e=32, v=40):
    rng = np.random.default_rng(seed)
    embed = rng.normal(0, 1, (v, e)).astype(np.float32)
    torch.manual_seed(seed)
    return T.build(embed, embed.copy(), T.AttnHeadConfig(hidden=24, heads=2)).eval(), e, v


def test_a_drafted_step_equals_the_teacher_pass_at_that_position():
    """Fed the true state, the incremental step at position j + 1 (keys of positions <= j cached) gives the
    teacher-forced pass's output there; fed the pass before's guess, it gives the second pass's output."""
    head, e, v = small_head()
    f, x = torch.randn(1, 12, e), torch.randint(0, v, (1, 12))
    with torch.no_grad():
        g1, k1, v1 = head.teacher(f, x)
        g2 = head.second(torch.cat([f[:, :1], g1[:, :-1]], 1), x, k1, v1)
        for j in range(0, 10):
            ks, vs = [k1[:, :, :j + 1]], [v1[:, :, :j + 1]]
            step = head.step(f[:, j + 1:j + 2], x[:, j + 1:j + 2], j + 1, [*ks], [*vs])
            assert torch.allclose(step[0, 0], g1[0, j + 1], atol=1e-5)
            guess = head.step(g1[:, j:j + 1], x[:, j + 1:j + 2], j + 1, ks, vs)
            assert torch.allclose(guess[0, 0], g2[0, j + 1], atol=1e-5)


def test_chain_acceptance_counts_only_the_steps_a_kept_chain_reaches():
    ids = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    greedy = np.roll(ids, -1, 1)  # the text is the greedy path
    val = {"ids": ids, "greedy": greedy}
    assert T.chain_acceptance(val, lambda i, j: (lambda k: int(greedy[i, j + k + 1])), 3) == [1.0, 1.0, 1.0]
    assert T.chain_acceptance(val, lambda i, j: (lambda k: -1), 3) == [0.0, 0.0, 0.0]  # never past the first
    assert T.tokens_per_round([0.5, 0.5]) == [1.5, 1.75]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="split into 5 heads of an even size"):
        T.AttnHeadConfig(hidden=24, heads=5)
    with pytest.raises(ValueError, match="epochs must be > 0"):
        T.AttnHeadConfig(epochs=0)


def test_a_short_run_trains_validates_and_resumes(tmp_path, capsys):
    args = ["--target", "models/demo-target", "--draft", "models/demo-draft", "--out", str(tmp_path / "h.npz"),
            "--work", str(tmp_path / "w"), "--train-seqs", "16", "--val-seqs", "2", "--seq-len", "48",
            "--hidden", "32", "--heads", "2", "--epochs", "1", "--quiet", "--threads", "2"]
    assert T.main(args) == 0
    r = json.loads((tmp_path / "h.json").read_text())
    assert set(r["validation"]) == {"attention_head", "draft_model"} and r["fit"]["epochs_run"] == 1
    assert len(r["validation"]["draft_model"]["tokens_per_round_by_gamma"]) == 6
    assert T.main(args) == 0  # the checkpoint says the epoch is done: nothing to run again
    assert json.loads((tmp_path / "h.json").read_text())["fit"]["epochs_run"] == 0
    assert T.main([*args, "--mlp-head", str(tmp_path / "none.npz")]) == 2
    assert "none.npz: no such file" in capsys.readouterr().err


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match="windows must be one of corpus, code, got 'prose'"):
        T.AttnHeadConfig(windows="prose")
    with pytest.raises(ValueError, match="code_context .256. must be shorter than seq_len .256."):
        T.AttnHeadConfig(windows="code", code_context=256)


def test_code_contexts_end_after_a_def_line_and_too_few_files_are_refused():
    from tokenizers import Tokenizer
    tok_path = Path("models/demo-target/tokenizer.json")
    tok = Tokenizer.from_file(str(tok_path))
    body = "".join(f"x{i} = {i} * 2\n" for i in range(40))
    texts = [body + "def f(a, b):\n    return a + b\n", body + "class A:\n    def g(self):\n        pass\n",
             body + "y = 1\n"]
    ctx = T.code_contexts(tok_path, texts, 2, 24, np.random.default_rng(0))
    assert ctx.shape == (2, 24)
    ends = sorted(tok.decode(list(c)).splitlines()[-1].strip() for c in ctx)
    assert ends == ["def f(a, b):", "def g(self):"]
    with pytest.raises(ValueError, match="only 2 code contexts of 24 tokens in 3 files, 3 wanted"):
        T.code_contexts(tok_path, texts, 3, 24, np.random.default_rng(0))


def test_code_windows_continue_each_context_with_the_targets_greedy_tokens(tmp_path):
    args = ["--target", "models/demo-target", "--windows", "code", "--code-context", "24", "--out",
            str(tmp_path / "h.npz"), "--work", str(tmp_path / "w"), "--train-seqs", "16", "--val-seqs", "2",
            "--seq-len", "48", "--hidden", "32", "--heads", "2", "--epochs", "1", "--quiet", "--threads", "2"]
    assert T.main(args) == 0
    blocks = sorted((tmp_path / "w").glob("train-code24-*.npz"))
    assert blocks and len(sorted((tmp_path / "w").glob("code-train-*.npy"))) == 1
    data = T.load_blocks(blocks)
    ids, greedy = data["ids"], data["greedy"]
    assert ids.shape == (16, 48)
    assert (ids[:, 24:] == greedy[:, 23:-1]).all()  # after the context, every token is the target's greedy choice
    assert (ids[:, 1:24] != greedy[:, :23]).any()  # the context is the file's text, not greedy
    assert json.loads((tmp_path / "h.json").read_text())["config"]["windows"] == "code"


def test_the_runtime_head_computes_what_the_trained_torch_head_computes():
    """edgespec/attn_head.py (numpy, the runtime) against the torch module it was trained as: the guess after
    true states, then after each drafted (guess, token); and both against the from-scratch reference."""
    from edgespec.attn_head import AttnHead
    head, e, v = small_head(seed=3)
    rt = AttnHead(T.to_weights(head, T.AttnHeadConfig(hidden=24, heads=2)), "numpy")
    f, x = torch.randn(1, 10, e), torch.randint(0, v, (1, 10))
    with torch.no_grad():
        g1, k1, v1 = head.teacher(f[:, :7], x[:, :7])
        ks, vs, g = [k1], [v1], g1[:, 6:7]
        want = [g[0, 0].numpy()]
        drafted = [int(t) for t in x[0, 7:10]]
        for i, t in enumerate(drafted):
            g = head.step(g, torch.tensor([[t]]), 7 + i, ks, vs)
            want.append(g[0, 0].numpy())
    zs = [rt.extend(f[0, :7].numpy(), x[0, :7].numpy())]  # folded: z, from which the state and the proposal
    keys, values = rt.keys, rt.values
    for t in drafted:
        z, keys, values = rt.guess(zs[-1], t, keys, values)
        zs.append(z)
    ref = rt.reference_guesses(f[0, :7].numpy(), x[0, :7].numpy(), drafted)
    for a, z, c in zip(want, zs, ref):
        np.testing.assert_allclose(rt.state(z), a, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-4)
        assert rt.propose(z) == rt.reference_proposal(c) == int(np.argmax(a @ head.lm.numpy().T))
    assert len(rt.keys) == 7  # drafted positions never enter the cache


def test_the_drafter_keeps_the_true_states_across_rounds_and_plain_rounds():
    """AttnHeadDraft over a fake target: rounds that commit 1..4 tokens and rounds of γ 0; each round's proposals
    are what the head computes from scratch over the true states so far (numpy products: the same arithmetic)."""
    from edgespec.attn_head import AttnHead, AttnHeadDraft
    head, e, v = small_head(seed=5)
    w = T.to_weights(head, T.AttnHeadConfig(hidden=24, heads=2))
    rng = np.random.default_rng(0)
    states = rng.normal(0, 1, (40, e)).astype(np.float32)  # the target's state at each position
    ctx = [int(t) for t in rng.integers(0, v, 6)]
    draft, ref = AttnHeadDraft(AttnHead(w, "numpy"), lambda p: states[p]), AttnHead(w, "numpy")
    out = np.zeros(8, np.int64)
    for gamma, commit in [(3, 2), (0, 1), (0, 1), (4, 4), (2, 1), (0, 1), (5, 3)]:
        c = draft.draft(ctx, gamma, out)
        assert c == gamma and len(draft.head.keys) == len(ctx) - 1
        if gamma:
            guesses, props = ref.reference_guesses(states[:len(ctx) - 1], np.array(ctx[1:]), []), []
            for _ in range(gamma):
                props.append(ref.reference_proposal(guesses[-1]))
                guesses = ref.reference_guesses(states[:len(ctx) - 1], np.array(ctx[1:]), props)
            assert out[:c].tolist() == props
        ctx += [int(t) for t in rng.integers(0, v, commit)]
    assert draft.draft(ctx[:4], 2, out) == 2 and len(draft.head.keys) == 3  # a shorter context: a new sequence


def test_native_products_are_the_float16_matrices_products_and_odd_widths_stay_on_numpy():
    """es_rows_f16 (the head's products on the native kernel): x @ W rounded to float16, for 1..30 rows (calls of
    at most 12), against float64; a width that is not a multiple of the panel stays float32 numpy."""
    from edgespec.attn_head import ROWS_PER_CALL, Matrix, native_library
    lib = native_library()
    if lib is None:
        pytest.skip("native_step.c's library does not build here (no C compiler)")
    rng = np.random.default_rng(0)
    for k, n in ((48, 64), (384, 4096), (33, 16)):
        w = rng.normal(0, 1, (k, n)).astype(np.float32)
        m = Matrix(w, lib)
        assert m.lib is lib
        w16 = w.astype(np.float16).astype(np.float64)
        for t in (1, 2, 5, ROWS_PER_CALL, 13, 30):
            x = rng.normal(0, 1, (t, k)).astype(np.float32)
            np.testing.assert_allclose(m(x), x @ w16, rtol=1e-4, atol=1e-4 * np.sqrt(k))
        np.testing.assert_allclose(m(x[0]), x[0] @ w16, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    odd = Matrix(rng.normal(0, 1, (16, 24)).astype(np.float32), lib)
    assert odd.lib is None and odd(np.ones(16, np.float32)).dtype == np.float32
    x, y, w = np.ones((13, 16), np.float32), np.zeros((13, 32), np.float32), np.zeros(512, np.uint16)
    assert lib.es_rows_f16(x.ctypes.data, 13, w.ctypes.data, 16, 32, y.ctypes.data) == -1  # more rows than a call
    assert lib.es_rows_f16(x.ctypes.data, 1, w.ctypes.data, 16, 24, y.ctypes.data) == -1  # not whole panels


def test_a_head_on_native_products_drafts_what_the_numpy_head_drafts():
    from edgespec.attn_head import AttnHead, native_library
    if native_library() is None:
        pytest.skip("native_step.c's library does not build here (no C compiler)")
    rng = np.random.default_rng(1)
    embed = rng.normal(0, 1, (64, 32)).astype(np.float32)
    cfg = T.AttnHeadConfig(hidden=32, heads=2)
    torch.manual_seed(1)
    w = T.to_weights(T.build(embed, embed.copy(), cfg), cfg)
    a, b = AttnHead(w, "native"), AttnHead(w, "numpy")
    assert (a.products, b.products) == ("native", "numpy") and a._m.lib is not None and a._gu.lib is not None
    states, tokens = rng.normal(0, 1, (20, 32)).astype(np.float32), rng.integers(0, 64, 20)
    za, zb = a.extend(states, tokens), b.extend(states, tokens)
    np.testing.assert_allclose(za, zb, rtol=2e-3, atol=2e-3)
    ka, va, kb, vb = a.keys, a.values, b.keys, b.values
    for _ in range(6):
        assert a.propose(za) == b.propose(zb)
        za, ka, va = a.guess(za, b.propose(zb), ka, va)
        zb, kb, vb = b.guess(zb, b.propose(zb), kb, vb)
        np.testing.assert_allclose(za, zb, rtol=5e-3, atol=5e-3)
    # the slow reference stays float32 numpy whatever the head's products: equal to the numpy head's, bit for bit
    for x, y in zip(a.reference_guesses(states, tokens, [3, 5]), b.reference_guesses(states, tokens, [3, 5])):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="products must be one of auto, native, numpy, got 'gpu'"):
        AttnHead(w, "gpu")


@pytest.fixture(scope="module")
def hidden_engine(tmp_path_factory):
    """A tiny Llama exported with its hidden-state output, and an attention head (random) for it."""
    import transformers
    from conftest import char_tokenizer_json, set_eos
    from edgespec.export.onnx_export import export_engine
    from safetensors.numpy import load_file
    root = tmp_path_factory.mktemp("attnhead")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # float16 values (the native step keeps float16 weights), wide enough to differ
        for p in model.parameters():
            p.copy_(p.normal_(0, 0.2).half().float())
    model.save_pretrained(root / "ck", safe_serialization=True)
    char_tokenizer_json(root / "ck" / "tokenizer.json")
    set_eos(root / "ck", 94)
    export_engine(root / "ck", root / "engine", max_context=128, progress=False, hidden=True)
    wts = load_file(str(root / "ck" / "model.safetensors"))
    torch.manual_seed(2)
    head = T.build(wts["model.embed_tokens.weight"], wts["lm_head.weight"], T.AttnHeadConfig(hidden=24, heads=2))
    T.to_weights(head, T.AttnHeadConfig(hidden=24, heads=2)).save(root / "attn_head.npz")
    return root / "engine", root / "attn_head.npz"


@pytest.mark.parametrize("gamma", [3, "auto"])
@pytest.mark.parametrize("provider", ["cpu", "cpu-native"])
def test_speculation_with_the_attention_head_equals_plain(hidden_engine, gamma, provider):
    import edgespec
    engine, head = hidden_engine
    plain = edgespec.load(engine, provider=provider).plain()
    spec = edgespec.load(engine, draft=head, gamma=gamma, provider=provider)
    assert spec.drafter_kind == "head" and spec.text_head.reads_every_position
    for prompt in ([5, 17, 3, 60, 42], list(range(30, 52))):
        want = plain.generate(prompt, max_new_tokens=30)
        got = spec.generate(prompt, max_new_tokens=30)
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert got.stats.drafted > 0 or gamma == "auto"  # auto may find plain rounds cheaper (the head is random)


def test_an_attention_head_for_another_target_is_refused(hidden_engine, tmp_path):
    import edgespec
    from edgespec.attn_head import AttnHeadWeights
    engine, head = hidden_engine
    w = AttnHeadWeights.load(head)
    w2 = T.to_weights(small_head(e=32, v=96)[0], T.AttnHeadConfig(hidden=24, heads=2))
    w2.save(tmp_path / "other.npz")
    with pytest.raises(ValueError, match=r"trained on a target with a \(96, 32\) embedding table; .* has \(96, 64\)"):
        edgespec.load(engine, draft=tmp_path / "other.npz", gamma=2)
    with pytest.raises(ValueError, match="the attention head gives no confidence"):
        edgespec.load(engine, draft=head, gamma=2, stop_below=0.5)
    assert w.heads == 2


def test_a_widened_head_proposes_what_its_source_proposes(tmp_path):
    """export/standin.widen_attention_head: on states padded with zero dims (a stand-in's), the widened head's
    guesses are the source's padded with zeros, so its proposals are the source's."""
    from edgespec.attn_head import AttnHead
    from edgespec.export.standin import widen_attention_head
    head, e, v = small_head(seed=7)
    T.to_weights(head, T.AttnHeadConfig(hidden=24, heads=2)).save(tmp_path / "h.npz")
    widen_attention_head(tmp_path / "h.npz", tmp_path / "w.npz", e + 24)
    a, b = AttnHead.load(tmp_path / "h.npz"), AttnHead.load(tmp_path / "w.npz")
    rng = np.random.default_rng(0)
    states, toks = rng.normal(0, 1, (6, e)).astype(np.float32), rng.integers(0, v, 6)
    za, zb = a.extend(states, toks), b.extend(np.concatenate([states, np.zeros((6, 24), np.float32)], 1), toks)
    ka, va_, kb, vb = a.keys, a.values, b.keys, b.values
    for _ in range(4):
        np.testing.assert_allclose(b.state(zb)[:e], a.state(za), rtol=1e-4, atol=1e-5)
        assert not b.state(zb)[e:].any() and a.propose(za) == b.propose(zb)
        t = a.propose(za)
        za, ka, va_ = a.guess(za, t, ka, va_)
        zb, kb, vb = b.guess(zb, t, kb, vb)
    with pytest.raises(ValueError, match="at least as wide as its source"):
        widen_attention_head(tmp_path / "h.npz", tmp_path / "x.npz", e - 1)


def test_the_real_size_bench_runs_every_mode_and_checks_them_against_plain(hidden_engine, tmp_path):
    import importlib.util
    from pathlib import Path
    engine, head = hidden_engine
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_attn_head.py"
    spec = importlib.util.spec_from_file_location("bench_attn_head", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--target", str(engine), "--draft", str(engine), "--head", str(head), "--out", str(out),
                       "--provider", "cpu", "--head-gammas", "3", "--draft-gammas", "2", "--prompts", "2",
                       "--tokens", "6", "--repeats", "1"]) == 0
    r = json.loads(out.read_text())
    assert list(r["rows"]) == ["plain", "draft model, γ 2", "attention head, γ 3"]
    assert all(v["identical_to_plain"] == "2/2" for v in r["rows"].values())
    assert "| attention head, γ 3 |" in out.with_suffix(".md").read_text()

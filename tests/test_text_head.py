"""The feature-level text draft head: the folded numpy head against the unfolded formula, its file, its
Drafter, and the distillation's training and validation on synthetic hidden states."""
import numpy as np
import pytest

from edgespec.text_head import TextHead, TextHeadDraft, TextHeadWeights

E, H, V, K = 32, 16, 64, 24


def random_weights(seed=0) -> TextHeadWeights:
    rng = np.random.default_rng(seed)

    def r(*shape, scale=1.0):
        return (rng.normal(0, 1, shape) * scale).astype(np.float32)
    vocab = np.sort(rng.choice(V, K, replace=False))
    embed = r(V, E)
    return TextHeadWeights(r(E, H, scale=0.3), r(E, H, scale=0.3), r(H), r(H, E, scale=0.5), r(E), embed,
                           embed[vocab] * 0.1, vocab)


def test_folded_head_matches_the_unfolded_formula():
    w = random_weights()
    head = TextHead(w)
    rng = np.random.default_rng(1)
    for _ in range(5):
        h = rng.normal(0, 1, E).astype(np.float32)
        x = int(rng.integers(0, V))
        fed, props = [x], []
        tok, p = head.first(h, x)
        for _ in range(4):
            props.append((tok, p))
            fed.append(tok)
            tok, p = head.next(tok)
        ref = head.reference_logits(h, fed[:-1])  # (4, K): the proposal after each fed token
        for (tok, p), lg in zip(props, ref):
            assert tok == int(w.vocab[np.argmax(lg)])
            z = lg - lg.max()
            assert p == pytest.approx(1.0 / np.exp(z).sum(), rel=1e-4)


def test_weights_round_trip_and_clear_errors(tmp_path):
    w = random_weights()
    w.save(tmp_path / "h.npz")
    back = TextHeadWeights.load(tmp_path / "h.npz")
    np.testing.assert_allclose(back.w_h, w.w_h, atol=2e-3)  # stored as fp16
    assert (back.vocab == w.vocab).all()
    with pytest.raises(FileNotFoundError, match="no text draft head"):
        TextHeadWeights.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "bad.npz", w_h=w.w_h)
    with pytest.raises(ValueError, match="is not a text draft head: missing"):
        TextHeadWeights.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="do not fit together: w_e"):
        TextHeadWeights(w.w_h, w.w_e[:-1], w.b_in, w.w_out, w.b_out, w.embed, w.lm, w.vocab)
    with pytest.raises(ValueError, match="distinct ids"):
        TextHeadWeights(w.w_h, w.w_e, w.b_in, w.w_out, w.b_out, w.embed, w.lm, np.full(K, 3))


def test_check_fits_refuses_another_targets_head_by_name():
    w = random_weights()
    lo, hi = int(w.vocab.min()), int(w.vocab.max()) + 1
    w.check_fits("h.npz", (V, E), (lo, hi), "the target")  # fits: no error
    with pytest.raises(ValueError, match=rf"h.npz was trained on a target with a \({V}, {E}\) embedding table; "
                                         rf"the target has \({V}, {E + 1}\)"):
        w.check_fits("h.npz", (V, E + 1), (lo, hi), "the target")
    with pytest.raises(ValueError, match=rf"h.npz proposes ids {lo}..{hi - 1}; the action ids are {lo + 1}..{hi - 1}"):
        w.check_fits("h.npz", (V, E), (lo + 1, hi), "the target")
    with pytest.raises(ValueError, match=rf"proposes ids {lo}..{hi - 1}; the action ids are {lo}..{hi - 2}"):
        w.check_fits("h.npz", (V, E), (lo, hi - 1), "the target")

@pytest.mark.parametrize("stop_below", [0.0, 0.5])
def test_drafter_proposes_the_heads_chain_and_stops_when_unsure(stop_below):
    w = random_weights(2)
    h = np.random.default_rng(3).normal(0, 1, E).astype(np.float32)
    seen = []

    def features(ctx):
        seen.append(list(ctx))
        return h
    draft = TextHeadDraft(TextHead(w), features, stop_below)
    out = np.zeros(6, np.int64)
    c = draft.draft([5, 7, 9], 6, out)
    assert seen == [[5, 7, 9]]  # the features of the position that emitted the pending token
    manual, head = [], TextHead(w)
    tok, p = head.first(h, 9)
    for _ in range(6):
        manual.append((tok, p))
        tok, p = head.next(tok)
    want = next((j + 1 for j, (_, p) in enumerate(manual) if p < stop_below), 6)
    assert c == want and out[:c].tolist() == [t for t, _ in manual[:c]]
    if stop_below:
        assert c < 6  # this seed's chain has an unsure proposal: the test exercised the stop
    prop = draft.propose([[5, 7, 9]], 6, None, np.ones(1, bool))
    assert prop.counts.tolist() == [c] and prop.tokens[0, :c].tolist() == out[:c].tolist()


def test_distillation_learns_a_simple_target_and_validation_counts_by_position():
    """Synthetic 'target': the next hidden state is the embedding of the next token, and its greedy choice
    after a position is argmax(h . lm): the head must learn to propose it; validation counts positions."""
    pytest.importorskip("torch", reason="the distillation needs the export extra (torch)")
    from edgespec.export.training.train_text_head import HeadConfig, train

    rng = np.random.default_rng(0)
    embed = rng.normal(0, 1, (V, E)).astype(np.float32)
    lm = embed.copy()
    n, t = 24, 40
    ids = np.zeros((n, t), np.int64)
    ids[:, 0] = rng.integers(0, V, n)
    for j in range(1, t):  # a deterministic language: the next token is (3 x + 1) mod V
        ids[:, j] = (3 * ids[:, j - 1] + 1) % V
    hidden = embed[ids]  # h_j reads token j
    greedy = (3 * ids + 1) % V  # the 'target' continues the language
    data = {"ids": ids, "hidden": hidden.astype(np.float16), "greedy": greedy}
    cfg = HeadConfig(hidden=64, vocab=V, seq_len=t, train_seqs=n, val_seqs=n, block=8, unroll=2, epochs=30,
                     batch=64, lr=1e-2)
    w, report = train(data, data, embed, lm, cfg, progress=False)
    acc = report["acceptance_by_position"]
    assert acc[0] > 0.9 and acc[1] > 0.8, report
    assert report["tried_by_position"][0] >= report["tried_by_position"][-1] > 0


def test_distillation_ignores_positions_past_a_sequence_end():
    """data["valid"] (a FAST chunk ends at END): what lies past a row's end is neither a label nor a regression
    target, so filling it with different garbage trains the same head, and the language is still learnt."""
    pytest.importorskip("torch", reason="the distillation needs the export extra (torch)")
    from edgespec.export.training.train_text_head import HeadConfig, train

    rng = np.random.default_rng(1)
    embed = rng.normal(0, 1, (V, E)).astype(np.float32)
    n, t = 24, 16
    ids = np.zeros((n, t), np.int64)
    ids[:, 0] = rng.integers(0, V, n)
    for j in range(1, t):
        ids[:, j] = (3 * ids[:, j - 1] + 1) % V
    valid = np.arange(t)[None] < rng.integers(4, t, n)[:, None]  # (n, t): each row ends somewhere
    cfg = HeadConfig(hidden=32, vocab=V, seq_len=t, train_seqs=n, val_seqs=n, block=8, unroll=2, epochs=20,
                     batch=32, lr=1e-2)
    heads = []
    for seed in (2, 3):
        junk = np.random.default_rng(seed)
        data = {"ids": np.where(valid, ids, junk.integers(0, V, ids.shape)),
                "hidden": np.where(valid[..., None], embed[ids], junk.normal(0, 5, (n, t, E))).astype(np.float16),
                "greedy": np.where(valid, (3 * ids + 1) % V, junk.integers(0, V, ids.shape)), "valid": valid}
        heads.append(train(data, data, embed, embed, cfg, progress=False, vocab=np.arange(V),
                           report=lambda w, val: {})[0])
    for name in ("w_h", "w_e", "b_in", "w_out", "b_out"):
        np.testing.assert_array_equal(getattr(heads[0], name), getattr(heads[1], name))
    from edgespec.text_head import TextHead
    head = TextHead(heads[0])
    x = 5
    tok, _ = head.first(embed[x], (3 * x + 1) % V)  # from h reading x, fed its successor
    assert tok == (3 * ((3 * x + 1) % V) + 1) % V

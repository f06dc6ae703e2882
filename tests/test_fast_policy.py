"""Policies whose decoder emits FAST tokens (policy.json "fast"): decoded until END, exactly (speculative == plain,
ids accepted after END dropped), FAST's inverse DCT un-normalised into actions, relaxed acceptance and the draft
head refused, ids that are not a whole chunk refused; the training helpers' padding and labels."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def smooth_chunks(n: int, horizon: int, dims: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, horizon)[None, :, None]
    return np.clip(rng.uniform(-0.8, 0.8, (n, 1, dims)) + rng.normal(0, 0.3, (n, 1, dims)) * t, -1, 1)


def make_tiny_fast_policy(model_dir, seed: int = 0):
    """A random-init policy model folder with FAST tokens from a small vocabulary (so END comes up often)."""
    from edgespec.actions import ActionStats
    from edgespec.export.vla_model import Pair, VLAConfig, save
    from edgespec.fast_tokens import FastTokenizer

    fast, fit = FastTokenizer.fit(smooth_chunks(400, 4, 2), scale=4.0, vocab_size=24)
    cfg = VLAConfig(hidden=64, heads=2, target_layers=2, target_inter=128, draft_layers=1, draft_inter=64,
                    keypoints=8, horizon=4, dims=2, actions="fast", fast_scale=4.0)
    cfg.n_bins, cfg.max_tokens = fast.vocab_size, 10
    torch.manual_seed(seed)
    pair = Pair(cfg)
    with torch.no_grad():
        for p in pair.target.lm_head.parameters():
            p.mul_(20)
        # END takes over one token's row (slightly larger): it ends a chunk wherever that token would have come
        w = pair.target.lm_head.weight
        w[fast.end_id] = w[fast.vocab_size - 6] * 1.05
    save(pair, cfg, ActionStats([-0.5, -1.0], [0.5, 1.0]), model_dir, {"note": "random init, for tests"}, fast)
    return fast


@pytest.fixture(scope="module")
def fast_policies(tmp_path_factory):
    """'plain' (random target + random draft) and 'self' (the target as its own draft: every draft accepted, so
    a round runs past END)."""
    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("fast")
    fast = make_tiny_fast_policy(root / "model")
    export_policy(root / "model", root / "plain", progress=False)
    shutil.rmtree(root / "model" / "draft")
    shutil.copytree(root / "model" / "target", root / "model" / "draft")
    export_policy(root / "model", root / "self", progress=False)
    return {"plain": root / "plain", "self": root / "self", "fast": fast}


def _obs(rng, pol):
    return rng.integers(0, 256, (pol.image_size, pol.image_size, 3), dtype=np.uint8), \
        rng.normal(0, 1, pol.state_dim), ["reach the red target", "go to the blue target"][int(rng.integers(2))]


def test_speculative_equals_plain_until_end(fast_policies):
    from edgespec import load_policy
    end = fast_policies["fast"].end_id
    plain = load_policy(fast_policies["plain"])
    drafts = [load_policy(fast_policies["plain"], draft=True, gamma=4, stop_below=0.0),
              load_policy(fast_policies["self"], draft=True, gamma=4, stop_below=0.0)]
    assert plain.max_tokens == 10 and plain.fast is not None
    rng = np.random.default_rng(1)
    ended = 0
    for _ in range(12):
        img, state, instr = _obs(rng, plain)
        prefix = plain.encode(img, state, instr)
        want, _ = plain.decode_ids(prefix)
        assert want == plain.reference_ids(prefix)  # cached rounds == whole-sequence decoding
        assert (end in want and want.index(end) == len(want) - 1) or (end not in want and len(want) == 10)
        ended += end in want
        for d in drafts:
            got, info = d.decode_ids(prefix)
            assert got == want
    assert ended >= 3  # the END path ran (a self-draft's round runs past it, and those ids are dropped)


def test_actions_are_the_inverse_dct_unnormalised(fast_policies):
    from edgespec import load_policy
    pol = load_policy(fast_policies["plain"])
    fast = pol.fast
    chunk = smooth_chunks(1, 4, 2, seed=7)[0]
    ids = fast.encode(chunk) + [fast.end_id]
    got = pol.ids_to_actions(ids)
    want = pol.tok.stats.unnormalize(fast.C.T @ (fast.coefficients(ids) / fast.scale))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert np.abs(got - pol.tok.stats.unnormalize(chunk)).max() <= fast.error_bound * 1.0 + 1e-9
    with pytest.raises(ValueError, match=r"emitted \d+ FAST tokens without the END token"):
        pol.ids_to_actions(ids[:-1])
    with pytest.raises(ValueError, match=r"FAST ids decode to \d+ coefficients; a chunk is 4 x 2 = 8"):
        pol.ids_to_actions(ids[:1] + [fast.end_id])
    rng = np.random.default_rng(3)
    for _ in range(6):  # random weights: a chunk either decodes or is refused by name, never clipped or padded
        img, state, instr = _obs(rng, pol)
        try:
            a = pol.act(img, state, instr)
        except ValueError as e:
            assert "FAST" in str(e)
        else:
            assert a.shape == (4, 2) and np.isfinite(a).all()


def test_relaxed_and_the_draft_head_are_refused(fast_policies):
    from edgespec import load_policy
    with pytest.raises(ValueError, match="a FAST id is a BPE piece of DCT coefficients"):
        load_policy(fast_policies["plain"], draft=True, mode="relaxed")
    with pytest.raises(ValueError, match="emits FAST tokens, so draft with its decoder"):
        load_policy(fast_policies["plain"], draft="head")


def test_policy_json_checks_the_fast_tokenizer(fast_policies, tmp_path):
    from edgespec import load_policy
    from edgespec.policy_contract import PolicyFileError, PolicyManifest
    meta = json.loads((fast_policies["plain"] / "policy.json").read_text())
    with pytest.raises(PolicyFileError, match="fast: expected null, or an object"):
        PolicyManifest.from_dict({**meta, "vocab_end": meta["vocab_end"] + 1}, tmp_path / "policy.json")
    bad = tmp_path / "edited"
    shutil.copytree(fast_policies["plain"], bad)
    f = bad / "fast_tokenizer.json"
    f.write_text(f.read_text().replace('"scale": 4.0', '"scale": 5.0'))
    with pytest.raises(Exception, match="does not match the sha256"):
        load_policy(bad)


def test_training_ids_and_labels():
    from edgespec.export.training.train_vla import IGNORE, fast_ids
    from edgespec.fast_tokens import FastTokenizer
    chunks = smooth_chunks(50, 4, 2)
    fast, fit = FastTokenizer.fit(chunks, scale=4.0, vocab_size=24)
    ids, labels = fast_ids(fast, chunks[:5], fit.tokens_per_chunk_max + 1)
    for i in range(5):
        t = fast.encode(chunks[i]) + [fast.end_id]
        assert list(labels[i, :len(t)]) == t and (labels[i, len(t):] == IGNORE).all()
        assert (ids[i, len(t):] == fast.end_id).all()
    with pytest.raises(ValueError, match="takes .* FAST tokens with END; the policy allows 1"):
        fast_ids(fast, chunks[:1], 1)

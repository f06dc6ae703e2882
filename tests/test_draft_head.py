"""The numpy draft head: fast path vs the training formula, torch parity, weights I/O, and speculative
decoding with it inside a policy (exact = plain; fused first round; fast = generic round)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import assert_fast_path_matches_reference, policy_obs, random_draft_head
from edgespec.draft_head import DraftHead, DraftHeadWeights, head_features
from edgespec.policy import Policy, load_policy

P, E, N, H, D = 5, 8, 40, 4, 2


@pytest.fixture
def head():
    return DraftHead(random_draft_head(P, E, N, H, D, radius=6, seed=1))


def test_features_never_read_the_current_or_later_ids():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, N, (3, H * D))
    f = head_features(ids, D, N, 6)
    for t in range(H * D):
        other = ids.copy()
        other[:, t:] = rng.integers(0, N, other[:, t:].shape)
        g = head_features(other, D, N, 6)
        for k in f:
            assert (f[k][:, t] == g[k][:, t]).all(), (k, t)
    # the first position sees only "start"/"none"; velocities are clipped to the head's radius
    assert f["prev"][0, 0] == N and f["vel"][0, 2 * D] == np.clip(ids[0, D] - ids[0, 0], -6, 6) + 6


def test_next_matches_the_reference_formula(head):
    """next() = the argmax and its probability of the teacher-forced formula (reference_logits), over the
    bins a step can reach (steps -R..R from ids[t-D] that land on a bin)."""
    rng = np.random.default_rng(2)
    prefix = rng.normal(0, 1, (1, P, E)).astype(np.float32)
    head.start(prefix)
    for trial in range(5):
        ids = rng.integers(0, N, H * D)
        ref_abs, ref_rel = head.reference_logits(prefix, ids)
        for t in range(H * D):
            tok, p = head.next(list(ids[:t]))
            lg = np.full(N, -np.inf)
            if t < D:
                lg[:] = ref_abs[t]
            else:
                steps = np.arange(-6, 7)
                ok = (ids[t - D] + steps >= 0) & (ids[t - D] + steps < N)
                lg[ids[t - D] + steps[ok]] = ref_rel[t - D][ok]
            assert tok == int(np.argmax(lg))
            z = lg[np.isfinite(lg)] - lg.max()
            assert p == pytest.approx(1.0 / np.exp(z).sum(), rel=1e-5)


def test_numpy_head_matches_the_torch_head_it_was_trained_as():
    torch = pytest.importorskip("torch", reason="the torch parity check needs the export extra (torch)")
    from edgespec.export.training.train_draft_head import build_head
    torch.manual_seed(0)
    th = build_head(P, E, N, H, D, hidden=16, radius=6)
    w = DraftHeadWeights.from_torch(th, dims=D, horizon=H, radius=6)
    rng = np.random.default_rng(3)
    prefix = rng.normal(0, 1, (2, P, E)).astype(np.float32)
    ids = rng.integers(0, N, (2, H * D))
    with torch.no_grad():
        la, lr = th(torch.from_numpy(prefix), torch.from_numpy(ids))
    for b in range(2):
        ra, rr = DraftHead(w).reference_logits(prefix[b:b + 1], ids[b])
        np.testing.assert_allclose(ra, la[b].numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rr, lr[b].numpy(), rtol=1e-4, atol=1e-5)
    # the training report's agreement is the numpy head's own teacher-forced argmax agreement (steps that
    # would leave the bins do not count as the head's pick)
    from edgespec.export.training.train_draft_head import agreement
    acc, head = agreement(th, prefix, ids, D, 6, N), DraftHead(w)
    for t in range(H * D):
        hits = []
        for b in range(2):
            head.start(prefix[b:b + 1])
            hits.append(head.next(list(ids[b, :t]))[0] == ids[b, t])
        assert acc[t] == pytest.approx(np.mean(hits)), t


def test_weights_round_trip_and_clear_errors(tmp_path):
    w = random_draft_head(P, E, N, H, D)
    w.save(tmp_path / "h.npz")
    back = DraftHeadWeights.load(tmp_path / "h.npz")
    assert (back.dims, back.horizon, back.radius) == (D, H, w.radius)
    np.testing.assert_array_equal(back.rel_w, w.rel_w.astype(np.float16).astype(np.float32))
    assert back.rel_w.dtype == np.float32
    with pytest.raises(ValueError, match="do not fit together.*fc2_w"):
        DraftHeadWeights(**{**back.__dict__, "fc2_w": np.zeros((3, 3), np.float32)})
    with pytest.raises(FileNotFoundError, match="no draft head weights"):
        DraftHeadWeights.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "bad.npz", ctx_w=np.zeros(3))
    with pytest.raises(ValueError, match="is not a draft head: missing"):
        DraftHeadWeights.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match=r"prefix has 6 values; this draft head was trained on 40"):
        DraftHead(back).start(np.zeros((1, 2, 3), np.float32))


# -- inside a policy -------------------------------------------------------------------------------------
obs = policy_obs


@pytest.mark.parametrize("gamma, stop_below", [(1, 0.0), (4, 0.0), (11, 0.0), (11, 0.5), (3, 0.9)])
def test_head_speculative_greedy_gives_exactly_the_plain_actions(tiny_policies, gamma, stop_below):
    plain = load_policy(tiny_policies["plain"])
    spec = load_policy(tiny_policies["plain"], draft="head", gamma=gamma, stop_below=stop_below)
    for seed in range(4):
        a = plain.act(*obs(seed))
        b = spec.act(*obs(seed))
        np.testing.assert_array_equal(a, b)
        info = spec.last_info
        n = spec.horizon * spec.dims
        assert info["rounds"] >= 1 and info["accepted"] + info["rounds"] <= n <= info["accepted"] + info["target_calls"]
        assert info["max_dev_bins"] == 0
        if stop_below == 0:
            assert info["draft_calls"] == info["drafted"]


@pytest.mark.parametrize("mode, radius, gamma, stop_below", [("greedy", 0, 1, 0.0), ("greedy", 0, 5, 0.0),
                                                             ("greedy", 0, 11, 0.6), ("relaxed", 3, 4, 0.0),
                                                             ("relaxed", 200, 11, 0.0), ("relaxed", 2, 6, 0.5)])
def test_head_fast_rounds_match_the_generic_round(tiny_policies, mode, radius, gamma, stop_below):
    pol = load_policy(tiny_policies["plain"], draft="head", mode=mode, radius=radius, gamma=gamma,
                      stop_below=stop_below)
    assert_fast_path_matches_reference(pol, range(4))


def test_fused_first_round_accepts_everything_with_a_huge_radius(tiny_policies):
    """radius 255 keeps every draft: the whole chunk comes from one prefill + drafts (one target
    call), proving the fused prefill reads prefix + drafts and commits the cache correctly."""
    pol = load_policy(tiny_policies["plain"], draft="head", mode="relaxed", radius=255, gamma=32, stop_below=0.0)
    n = pol.horizon * pol.dims
    pol.act(*obs(0))
    assert pol.last_info["target_calls"] == 1 and pol.last_info["accepted"] == n - 1
    assert pol.target.cache.lengths[0] == pol.prefix_len + n - 1


def test_head_bad_folders_are_refused(tiny_policies, tmp_path):
    from edgespec.contract import EngineError
    d = tmp_path / "nohead"
    shutil.copytree(tiny_policies["plain"], d)
    (d / "draft_head.npz").unlink()
    with pytest.raises(FileNotFoundError, match="has no draft head"):
        load_policy(d, draft="head")
    t = tmp_path / "tampered"
    shutil.copytree(tiny_policies["plain"], t)
    with open(t / "draft_head.npz", "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineError, match="draft_head.npz does not match the sha256"):
        load_policy(t, draft="head")
    w = tmp_path / "wrongshape"
    shutil.copytree(tiny_policies["plain"], w)
    meta = json.loads((w / "policy.json").read_text())
    random_draft_head(meta["prefix_len"], 64, 256, 2, meta["dims"]).save(w / "draft_head.npz")
    meta.pop("draft_head_sha256")
    (w / "policy.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="draft head is for 2x3 chunks, the policy emits 4x3"):
        Policy(w, draft="head", check_hashes=False)  # policy.json edited: past its content hash


def test_draft_length_defaults_follow_the_draft_kind(tiny_policies):
    from edgespec.policy import DRAFT_DEFAULTS
    for draft, kind in (("head", "head"), (True, "decoder"), (False, None)):
        cfg = load_policy(tiny_policies["plain"], draft=draft).cfg
        assert (cfg.gamma, cfg.stop_below) == DRAFT_DEFAULTS[kind]
    cfg = load_policy(tiny_policies["plain"], draft="head", gamma=3, stop_below=0.0).cfg
    assert (cfg.gamma, cfg.stop_below) == (3, 0.0)
    with pytest.raises(ValueError, match=r"stop_below must be a probability in \[0, 1\), got 1.5"):
        load_policy(tiny_policies["plain"], draft="head", stop_below=1.5)


def test_cached_head_data_is_keyed_by_the_policy_it_came_from(tiny_policies, tmp_path):
    """A retrained target must not reuse the previous target's cached chunks (robots/demos.write_on_policy)."""
    from edgespec.robots.demos import policy_key
    a = policy_key(tiny_policies["plain"])
    c = tmp_path / "copy"
    shutil.copytree(tiny_policies["plain"], c)
    assert policy_key(c) == a and len(a) == 12
    model = c / "target" / json.loads((c / "target" / "engine.json").read_text())["model_file"]
    with open(model, "ab") as f:
        f.write(b"\0")
    assert policy_key(c) != a

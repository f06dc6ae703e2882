"""VLA policy runtime: encoder + action-token decoding, exact and relaxed speculative acceptance, bad input."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import assert_fast_path_matches_reference, make_tiny_policy, policy_obs
from edgespec.policy import PolicyConfig, load_policy
from edgespec.speculative import accept_relaxed


obs = policy_obs


def declare_action_semantics(model_dir, dims: int) -> None:
    """make_tiny_policy writes the reacher's semantics (2 action names) whatever dims is: name D of them."""
    meta = json.loads((model_dir / "policy.json").read_text())
    meta.update(action_kind="joint_position", action_names=[f"joint{j}.position" for j in range(dims)],
                action_units=["rad"] * dims)
    (model_dir / "policy.json").write_text(json.dumps(meta))


def rehash(folder) -> None:
    """Record the content hash of an edited policy.json / action_stats.json, as a re-export would."""
    from edgespec.contract import file_sha256
    from edgespec.policy_contract import CONTENT_HASH, policy_content_sha256
    meta = json.loads((folder / "policy.json").read_text())
    meta["action_stats_sha256"] = file_sha256(folder / "action_stats.json")
    meta[CONTENT_HASH] = policy_content_sha256(meta)
    (folder / "policy.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def tiny_policies(tmp_path_factory):
    """Exported policy folders (conftest's tiny_policies, with D = 3 action names): 'plain' (random target
    + random draft) and 'self' (the target as its own draft, so every greedy draft is accepted)."""
    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("policies")
    declare_action_semantics(root / "model", make_tiny_policy(root / "model").dims)
    export_policy(root / "model", root / "plain", progress=False)
    shutil.rmtree(root / "model" / "draft")
    shutil.copytree(root / "model" / "target", root / "model" / "draft")
    export_policy(root / "model", root / "self", progress=False)
    return {"plain": root / "plain", "self": root / "self", "model": root / "model"}


# -- the acceptance rule ---------------------------------------------------------------------------------
def one_hot_logits(choices, v=16):
    lg = np.full((len(choices), v), -5.0, np.float32)
    lg[np.arange(len(choices)), choices] = 5.0
    return lg


def target_choice(lg, lo, hi):  # what the engine's next_ids gives: the argmax over the action ids lo..hi-1
    return lg[:, lo:hi].argmax(-1) + lo


def test_accept_relaxed_keeps_drafts_within_radius_and_returns_target_choice():
    lg = target_choice(one_hot_logits([10, 10, 10, 10]), 0, 16)  # target wants 10 at every position
    d = np.array([10, 12, 7, 10])
    assert accept_relaxed(d[:3], lg, 0, 16, np.array([0, 0, 0])) == (1, 10)  # exact: stops at 12
    assert accept_relaxed(d[:3], lg, 0, 16, np.array([2, 2, 2])) == (2, 10)  # 12 within 2, 7 is 3 away
    assert accept_relaxed(d[:3], lg, 0, 16, np.array([3, 3, 3])) == (3, 10)  # all kept: bonus from position 3
    assert accept_relaxed(d[:3], lg, 0, 16, np.array([3, 0, 3])) == (1, 10)  # a binary dim is never relaxed


def test_accept_relaxed_never_relaxes_non_action_tokens_and_constrains_the_choice():
    lg = target_choice(one_hot_logits([3, 12, 12], v=16), 8, 16)  # position 0: the argmax (3) is not an action id
    # constrained to the action ids 8..15, position 0's choice is 8 (all tied, the first): 9 is 1 bin away
    assert accept_relaxed(np.array([9, 12]), lg, 8, 16, np.array([9, 9])) == (2, 12)
    assert accept_relaxed(np.array([9]), lg, 8, 16, np.array([0])) == (0, 8)
    k, nxt = accept_relaxed(np.array([5]), lg[1:], 8, 16, np.array([100]))  # 5 is not an action id
    assert (k, nxt) == (0, 12)


# -- the policy ------------------------------------------------------------------------------------------
def test_plain_decoding_matches_the_uncached_reference(tiny_policies):
    pol = load_policy(tiny_policies["plain"])
    for seed in range(3):
        pre = pol.encode(*obs(seed))
        ids, info = pol.decode_ids(pre)
        assert ids == pol.reference_ids(pre)
        assert info["target_calls"] == pol.horizon * pol.dims


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_speculative_greedy_gives_exactly_the_plain_actions(tiny_policies, gamma):
    plain = load_policy(tiny_policies["plain"])
    spec = load_policy(tiny_policies["plain"], draft=True, gamma=gamma)
    for seed in range(4):
        a = plain.act(*obs(seed))
        b = spec.act(*obs(seed))
        assert a.shape == (plain.horizon, plain.dims)
        np.testing.assert_array_equal(a, b)
        assert spec.last_info["rounds"] >= 1 and spec.last_info["max_dev_bins"] == 0


def test_identical_draft_is_always_accepted(tiny_policies):
    spec = load_policy(tiny_policies["self"], draft=True, gamma=5, stop_below=0.0)
    plain = load_policy(tiny_policies["self"])
    a = spec.act(*obs(1))
    np.testing.assert_array_equal(a, plain.act(*obs(1)))
    info, n = spec.last_info, spec.horizon * spec.dims
    assert info["accepted"] == info["drafted"]
    assert info["rounds"] == -(-(n - 1) // 6)  # 11 tokens after the first, 6 per round (5 drafts + bonus)


def test_relaxed_accepts_more_and_stays_within_radius(tiny_policies):
    exact = load_policy(tiny_policies["plain"], draft=True, gamma=4, stop_below=0.0)
    wide = load_policy(tiny_policies["plain"], draft=True, gamma=4, stop_below=0.0, mode="relaxed", radius=200)
    acc_e = acc_w = 0
    for seed in range(4):
        exact.act(*obs(seed))
        wide.act(*obs(seed))
        acc_e += exact.last_info["accepted"]
        acc_w += wide.last_info["accepted"]
        assert wide.last_info["max_dev_bins"] <= 200
    assert acc_w > acc_e
    r5 = load_policy(tiny_policies["plain"], draft=True, mode="relaxed", radius=5)
    r5.act(*obs(0))
    assert r5.last_info["max_dev_bins"] <= 5
    # the bound in action units: 5 bins of (q99 - q01) / 255 per dimension (stats: [-1,1], [-2,2], [0,1])
    np.testing.assert_allclose(r5.worst_case_deviation(), 5 * np.array([2.0, 4.0, 1.0]) / 255)


def test_binary_dimensions_are_never_relaxed(tiny_policies, tmp_path):
    d = tmp_path / "binary"
    shutil.copytree(tiny_policies["plain"], d)
    meta = json.loads((d / "policy.json").read_text())
    meta["binary_dims"] = [2]
    (d / "policy.json").write_text(json.dumps(meta))
    rehash(d)
    pol = load_policy(d, draft=True, mode="relaxed", radius=50)
    r = pol._radius[:pol.horizon * pol.dims].reshape(pol.horizon, pol.dims)
    assert (r[:, 2] == 0).all() and (r[:, :2] == 50).all()
    assert pol.worst_case_deviation()[2] == 0.0


# -- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (lambda o: (o[0][:32], o[1], o[2]), r"image must be \(64, 64, 3\) uint8"),
    (lambda o: (o[0].astype(np.float32), o[1], o[2]), r"uint8 RGB, got \(64, 64, 3\) float32"),
    (lambda o: (o[0], np.array([np.nan, 0, 0, 0, 0, 0]), o[2]), "NaN"),
    (lambda o: (o[0], o[1][:4], o[2]), r"state must have shape \(6,\)"),
    (lambda o: (o[0], o[1], "reach the purple target"), r"unknown words \['purple'\]"),
    (lambda o: (o[0], o[1], ""), "non-empty string"),
])
def test_bad_observations_get_clear_errors(tiny_policies, bad, match):
    pol = load_policy(tiny_policies["plain"])
    with pytest.raises(ValueError, match=match):
        pol.act(*bad(obs(0)))


def test_statistics_that_do_not_match_the_policy_are_refused(tiny_policies, tmp_path):
    d = tmp_path / "stats"
    shutil.copytree(tiny_policies["plain"], d)
    (d / "action_stats.json").write_text(json.dumps({"q01": [0, 0], "q99": [1, 1]}))
    rehash(d)
    with pytest.raises(ValueError, match="has 2 dimensions but the policy emits 3"):
        load_policy(d)


def test_policy_config_and_folder_errors(tmp_path, tiny_policies):
    with pytest.raises(ValueError, match="mode must be one of"):
        PolicyConfig(mode="lossy")
    with pytest.raises(ValueError, match="radius must be an integer >= 0"):
        PolicyConfig(radius=-1)
    with pytest.raises(FileNotFoundError, match="not a policy folder"):
        load_policy(tmp_path)
    d = tmp_path / "nodraft"
    shutil.copytree(tiny_policies["plain"], d)
    shutil.rmtree(d / "draft")
    with pytest.raises(FileNotFoundError, match="has no draft/"):
        load_policy(d, draft=True)


def test_tampered_encoder_is_refused(tiny_policies, tmp_path):
    from edgespec.contract import EngineError
    d = tmp_path / "tampered"
    shutil.copytree(tiny_policies["plain"], d)
    with open(d / "encoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineError, match="does not match the sha256"):
        load_policy(d)


@pytest.mark.parametrize("mode, radius, gamma, stop_below", [
    ("greedy", 0, 1, 0.0), ("greedy", 0, 4, 0.0), ("relaxed", 3, 3, 0.0), ("relaxed", 200, 5, 0.0),
    ("greedy", 0, 8, 0.0), ("greedy", 0, 8, 0.5), ("greedy", 0, 11, 0.95), ("relaxed", 3, 6, 0.7)])
def test_fast_round_matches_the_generic_speculative_round(tiny_policies, mode, radius, gamma, stop_below):
    """Also with a dynamic draft length (stop_below): the draft stops after an unsure proposal."""
    for name in ("plain", "self"):
        pol = load_policy(tiny_policies[name], draft=True, mode=mode, radius=radius, gamma=gamma,
                          stop_below=stop_below)
        assert_fast_path_matches_reference(pol, range(3))

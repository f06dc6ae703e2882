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


def observations(policy: dict, n: int, seed: int) -> dict:
    """n synthetic observations as batched arrays: image (n, S, S, 3), state (n, N), instr (n, L)."""
    from edgespec.export.vla import example_inputs
    obs = example_inputs(policy, n, seed=seed)
    return {k: np.concatenate([o[i] for o in obs]) for i, k in enumerate(("image", "state", "instr"))}


def train_tiny_feature_head(model_dir):
    """A feature head distilled (train_feature_head's data and train_text_head's training) from the tiny policy's
    own greedy chunks on synthetic observations."""
    from edgespec.export.training.train_feature_head import greedy_chunks, load_policy_model, report_for
    from edgespec.export.training.train_text_head import HeadConfig, train
    model = load_policy_model(model_dir)
    groups, target, _, ids_range, end, n = model
    policy = json.loads((model_dir / "policy.json").read_text())
    data = greedy_chunks(groups, target, observations(policy, 400, seed=5), ids_range, end, n)
    embed = target.get_input_embeddings().weight.detach().numpy()
    lm = target.lm_head.weight.detach().numpy()
    cfg = HeadConfig(hidden=64, seq_len=n + 1, unroll=3, epochs=12, batch=128, lr=5e-3)
    vocab = np.unique(data["greedy"][data["valid"]])
    w, report = train(data, data, embed, lm, cfg, progress=False, vocab=vocab, report=report_for((3,)))
    w.save(model_dir / "feature_head.npz")
    return model


@pytest.fixture(scope="module")
def fast_policies(tmp_path_factory):
    """'plain' (random target + random draft), 'self' (the target as its own draft: every draft accepted, so
    a round runs past END) and 'head' (a feature head distilled from the target; the target outputs its hidden
    state)."""
    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("fast")
    fast = make_tiny_fast_policy(root / "model")
    export_policy(root / "model", root / "plain", progress=False)
    shutil.rmtree(root / "model" / "draft")
    shutil.copytree(root / "model" / "target", root / "model" / "draft")
    export_policy(root / "model", root / "self", progress=False)
    model = train_tiny_feature_head(root / "model")
    export_policy(root / "model", root / "head", progress=False)
    return {"plain": root / "plain", "self": root / "self", "head": root / "head", "fast": fast, "model": model,
            "model_dir": root / "model"}


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


def test_relaxed_and_a_missing_feature_head_are_refused(fast_policies):
    from edgespec import load_policy
    with pytest.raises(ValueError, match="a FAST id is a BPE piece of DCT coefficients"):
        load_policy(fast_policies["plain"], draft=True, mode="relaxed")
    with pytest.raises(ValueError, match="a FAST id is a BPE piece of DCT coefficients"):
        load_policy(fast_policies["head"], draft="head", mode="relaxed")
    with pytest.raises(FileNotFoundError, match="this FAST policy folder has no feature head .*train_feature_head"):
        load_policy(fast_policies["plain"], draft="head")


def test_a_fast_policys_head_takes_its_own_draft_defaults(fast_policies):
    """draft="head" on a FAST policy is its feature head, with the FAST head's γ and stop (short runs, no stop),
    not the bins head's long runs; given values still win."""
    from edgespec import load_policy
    from edgespec.policy import DRAFT_DEFAULTS
    assert DRAFT_DEFAULTS["fast-head"] != DRAFT_DEFAULTS["head"]
    for draft in ("head", "feature-head"):
        p = load_policy(fast_policies["head"], draft=draft)
        assert (p.cfg.gamma, p.cfg.stop_below) == DRAFT_DEFAULTS["fast-head"]
        assert p._head_draft.stop_below == DRAFT_DEFAULTS["fast-head"][1]
    p = load_policy(fast_policies["head"], draft="head", gamma=2, stop_below=0.5)
    assert (p.cfg.gamma, p.cfg.stop_below, p._head_draft.stop_below) == (2, 0.5, 0.5)


def test_feature_head_drafts_from_the_targets_hidden_state_exactly(fast_policies):
    """draft="head" on a FAST policy: the feature head reads the target engine's hidden state at the row that
    emitted the chunk's last id. Its ids equal plain decoding's, and its drafted and accepted counts equal a
    replay of the same rounds on the torch target's hidden states (train_feature_head.replay_rounds): a head fed
    another row's hidden state proposes other tokens."""
    from edgespec import load_policy
    from edgespec import policy_contract as PC
    from edgespec.export.training.train_feature_head import greedy_chunks, replay_rounds
    from edgespec.text_head import TextHead
    groups, target, _, ids_range, end, n = fast_policies["model"]
    meta = json.loads((fast_policies["model_dir"] / "policy.json").read_text())
    plain = load_policy(fast_policies["head"])
    assert plain.target.caps.hidden  # exported --hidden for its head
    obs = observations(meta, 12, seed=9)
    want = greedy_chunks(groups, target, obs, ids_range, end, n)
    head = TextHead.load(fast_policies["head"] / "feature_head.npz")
    for gamma in (1, 3):
        spec = load_policy(fast_policies["head"], draft="head", gamma=gamma, stop_below=0.0)
        drafted = accepted = 0
        for i in range(12):
            # the encoder engine on the observation's word ids (synthetic: not always a sentence)
            feeds = {PC.ENC_IMAGE: obs["image"][i:i + 1], PC.ENC_STATE: obs["state"][i:i + 1].astype(np.float32),
                     PC.ENC_INSTRUCTION: obs["instr"][i:i + 1]}
            prefix = plain.encoder.run([PC.ENC_PREFIX], feeds)[0]
            ids, _ = plain.decode_ids(prefix)
            got, info = spec.decode_ids(prefix)
            assert got == ids == want["ids"][i, 1:1 + want["valid"][i].sum()].tolist()
            drafted, accepted = drafted + info["drafted"], accepted + info["accepted"]
        replay = replay_rounds(head, want, gamma)
        assert (drafted, accepted) == (replay["drafted"], replay["accepted"])
        assert accepted > 0.3 * drafted  # the head is trained: the comparison above is not 0 == 0


def test_policy_json_checks_the_fast_tokenizer(fast_policies, tmp_path):
    from edgespec import load_policy
    from edgespec.policy_contract import PolicyFileError, PolicyManifest
    meta = json.loads((fast_policies["plain"] / "policy.json").read_text())
    with pytest.raises(PolicyFileError, match="fast: expected null, or an object"):
        PolicyManifest.from_dict({**meta, "vocab_end": meta["vocab_end"] + 1}, tmp_path / "policy.json")
    with pytest.raises(PolicyFileError, match="feature_head_sha256: expected null unless the policy emits FAST tokens or reads a prompt"):
        PolicyManifest.from_dict({**meta, "fast": None, "feature_head_sha256": "0" * 64}, tmp_path / "policy.json")
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


def test_a_feature_head_that_does_not_fit_is_refused_at_export(fast_policies, tmp_path, capsys):
    """export-policy refuses a feature head in a bins policy's folder, and one trained on another target, by name;
    train_feature_head refuses a bins policy's folder."""
    from conftest import random_text_head

    from edgespec.actions import ActionStats
    from edgespec.export.vla import export_policy
    from edgespec.export.vla_model import Pair, VLAConfig, save
    cfg = VLAConfig(hidden=64, heads=2, target_layers=1, target_inter=128, draft_layers=1, draft_inter=64,
                    keypoints=8, horizon=4, dims=2, n_bins=32)
    save(Pair(cfg), cfg, ActionStats([-0.5, -1.0], [0.5, 1.0]), tmp_path / "bins", {"note": "random init"})
    from edgespec.export.training.train_feature_head import main as train_feature_head
    assert train_feature_head(["--model", str(tmp_path / "bins"), "--quiet"]) == 2
    assert 'policy.json has no "fast": a feature head drafts FAST tokens' in capsys.readouterr().err
    random_text_head(64, 32).save(tmp_path / "bins" / "feature_head.npz")
    with pytest.raises(ValueError, match="a feature head drafts FAST tokens, and this policy emits bins"):
        export_policy(tmp_path / "bins", tmp_path / "out-bins", progress=False)
    fast_model = tmp_path / "fast"
    shutil.copytree(fast_policies["model_dir"], fast_model)
    random_text_head(64, 40).save(fast_model / "feature_head.npz")  # the target's table is (24, 64)
    with pytest.raises(ValueError, match=r"trained on a target with a \(40, 64\) embedding table"):
        export_policy(fast_model, tmp_path / "out-fast", progress=False)
    assert not (tmp_path / "out-bins").exists() and not (tmp_path / "out-fast").exists()


def test_last_chunk_with_the_feature_head_is_exact(fast_policies):
    """last_chunk=True on a FAST policy: its feature head reads the target's hidden state at the row that emitted
    the chunk's last id, also after a round drafted from the last chunk; a repeated chunk (END included) takes one
    target call; the ids are plain decoding's whatever the last chunk holds."""
    from edgespec import load_policy
    from edgespec.last_chunk import LastChunk
    plain = load_policy(fast_policies["head"])
    spec = load_policy(fast_policies["head"], draft="head", gamma=2, stop_below=0.0, last_chunk=True)
    rng = np.random.default_rng(4)
    prefixes = [plain.encode(*_obs(rng, plain)) for _ in range(6)]
    wants = [plain.decode_ids(p)[0] for p in prefixes]
    kept = 0
    for i, (prefix, want) in enumerate(zip(prefixes, wants)):
        other = wants[(i + 1) % len(wants)]
        for last, whole in ((want, True), (want, False), (other, True), (want[:2] + other[2:], False)):
            rec = LastChunk(tuple(last), whole)
            got, info = spec.decode_ids(prefix, last=rec)
            assert got == want == spec.decode_ids(prefix, last=rec, reference=True)[0]
            kept += info["last_chunk_kept"]
            if last == want and whole:
                assert info["target_calls"] == 1
    assert kept > 0


def test_a_real_shape_standin_decodes_the_sources_fast_ids(fast_policies, tmp_path):
    """export/vla_standin.py on a FAST policy with a feature head: the inflated policy decodes the source's ids to END,
    plain and with its widened feature head (and the last chunk), in the same target calls: its acceptance is the
    source's while its matrices are the wider shape's."""
    from edgespec import load_policy
    from edgespec.export.standin import Shape
    from edgespec.export.vla import export_policy
    from edgespec.export.vla_standin import make_vla_standin
    make_vla_standin(fast_policies["model_dir"], tmp_path / "big", shape=Shape(128, 4, 2, 32, 256, 3), progress=False)
    export_policy(tmp_path / "big", tmp_path / "e-big", progress=False)
    rng = np.random.default_rng(11)
    for kw in ({}, {"draft": "head", "gamma": 2, "stop_below": 0.0, "last_chunk": True}):
        small, big = load_policy(fast_policies["head"], **kw), load_policy(tmp_path / "e-big", **kw)
        assert big.target.m.hidden_size == 128 and big.target.m.num_layers == 3
        decoded = 0
        for _ in range(12):
            obs = _obs(rng, small)
            a, b = _act_or_refusal(small, obs), _act_or_refusal(big, obs)
            assert a[0] == b[0] and a[1] == b[1], kw  # (the actions' bytes or the refusal, target calls)
            decoded += a[1] is not None
        assert decoded >= 3, kw  # a random policy: several observations end in a refusal


def _act_or_refusal(policy, obs):
    """A random policy's ids need not decode to a whole chunk: then the refusal is the outcome compared."""
    try:
        return policy.act(*obs).tobytes(), policy.last_info["target_calls"]
    except ValueError as e:
        return str(e), None

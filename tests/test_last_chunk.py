"""The last chunk as a policy's draft (last_chunk.py): exact with every draft kind and with none, one target call
for a repeated chunk, the continuation of a partly matching chunk, the inner drafter left in step, and the
config refusing it where it means nothing."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_policy, policy_obs
from edgespec.drafts import Drafter
from edgespec.last_chunk import LastChunk, LastChunkDraft
from edgespec.policy import load_policy
from edgespec.speculation import PolicyConfig, SpeculationConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random policy (12 action ids a chunk) with a draft decoder and a draft head."""
    pytest.importorskip("torch")
    from edgespec.export.vla import export_policy
    root = tmp_path_factory.mktemp("last-chunk")
    make_tiny_policy(root / "model")
    export_policy(root / "model", root / "eng", progress=False)
    return root / "eng"


DRAFTS = [False, True, "head"]  # none, the draft decoder, the per-dimension draft head


def chunks(folder, seeds):
    plain = load_policy(folder)
    out = []
    for s in seeds:
        pre = plain.encode(*policy_obs(s))
        out.append((pre, plain.decode_ids(pre)[0]))
    return out


@pytest.mark.parametrize("draft", DRAFTS)
def test_exact_for_any_last_chunk(folder, draft):
    """Whatever the last chunk holds (the same ids, another chunk's, a chunk that matches for a while and
    then not, whole or not), the ids are plain decoding's, and the generic round agrees with the lean one."""
    pol = load_policy(folder, draft=draft, last_chunk=True, stop_below=0.0, gamma=3)
    if draft is True:  # the draft decoder keeps the prefix's rows (once it ran them) and never runs ahead
        model_draft, seen = pol.draft.draft, []

        def checked(ctx, gamma, out):
            n = int(pol.draft.decoder.cache.lengths[0])
            assert (n == 0 and pol.draft._prefix is not None) or pol.prefix_len <= n <= len(ctx), (n, len(ctx))
            seen.append(n)
            return model_draft(ctx, gamma, out)
        pol.draft.draft = checked
    cases = chunks(folder, range(4))
    n = len(cases[0][1])
    for i, (pre, want) in enumerate(cases):
        other = cases[(i + 1) % len(cases)][1]
        for last in (want, other, want[:5] + other[5:], want[:1] + other[1:]):
            for whole in (False, True):
                rec = LastChunk(tuple(last), whole)
                got, info = pol.decode_ids(pre, last=rec)
                ref, ri = pol.decode_ids(pre, last=rec, reference=True)
                assert got == ref == want, (draft, last, whole)
                for key in ("rounds", "drafted", "accepted", "target_calls", "draft_calls", "last_chunk_kept"):
                    assert info[key] == ri[key], (key, info, ri)
                assert 0 <= info["last_chunk_kept"] <= n - 1
    assert n == 12 and (draft is not True or len(seen) > 20)


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_repeated_chunk_takes_one_target_call(folder, draft):
    pol = load_policy(folder, draft=draft, last_chunk=True)
    pre, want = chunks(folder, [0])[0]
    got, info = pol.decode_ids(pre, last=LastChunk(tuple(want), True))
    assert got == want
    assert info["target_calls"] == 1 and info["last_chunk_kept"] == len(want) - 1
    assert info["draft_calls"] == 0  # the draft decoder never ran, not even on the prefix
    # the same ids, not marked repeated: the prefill is the draft's own (or plain), the rest follows the last chunk
    got, info = pol.decode_ids(pre, last=LastChunk(tuple(want), False))
    # (the prefill gives one id and may keep some of the head's; the second call keeps the rest of the last chunk)
    assert got == want and info["target_calls"] == 2 and info["accepted"] == len(want) - 2
    assert 1 <= info["last_chunk_kept"] <= len(want) - 2
    # off, or use_draft=False: the last chunk is not read
    off = load_policy(folder, draft=draft)
    assert off.decode_ids(pre, last=LastChunk(tuple(want), True))[1]["target_calls"] > 1
    plain, info = pol.decode_ids(pre, use_draft=False, last=LastChunk(tuple(want), True))
    assert plain == want and info["target_calls"] == len(want) and info["last_chunk_kept"] is None


def test_act_records_the_chunk_and_whether_it_repeated(folder):
    pol = load_policy(folder, draft="head", last_chunk=True)
    assert pol.last_chunk is None
    a = pol.act(*policy_obs(0))
    first = pol.last_chunk
    assert first.repeated is False and len(first.ids) == 12
    assert pol.last_info["last_chunk_kept"] is None  # nothing to draft from yet
    b = pol.act(*policy_obs(0))  # the same observation: the same chunk, verified from the last one
    np.testing.assert_array_equal(a, b)
    assert pol.last_chunk == LastChunk(first.ids, True) and pol.last_info["target_calls"] == 2
    c = pol.act(*policy_obs(0))
    np.testing.assert_array_equal(a, c)
    assert pol.last_info["target_calls"] == 1  # repeated: the prefill verified the whole last chunk
    pol.act(*policy_obs(1))
    assert pol.last_chunk.repeated is False


class Recorder(Drafter):
    """An inner drafter that proposes a fixed id and records what reached it."""

    def __init__(self, from_prefix=False, reads_prefill=False):
        self.from_prefix, self.reads_prefill = from_prefix, reads_prefill
        self.drafted, self.committed = [], []

    def propose(self, contexts, gamma, pick, active):
        raise AssertionError("not used")

    def draft(self, ctx, gamma, out):
        self.drafted.append(len(ctx))
        out[:gamma] = 7
        return gamma

    def commit(self, accepted):
        self.committed.append(int(accepted))


def test_drafter_rounds_and_what_the_inner_drafter_sees():
    out = np.zeros(16, np.int64)
    inner = Recorder()
    d = LastChunkDraft(inner, 3, [4, 5, 6, 9], whole=True)
    assert d.from_prefix and d.span(2) == 4
    assert d.draft([0, 0, 0], 2, out) == 4 and out[:4].tolist() == [4, 5, 6, 9]  # the prefill: all of it
    d.commit(1)
    assert d.kept == 1 and inner.committed == []  # the inner drafter drafted nothing
    assert d.draft([0, 0, 0, 4, 8], 2, out) == 2 and inner.drafted == [5]  # no longer a prefix: the inner's
    d.commit(2)
    assert inner.committed == [2]

    d = LastChunkDraft(inner, 3, [4, 5, 6, 9], whole=False)
    assert not d.from_prefix  # the prefill stays plain: the inner drafter cannot draft before it
    assert d.draft([0, 0, 0], 2, out) == 0
    assert d.draft([0, 0, 0, 4], 2, out) == 3 and out[:3].tolist() == [5, 6, 9]  # the continuation
    d.commit(3)
    assert d.kept == 3
    assert LastChunkDraft(Recorder(from_prefix=True), 3, [4], whole=False).from_prefix  # the head's prefill

    # an inner drafter that reads the prefill's rows in the round after it: no continuation round in between
    late = Recorder(reads_prefill=True)
    d = LastChunkDraft(late, 3, [4, 5, 6, 9], whole=False)
    assert d.draft([0, 0, 0, 4], 2, out) == 2 and late.drafted == [4]
    assert LastChunkDraft(None, 3, [4, 5], whole=False).draft([0, 0, 0, 8], 2, out) == 0  # no draft: plain step


def test_records_and_config_refuse_what_means_nothing():
    with pytest.raises(ValueError, match="a non-empty tuple of ints"):
        LastChunk(())
    with pytest.raises(ValueError, match="a non-empty tuple of ints"):
        LastChunk((1, 2.5))
    r = LastChunk((1, 2))
    assert r.then([1, 2]) == LastChunk((1, 2), True) and r.then([1, 3]) == LastChunk((1, 3), False)
    with pytest.raises(ValueError, match="kind 'text' decodes no chunks"):
        SpeculationConfig(last_chunk=True)
    with pytest.raises(ValueError, match="last_chunk must be True or False"):
        PolicyConfig(last_chunk=1)
    with pytest.raises(ValueError, match="offset"):
        LastChunkDraft(None, 0, [1], whole=True)


def test_the_cli_flag_reaches_the_config():
    import argparse

    from edgespec.speculation import from_args, speculation_flags
    p = argparse.ArgumentParser()
    speculation_flags(p, kind="policy")
    assert from_args(p.parse_args(["--last-chunk"]), "policy").last_chunk is True
    assert from_args(p.parse_args([]), "policy").last_chunk is False


def test_a_last_chunk_that_is_not_this_policys_is_refused(folder):
    pol = load_policy(folder, draft="head", last_chunk=True)
    pre, want = chunks(folder, [0])[0]
    with pytest.raises(TypeError, match="last must be a LastChunk .* got list"):
        pol.decode_ids(pre, last=list(want))
    lo, hi = pol.tok.first_id, pol.tok.vocab_end
    with pytest.raises(ValueError, match=rf"want at most 12 action ids in \[{lo}, {hi}\), got 12 ids, \[{hi}\] outside"):
        pol.decode_ids(pre, last=LastChunk(tuple(want[:-1]) + (hi,)))
    with pytest.raises(ValueError, match="want at most 12 action ids .* got 13 ids"):
        pol.decode_ids(pre, last=LastChunk(tuple(want) + (want[0],)))
    assert pol.decode_ids(pre, last=LastChunk(tuple(want)))[0] == want

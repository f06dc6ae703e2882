"""A robot runtime that fails safe: inputs checked as the engine sees them, NaN/inf never decoded into
actions and never left behind for the next call, one call at a time from many threads."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import policy_obs
from edgespec.policy import load_policy

DRAFTS = [False, True, "head"]  # plain, the draft decoder, the draft head


def same_as_fresh(pol, folder, draft, seeds=range(3)) -> None:
    """pol.act gives exactly what a freshly loaded policy gives for the same observations."""
    fresh = load_policy(folder, draft=draft)
    for seed in seeds:
        np.testing.assert_array_equal(pol.act(*policy_obs(seed)), fresh.act(*policy_obs(seed)))


# -- inputs as the engine sees them -------------------------------------------------------------------------
@pytest.mark.parametrize("draft", DRAFTS)
def test_state_that_overflows_float32_is_refused_by_name_and_changes_nothing(tiny_reacher_policy, draft):
    """1e39 is finite in float64 and inf in float32 (the encoder's dtype)."""
    pol = load_policy(tiny_reacher_policy, draft=draft)
    image, state, instruction = policy_obs(0)
    state = state.copy()
    state[2] = 1e39
    with pytest.raises(ValueError, match=r"joint0\.velocity = 1e\+39"):
        pol.act(image, state, instruction)
    same_as_fresh(pol, tiny_reacher_policy, draft)


def test_encoder_output_that_is_not_finite_is_refused(tiny_reacher_policy):
    pol = load_policy(tiny_reacher_policy)

    class NaNEncoder:  # an encoder whose prefix overflowed
        def run(self, names, feeds):
            return [np.full((1, pol.prefix_len, pol.target.m.hidden_size), np.nan, np.float32)]
    pol.encoder = NaNEncoder()
    with pytest.raises(FloatingPointError, match="encoder produced .* NaN/inf prefix"):
        pol.act(*policy_obs(0))


# -- NaN/inf logits: a clear error, nothing left behind --------------------------------------------------------
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN through the head
def test_nan_logits_get_a_clear_error_and_poison_no_later_call(tiny_reacher_policy, draft):
    """A prefix that makes the target's logits NaN (past the encoder's check): decoding refuses, and the
    rows that call wrote are not read by the next."""
    pol = load_policy(tiny_reacher_policy, draft=draft)
    prefix = pol.encode(*policy_obs(0))  # (1, P, E)
    bad = [np.full_like(prefix, np.nan), np.where(np.arange(prefix.shape[1])[None, :, None] == 3, np.inf, prefix)]
    if draft != "head":  # the head takes exactly P rows; the decoders also take longer ones: NaN rows past P
        bad.append(np.full((1, prefix.shape[1] + 3, prefix.shape[2]), np.nan, np.float32))
    for x in bad:
        with pytest.raises(FloatingPointError, match="NaN/inf logits"):
            pol.decode_ids(x.astype(np.float32))
    same_as_fresh(pol, tiny_reacher_policy, draft)


def test_a_failed_draft_decoder_call_poisons_no_later_call(tiny_reacher_policy):
    """The draft decoder's cache rows from a NaN call are zeroed too (Decoder._scrub_if_failed)."""
    pol = load_policy(tiny_reacher_policy, draft=True)
    prefix = pol.encode(*policy_obs(0))
    pol.draft.dec.cache.rewind_to(0)
    pol.draft.dec.run(None, embeds=np.full_like(prefix, np.nan))
    assert pol.draft.dec.last_ids().min() < 0  # the call failed
    pol.draft.dec.cache.commit(prefix.shape[1])  # even committed, the rows hold zeros, not NaN
    assert all(np.isfinite(pol.draft.dec.cache.host(j)).all() for j in range(len(pol.draft.dec.cache.buffers)))
    same_as_fresh(pol, tiny_reacher_policy, True)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN through the head
def test_nan_draft_proposals_are_harmless(tiny_reacher_policy):
    """A draft whose logits (decoder) or context (head) are NaN proposes garbage; the target verifies every
    proposal, so greedy actions are still exactly the plain ones."""
    plain = load_policy(tiny_reacher_policy)
    dec = load_policy(tiny_reacher_policy, draft=True)
    real = dec.draft.dec.last_logits
    dec.draft.dec.last_logits = lambda: np.full_like(real(), np.nan)
    head = load_policy(tiny_reacher_policy, draft="head")
    start = head.head.start
    head.head.start = lambda prefix: start(np.full_like(prefix, np.nan))
    for seed in range(3):
        want = plain.act(*policy_obs(seed))
        np.testing.assert_array_equal(dec.act(*policy_obs(seed)), want)
        np.testing.assert_array_equal(head.act(*policy_obs(seed)), want)


# -- threads --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", DRAFTS)
def test_calls_from_several_threads_give_the_single_threaded_chunks(tiny_reacher_policy, draft):
    pol = load_policy(tiny_reacher_policy, draft=draft)
    seeds = list(range(6))
    want = {s: pol.act(*policy_obs(s)) for s in seeds}
    got: dict[tuple[int, int, int], np.ndarray] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        try:
            start.wait()
            for r in range(5):
                for s in seeds[t:] + seeds[:t]:  # each thread in its own order
                    got[t, r, s] = pol.act(*policy_obs(s))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    wrong = [k for k, v in got.items() if not np.array_equal(v, want[k[2]])]
    assert not wrong, f"{len(wrong)} of {len(got)} chunks differ from the single-threaded ones"

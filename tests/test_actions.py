"""Action tokenizer: golden checks pinned to OpenVLA's formulas, and its reference code side by side."""
import numpy as np
import pytest

from edgespec.actions import ActionStats, ActionTokenizer

V = 32000  # a Llama-2-sized text vocabulary, as in OpenVLA


class OpenVLAActionTokenizer:
    """openvla/openvla prismatic/vla/action_tokenizer.py, reduced to its arithmetic (the reference)."""

    def __init__(self, vocab_size, bins=256, min_action=-1, max_action=1):
        self.vocab_size, self.min_action, self.max_action = vocab_size, min_action, max_action
        self.bins = np.linspace(min_action, max_action, bins)
        self.bin_centers = (self.bins[:-1] + self.bins[1:]) / 2.0

    def __call__(self, action):
        action = np.clip(action, a_min=float(self.min_action), a_max=float(self.max_action))
        return self.vocab_size - np.digitize(action, self.bins)

    def decode_token_ids_to_actions(self, ids):
        d = np.clip(self.vocab_size - ids - 1, a_min=0, a_max=self.bin_centers.shape[0] - 1)
        return self.bin_centers[d]


def test_bit_compatible_with_openvla():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-1.3, 1.3, 5000), np.linspace(-1, 1, 256), [-1.0, 1.0, 0.0]])
    ours, ref = ActionTokenizer(V), OpenVLAActionTokenizer(V)
    np.testing.assert_array_equal(ours.encode(x), ref(x))
    ids = rng.integers(V - 256, V, 5000)
    np.testing.assert_array_equal(ours.decode(ids), ref.decode_token_ids_to_actions(ids))


def test_255_distinct_centres_in_reversed_id_order():
    tok = ActionTokenizer(V)
    assert len(np.unique(tok.centers)) == 255
    ids = tok.encode(np.linspace(-0.999, 0.999, 1000))
    assert np.all(np.diff(ids) <= 0)  # larger action -> smaller id (the last ids, reversed)
    assert ids.min() >= V - 256 and ids.max() <= V - 1


def test_saturation_at_plus_minus_one():
    tok = ActionTokenizer(V)
    assert tok.encode([5.0]) == tok.encode([1.0]) and tok.encode([-7.0]) == tok.encode([-1.0])
    assert tok.decode(tok.encode([1.0]))[0] == pytest.approx(1 - 1 / 255)
    assert tok.decode(tok.encode([-1.0]))[0] == pytest.approx(-1 + 1 / 255)


def test_round_trip_error_is_at_most_half_a_bin():
    tok = ActionTokenizer(V)
    x = np.linspace(-1, 1, 10001)
    assert np.abs(tok.decode(tok.encode(x)) - x).max() <= (2 / 255) / 2 + 1e-12


def test_normalisation_and_mask_pass_through():
    stats = ActionStats(q01=[-0.5, 0.0, 0.0], q99=[0.5, 2.0, 1.0], mask=[True, True, False])
    tok = ActionTokenizer(V, stats=stats)
    a = np.array([[0.1, 1.5, 1.0], [-0.5, 0.0, 0.0]])
    back = tok.decode(tok.encode(a))
    assert np.abs(back[:, :2] - a[:, :2]).max() <= np.array([1.0, 2.0]).max() / 255 + 1e-9  # half a bin in units
    np.testing.assert_array_equal(stats.normalize(a)[:, 2], a[:, 2])  # unmasked dims are not normalised
    np.testing.assert_array_equal(stats.unnormalize(stats.normalize(a))[:, 2], a[:, 2])


def test_native_id_space_and_chunks():
    tok = ActionTokenizer.native(256)
    chunk = np.array([[-1.0, 0.0], [0.5, 1.0], [0.25, -0.25]])  # H=3 steps x D=2 dims
    ids = tok.encode(chunk).reshape(-1)  # time-major, as the policy decodes them
    assert ids.shape == (6,) and ids.min() >= 0 and ids.max() <= 255
    assert ids[2] == tok.encode([0.5])[0] and ids[3] == tok.encode([1.0])[0]  # time-major
    assert tok.decode_chunk(ids, 3, 2).shape == (3, 2)
    assert tok.encode([1.0])[0] == 0 and tok.encode([-1.0])[0] == 255  # the top of the range is the lowest id


def test_configurable_bins_and_offset():
    tok = ActionTokenizer(vocab_end=1000, n_bins=64)
    assert tok.first_id == 936 and len(tok.centers) == 63
    assert tok.is_action([935, 936, 999, 1000]).tolist() == [False, True, True, False]


def test_stats_file_round_trip(tmp_path):
    s = ActionStats([0, 1], [2, 3], [True, False])
    s.save(tmp_path / "stats.json")
    t = ActionStats.load(tmp_path / "stats.json")
    assert t.q01.tolist() == [0, 1] and t.mask.tolist() == [True, False]
    (tmp_path / "openvla.json").write_text('{"action": {"q01": [0], "q99": [1]}}')
    assert ActionStats.load(tmp_path / "openvla.json").mask.tolist() == [True]


@pytest.mark.parametrize("call,match", [
    (lambda: ActionStats([0, 0], [1]), "1-D of one length"),
    (lambda: ActionStats([1.0], [0.0]), "q99 < q01 for dimensions \\[0\\]"),
    (lambda: ActionTokenizer(V, stats=ActionStats([0, 0], [1, 1])).encode([0.5, 0.5, 0.5]),
     "must end in 2 dimensions .* got shape \\(3,\\)"),
    (lambda: ActionTokenizer(V).encode([np.nan]), "NaN"),
    (lambda: ActionTokenizer(V).decode([5]), "not action ids"),
    (lambda: ActionTokenizer(V).decode_chunk(np.zeros(5, int) + V - 1, 3, 2), "expected 3 x 2 = 6 ids"),
    (lambda: ActionTokenizer(10, n_bins=256), "vocab_end \\(10\\) must be >= n_bins"),
])
def test_bad_input_is_refused_clearly(call, match):
    with pytest.raises(ValueError, match=match):
        call()

"""The attention-bias builders: fast path vs the obvious reference, windows, padding, trees."""
import numpy as np
import pytest

from edgespec.contract import MASKED
from edgespec.masks import causal_bias, causal_bias_reference, tree_bias


@pytest.mark.parametrize("seed", range(20))
def test_fast_bias_equals_reference(seed):
    rng = np.random.default_rng(seed)
    b, s, p = rng.integers(1, 4), rng.integers(1, 10), rng.integers(0, 40)
    lengths = rng.integers(0, p + 1, b)
    np.testing.assert_array_equal(causal_bias(lengths, s, p), causal_bias_reference(lengths, s, p))


def test_bias_layout():
    bias = causal_bias(np.array([2]), 2, 4)[0, 0]
    ok = bias == 0
    assert ok.tolist() == [[True, True, False, False, True, False],
                           [True, True, False, False, True, True]]
    assert bias[0, 2] == MASKED


def test_sliding_window_and_padding():
    bias = causal_bias(np.array([3]), 3, 4, sliding_window=2, valid=np.array([[True, True, False]]))[0, 0] == 0
    # query 0 sits at position 3: window 2 keeps positions 2..3 (cache row 2 and itself)
    assert bias[0].tolist() == [False, False, True, False, True, False, False]
    assert bias[2, 6] and not bias[0, 6] and not bias[1, 6]  # a padded key is hidden; a padded query sees itself


def test_lengths_beyond_bound_rows_are_refused():
    with pytest.raises(ValueError, match="exceed the bound cache rows"):
        causal_bias(np.array([5]), 1, 4)


def test_tree_bias_follows_ancestors():
    bias = tree_bias(2, 3, [-1, 0, 0, 1]) == 0  # root, two children of the root, a grandchild
    new = bias[0, 0, :, 3:]
    assert new.tolist() == [[True, False, False, False], [True, True, False, False],
                            [True, False, True, False], [True, True, False, True]]
    assert bias[0, 0, :, :2].all() and not bias[0, 0, :, 2].any()

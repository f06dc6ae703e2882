"""The attention-bias builder: fast path vs the obvious reference, layout, windows, padding."""
import numpy as np
import pytest

from edgespec.contract import MASKED
from types import SimpleNamespace

from edgespec.masks import causal_bias, causal_bias_reference, step_inputs, step_inputs_into


@pytest.mark.parametrize("seed", range(20))
def test_fast_bias_equals_reference(seed):
    rng = np.random.default_rng(seed)
    b, s, extra = rng.integers(1, 4), rng.integers(1, 10), rng.integers(0, 30)
    lengths = rng.integers(0, 30, b)
    rows = int(lengths.max()) + s + extra
    np.testing.assert_array_equal(causal_bias(lengths, s, rows), causal_bias_reference(lengths, s, rows))


def test_bias_layout():
    # 2 committed rows, 2 new tokens at rows 2 and 3, 6 bound rows (4 and 5 stale)
    bias = causal_bias(np.array([2]), 2, 6)[0, 0]
    ok = bias == 0
    assert ok.tolist() == [[True, True, True, False, False, False],
                           [True, True, True, True, False, False]]
    assert bias[0, 3] == MASKED and bias[1, 5] == MASKED


def test_batch_rows_follow_each_sequence():
    ok = causal_bias(np.array([1, 3]), 1, 5)[:, 0, 0] == 0  # (B, P): each query sees its rows 0..L
    assert ok.tolist() == [[True, True, False, False, False], [True, True, True, True, False]]


def test_sliding_window_and_padding():
    bias = causal_bias(np.array([3]), 3, 7, sliding_window=2, valid=np.array([[True, True, False]]))[0, 0] == 0
    # query 0 sits at position 3: window 2 keeps positions 2..3 (cache row 2 and itself)
    assert bias[0].tolist() == [False, False, True, True, False, False, False]
    assert bias[2, 5] and not bias[0, 5] and not bias[1, 5]  # a padded key is hidden; a padded query sees itself
    assert bias[2].tolist() == [False, False, False, False, True, True, False]  # window 2 from position 5


def test_rows_too_few_for_the_new_tokens_are_refused():
    with pytest.raises(ValueError, match="exceed the bound cache rows"):
        causal_bias(np.array([3]), 2, 4)
    with pytest.raises(ValueError, match="exceed the bound cache rows"):
        causal_bias_reference(np.array([3]), 2, 4)


@pytest.mark.parametrize("flavor", ["ort", "portable"])
@pytest.mark.parametrize("seed", range(8))
def test_inputs_written_in_place_equal_step_inputs(flavor, seed):
    """The decoder writes each call's small inputs into its bound arrays (step_inputs_into): the same values
    as step_inputs, over repeated calls into the same arrays, with and without padding."""
    rng = np.random.default_rng(seed)
    m = SimpleNamespace(flavor=flavor, sliding_window=None)
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    rows = 40
    out = {n: np.full_like(v, 7) for n, v in step_inputs(m, np.zeros(b, np.int64), s, rows).items()}
    for _ in range(3):
        lengths = rng.integers(1, 30, b)
        valid = None if rng.random() < 0.5 else np.arange(s)[None] < rng.integers(1, s + 1, b)[:, None]
        step_inputs_into(m, lengths, s, rows, valid, out)
        want = step_inputs(m, lengths, s, rows, valid)
        assert want.keys() == out.keys()
        for name, value in want.items():
            assert out[name].dtype == value.dtype and out[name].shape == value.shape, name
            np.testing.assert_array_equal(out[name], value, err_msg=name)
    with pytest.raises(ValueError, match="exceed the bound cache rows"):
        step_inputs_into(m, np.full(b, rows - s + 1), s, rows, None, out)

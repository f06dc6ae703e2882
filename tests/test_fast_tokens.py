"""edgespec/fast_tokens.py: FAST action tokens (DCT along time, scaled and rounded, BPE over the coefficients)."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.fast_tokens import END, FastTokenizer, dct_matrix

H, D = 8, 3


def smooth_chunks(n: int, seed: int = 0) -> np.ndarray:
    """Reaching-like chunks: per dimension a quadratic in time, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, H)[None, :, None]
    a, b, c = (rng.normal(0, s, (n, 1, D)) for s in (0.5, 0.5, 0.2))
    return np.clip(a + b * t + c * t ** 2, -1, 1)


@pytest.fixture(scope="module")
def fitted():
    return FastTokenizer.fit(smooth_chunks(1500), scale=10, vocab_size=512)


def test_the_dct_is_orthonormal_dct_ii():
    c = dct_matrix(H)
    np.testing.assert_allclose(c @ c.T, np.eye(H), atol=1e-12)
    scipy_fft = pytest.importorskip("scipy.fft")
    x = np.random.default_rng(1).normal(size=(H, D))
    np.testing.assert_allclose(c @ x, scipy_fft.dct(x, type=2, norm="ortho", axis=0), atol=1e-12)


def test_every_chunk_decodes_within_the_bound_in_fewer_tokens(fitted):
    tok, report = fitted
    held_out = smooth_chunks(300, seed=9)
    lengths = []
    for x in held_out:
        ids = tok.encode(x)
        lengths.append(len(ids))
        assert np.abs(tok.decode(ids) - x).max() <= tok.error_bound + 1e-12
        assert np.array_equal(tok.decode(ids + [tok.end_id]), tok.decode(ids))  # END last is the chunk's end
    assert report.max_abs_error <= report.error_bound == tok.error_bound == 0.5 * np.sqrt(H) / 10
    assert report.coefficients_per_chunk == H * D and report.tokens_per_chunk_mean < H * D / 2
    assert np.mean(lengths) < H * D / 2 and len(set(lengths)) > 1  # variable length, compressed


def test_saved_and_loaded_it_encodes_the_same(fitted, tmp_path):
    tok, _ = fitted
    tok.save(tmp_path / "fast.json")
    back = FastTokenizer.load(tmp_path / "fast.json")
    for x in smooth_chunks(20, seed=3):
        assert back.encode(x) == tok.encode(x)
        np.testing.assert_array_equal(back.decode(tok.encode(x)), tok.decode(tok.encode(x)))
    assert back.end_id == tok.end_id and back.vocab_size == tok.vocab_size <= 512


def test_fitting_is_deterministic():
    a, _ = FastTokenizer.fit(smooth_chunks(200), vocab_size=256)
    b, _ = FastTokenizer.fit(smooth_chunks(200), vocab_size=256)
    assert a.to_dict() == b.to_dict()


def test_bad_input_is_named_and_nothing_is_clipped(fitted):
    tok, _ = fitted
    x = smooth_chunks(1, seed=5)[0]
    with pytest.raises(ValueError, match=r"a chunk must be finite \(8, 3\), got shape \(3, 8\)"):
        tok.encode(x.T)
    with pytest.raises(ValueError, match=r"coefficient 0 \(frequency 0, dim 0\) is -?\d+ after scaling, outside the "
                                         r"fitted alphabet -?\d+\.\.\d+"):
        tok.encode(x * 0 + 50.0)
    ids = tok.encode(x)
    with pytest.raises(ValueError, match=r"decode to \d+ coefficients; a chunk is 8 x 3 = 24"):
        tok.decode(ids[:-1])
    with pytest.raises(ValueError, match=r"FAST ids must be in 0\.\.\d+"):
        tok.decode(ids + [tok.vocab_size])
    with pytest.raises(ValueError, match=f"{END}"):
        tok.decode([tok.end_id] + ids)
    with pytest.raises(ValueError, match=r"chunks must be finite \(N, H, D\)"):
        FastTokenizer.fit(np.zeros((4, 8)))

"""The KV cache written in place: bound calls against the slow `reference_call`, with garbage in every
stale row, for B = 1 and B > 1, across regrowth, two buffer sets (TensorRT-style), and the cache's verbs."""
import numpy as np
import pytest

import edgespec
from edgespec.backends.ort import OrtDecoder
from edgespec.export.validate import garbage
from edgespec.kvcache import KVCache
from edgespec.memory import HostMemory


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return edgespec.load(tiny_engines["target"]).target


def poison_stale_rows(d: OrtDecoder, rng) -> None:
    """Garbage into every row past each sequence's committed length: keys NaN / inf / huge, values huge
    (the graph stores only finite values, so that is what a stale value row can hold)."""
    for j in range(len(d.cache.buffers)):
        host = d.cache.host(j)
        for b, n in enumerate(d.cache.lengths.tolist()):
            host[b, :, n:] = garbage(host[b, :, n:].shape, host.dtype, rng, finite=j % 2 == 1)
        d.memory.write(d.cache.buffers[j], host)


def small_cache(d: OrtDecoder, chunk: int, in_place: bool = True) -> None:
    m = d.m
    d.cache = KVCache(m.num_layers, d.batch, m.num_kv_heads, m.head_dim, m.max_context, chunk=chunk,
                      in_place=in_place)
    d._bindings.clear()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("in_place", [True, False])
def test_bound_calls_equal_reference_with_garbage_in_stale_rows(engine, batch, in_place):
    """Random call sizes, random accept counts and rollbacks; the cache grows (chunk 8) along the way."""
    rng = np.random.default_rng(batch + 10 * in_place)
    fast, slow = OrtDecoder(engine, batch), OrtDecoder(engine, batch)
    for d in (fast, slow):
        small_cache(d, 8, in_place)
    grew = set()
    for step in range(20):
        s = int(rng.integers(1, 7))
        ids = rng.integers(0, 95, (batch, s))
        valid = None
        if batch > 1:  # right padding: sequences feed different counts
            n_valid = rng.integers(1, s + 1, batch)
            n_valid[0] = s
            valid = np.arange(s)[None] < n_valid[:, None]
        for d in (fast, slow):
            poison_stale_rows(d, np.random.default_rng(step))
        a = fast(ids, valid).copy()
        b = slow.reference_call(ids, valid)
        live = np.ones((batch, s), bool) if valid is None else valid
        np.testing.assert_allclose(a[live], b[live], atol=1e-5)
        assert np.isfinite(a[live]).all()
        np.testing.assert_array_equal(fast.last_ids()[live], a.argmax(-1)[live])
        keep = rng.integers(0, live.sum(1) + 1)  # accepted rows per sequence
        back = rng.integers(0, 3, batch) if rng.random() < 0.3 else np.zeros(batch, np.int64)  # then roll back
        for d in (fast, slow):
            d.cache.commit(keep)
            d.cache.rewind_to(np.maximum(d.cache.lengths - back, 0))
        grew.add(fast.cache.capacity)
        for b_ in range(batch):  # the committed rows are the same in both caches
            for x, y in zip(fast.cache.rows(b_), slow.cache.rows(b_)):
                np.testing.assert_allclose(x, y, atol=1e-5)
    assert len(grew) > 1, "the cache should have grown during the test"


def test_rollback_then_rewrite_overwrites_stale_rows(engine):
    """Rows of a rejected call are stale: the next call at the same length writes over them."""
    d = OrtDecoder(engine, 1)
    d(np.array([[1, 2, 3]]))
    d.cache.commit(3)
    first = d(np.array([[4, 5, 6, 7]])).copy()  # four drafts ...
    d.cache.commit(1)  # ... one kept
    again = d(np.array([[9]])).copy()  # overwrites row 4
    fresh = OrtDecoder(engine, 1)
    want = fresh(np.array([[1, 2, 3, 4, 9]]))
    np.testing.assert_allclose(first[:, 0], want[:, 3], atol=1e-5)
    np.testing.assert_allclose(again[:, 0], want[:, 4], atol=1e-5)


def test_a_failed_call_leaves_only_finite_rows(tiny_engines, tmp_path):
    """NaN inputs give NaN logits and NONFINITE_ID; the decoder zeroes the rows that call wrote, so the cache
    stays finite and the next call from the committed rows is exactly what it would have been."""
    from edgespec.export.onnx_export import export_engine
    from tests.conftest import assert_a_failed_call_is_scrubbed, make_checkpoint
    make_checkpoint("llama", tmp_path / "ck", seed=4)
    export_engine(tmp_path / "ck", tmp_path / "emb", input_mode="embeds", max_context=64, progress=False)
    assert_a_failed_call_is_scrubbed(tmp_path / "emb", nan_logits=True)


# -- the verbs ------------------------------------------------------------------------------------------
def test_commit_and_rewind_under_random_accept_patterns():
    rng = np.random.default_rng(0)
    c = KVCache(1, 3, 1, 4, 64, chunk=8)
    want = np.zeros(3, np.int64)
    for _ in range(200):
        s = int(rng.integers(1, 6))
        c.reserve(int(c.lengths.max()) + s)
        c.wrote(s)
        keep = rng.integers(0, s + 1, 3)
        c.commit(keep)
        want += keep
        if rng.random() < 0.3:
            want = np.maximum(want - rng.integers(0, 4, 3), 0)
            c.rewind_to(want)
        np.testing.assert_array_equal(c.lengths, want)
        if want.max() > 48:
            want[:] = 0
            c.rewind_to(0)
    assert c.capacity <= 64


def test_commit_beyond_what_was_written_is_refused():
    c = KVCache(1, 2, 1, 4, 32)
    c.wrote(3)
    with pytest.raises(ValueError, match=r"can keep 0..\[3, 3\]"):
        c.commit([4, 1])
    c.commit([3, 1])
    with pytest.raises(ValueError, match="can keep"):
        c.commit(1)  # nothing written since
    with pytest.raises(ValueError, match=r"lengths must be in 0..\[3, 1\]"):
        c.rewind_to([4, 0])
    with pytest.raises(ValueError, match="max context is 32"):
        c.reserve(33)


def test_lengths_are_read_only():
    c = KVCache(1, 1, 1, 4, 32)
    with pytest.raises(ValueError, match="read-only"):
        c.lengths[0] = 5


def test_growth_keeps_rows_and_renews_bindings():
    c = KVCache(1, 1, 2, 4, 100, chunk=8)
    c.host(0)[0, :, :8] = np.arange(64, dtype=np.float32).reshape(2, 8, 4)
    gen = c.generation
    c.reserve(9)
    assert c.capacity == 16 and c.generation == gen + 1
    np.testing.assert_array_equal(c.host(0)[0, :, :8], np.arange(64).reshape(2, 8, 4))
    assert not c.host(0)[0, :, 8:].any()
    c.reserve(100)
    assert c.capacity == 100  # the last chunk stops at max_context


def test_two_buffer_sets_flip_after_each_call():
    c = KVCache(1, 1, 1, 4, 32, in_place=False, memory=HostMemory())
    a, b = c.buffers, c.out_buffers
    assert a[0].ptr != b[0].ptr
    c.wrote(1)
    assert c.buffers[0].ptr == b[0].ptr and c.out_buffers[0].ptr == a[0].ptr

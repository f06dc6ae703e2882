"""Action-chunk queue and hold-then-stop latch, on a hand-driven clock (no sleeping, no timing)."""
import numpy as np
import pytest

from edgespec.robots.chunks import Chunk, ChunkQueue, HoldThenStop

DT = 0.05  # 20 Hz


def chunk(t0, values):
    return Chunk(t0, np.array(values, dtype=float)[:, None])


@pytest.mark.parametrize("latency,dropped", [(0.0, 0), (0.01, 1), (0.05, 1), (0.051, 2), (0.149, 3)])
def test_stale_actions_dropped_by_ceil_latency_over_dt(latency, dropped):
    q = ChunkQueue(DT)
    assert q.push(chunk(1.0, [0, 1, 2, 3, 4]), now=1.0 + latency) == dropped
    assert len(q) == 5 - dropped
    assert q.pop(1.0 + dropped * DT)[0] == dropped  # the first action left is the one due now


def test_latest_merge_replaces_the_overlap():
    q = ChunkQueue(DT, merge="latest")
    q.push(chunk(0.0, [0, 1, 2, 3]), now=0.0)
    q.pop(0.0)
    q.push(chunk(0.05, [10, 11, 12, 13]), now=0.1)  # one stale action; overlaps steps 2, 3
    got = [q.pop(0.1 + i * DT)[0] for i in range(3)]
    assert got == [11, 12, 13] and q.pop(0.25) is None


def test_weighted_merge_blends_the_overlap():
    q = ChunkQueue(DT, merge="weighted", new_weight=0.25)
    q.push(chunk(0.0, [0, 4, 8]), now=0.0)
    q.push(chunk(0.05, [100, 100, 100]), now=0.05)
    got = [q.pop(0.05 + i * DT)[0] for i in range(3)]
    assert got == pytest.approx([0.25 * 100 + 0.75 * 4, 0.25 * 100 + 0.75 * 8, 100])


def test_pop_skips_actions_whose_time_passed():
    q = ChunkQueue(DT)
    q.push(chunk(0.0, [0, 1, 2, 3]), now=0.0)
    assert q.pop(0.1)[0] == 2 and q.dropped_stale == 2


def test_needs_more_below_threshold():
    q = ChunkQueue(DT)
    q.push(chunk(0.0, [0, 1, 2]), now=0.0)
    assert not q.needs_more(2) and q.needs_more(4)


def test_hold_last_position_then_latch_a_safe_stop_until_reset():
    s = HoldThenStop(hold_s=0.2)
    assert s.on_empty(0.0) == ("stop", None)  # nothing to hold yet: stop at once
    s.reset()
    s.on_action(np.array([0.3]))
    mode, target = s.on_empty(1.0)
    assert mode == "hold" and target[0] == 0.3
    assert s.on_empty(1.2)[0] == "hold" and s.on_empty(1.25)[0] == "stop"
    assert s.on_action(np.array([0.5])) is None and s.on_empty(2.0) == ("stop", None)  # latched
    assert "queue empty" in s.reason
    s.reset()
    assert s.on_action(np.array([0.5]))[0] == 0.5


def test_bad_chunks_and_settings_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        chunk(0.0, [0, np.nan])
    with pytest.raises(ValueError, match="\\(H >= 1 steps, D dims\\)"):
        Chunk(0.0, np.zeros(3))
    with pytest.raises(ValueError, match="merge must be one of"):
        ChunkQueue(DT, merge="avg")
    with pytest.raises(ValueError, match="dt must be > 0"):
        ChunkQueue(0)

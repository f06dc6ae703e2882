"""The native step's thread governor (edgespec/backends/threads.py): each call shape's thread count follows the
measured call times, probes the other count at its period, switches only past the margin, and never changes a
result. The call times here are synthetic (a cost per thread count), so nothing depends on this machine's load."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.backends.threads import GovernorConfig, ThreadGovernor, governor_for


def drive(gov: ThreadGovernor, calls: int, cost, shape=(1, 1)) -> list[int]:
    """`calls` calls of `shape`, each taking cost(threads, i) seconds: -> the thread count of each call."""
    used = []
    for i in range(calls):
        t = gov.threads(shape)
        gov.observe(shape, t, cost(t, i))
        used.append(t)
    return used


def test_quiet_machine_stays_on_every_core_and_only_probes_one_thread():
    cfg = GovernorConfig(probe_every=16, probe_calls=4)
    gov = ThreadGovernor(2, cfg)
    used = drive(gov, 400, lambda t, i: 0.010 if t == 2 else 0.013)
    assert gov.current((1, 1)) == 2 and gov.switches == 0
    assert used[:16] == [2] * 16  # the first probe comes after probe_every calls on the current count
    # 1 thread is 30% slower: after 3 of the 4 probe calls its median cannot win, and the probe stops there
    assert used[16:19] == [1] * 3 and used[19:35] == [2] * 16
    assert used.count(1) == 3 * (400 // 19)  # 3 probe calls in every 19


def test_a_busy_core_moves_it_to_one_thread_and_back_when_the_core_frees():
    cfg = GovernorConfig(probe_every=16, probe_calls=4)
    gov = ThreadGovernor(2, cfg)
    # calls 0..199: another process holds a core (2 threads 0.012 s, 1 thread 0.009); then quiet again
    cost = lambda t, i: (0.012 if t == 2 else 0.009) if i < 200 else (0.007 if t == 2 else 0.009)  # noqa: E731
    used = drive(gov, 400, cost)
    assert used[16:20] == [1] * 4 and used[20:36] == [1] * 16  # the first probe wins: 1 thread from then on
    assert used[36:39] == [2] * 3 and used[39] == 1  # ... which goes on probing 2 (a losing probe: 3 calls)
    back = next(i for i in range(200, 400) if used[i:i + 16] == [2] * 16)  # 16 calls on 2 in a row: switched back
    assert back < 200 + 2 * 20  # within two periods of the change
    tail = "".join(str(t) for t in used[back:]).rstrip("1")  # a probe cut short by the end of the calls aside
    assert {len(r) for r in tail.split("2") if r} == {3}  # from then on 1 thread only in losing probes
    assert gov.switches == 2 and gov.current((1, 1)) == 2


def test_a_probe_within_the_margin_changes_nothing():
    gov = ThreadGovernor(2, GovernorConfig(probe_every=8, probe_calls=3, margin=0.05))
    drive(gov, 200, lambda t, i: 0.0100 if t == 2 else 0.0097)  # 3% faster on 1: inside the 5% margin
    assert gov.switches == 0 and gov.current((1, 1)) == 2
    drive(gov, 40, lambda t, i: 0.0100 if t == 2 else 0.0090)  # 10%: past it
    assert gov.switches == 1 and gov.current((1, 1)) == 1


def test_each_call_shape_keeps_its_own_count():
    gov = ThreadGovernor(4, GovernorConfig(probe_every=4, probe_calls=2))
    for i in range(100):  # one-row calls are faster on 1 thread, five-row verify calls on 4
        for shape, fast in (((1, 1), 1), ((1, 5), 4)):
            t = gov.threads(shape)
            gov.observe(shape, t, 0.01 if t == fast else 0.02)
    assert gov.current((1, 1)) == 1 and gov.current((1, 5)) == 4 and gov.current((2, 1)) == 4


def test_a_median_not_a_single_outlier_decides():
    gov = ThreadGovernor(2, GovernorConfig(probe_every=8, probe_calls=5))
    # 1 thread is slower except for one lucky call in each probe: the median keeps 2
    drive(gov, 200, lambda t, i: 0.010 if t == 2 else (0.001 if i % 13 == 0 else 0.014))
    assert gov.switches == 0


def test_the_ladder_of_counts():
    from edgespec.backends.threads import ladder
    assert ladder(2) == [2, 1] and ladder(3) == [3, 2, 1] and ladder(4) == [4, 3, 2, 1]
    assert ladder(8) == [8, 7, 6, 4, 2, 1] and ladder(12) == [12, 11, 10, 6, 3, 1]
    assert ladder(16) == [16, 15, 14, 8, 4, 2, 1]


def test_on_eight_cores_beside_a_busy_process_it_finds_seven_threads():
    """A Jetson-class CPU (8 cores) with one core taken: 8 threads wait for the one that shares a core, 7 are the
    fastest, 1 is several times slower. A choice between every core and one would stay on 8."""
    gov = ThreadGovernor(8, GovernorConfig(probe_every=16, probe_calls=4))
    speed = {8: 0.020, 7: 0.010, 6: 0.0115, 4: 0.017, 2: 0.034, 1: 0.068}
    used = drive(gov, 600, lambda t, i: speed[t])
    assert gov.current((1, 1)) == 7 and gov.switches == 1
    assert used[16:20] == [7] * 4  # the first probe takes the next count down, and wins
    probes = [t for t in used[20:] if t != 7]
    assert set(probes) == {8, 6, 4, 2, 1}
    # every losing probe stops after 3 calls (its median cannot win): the slow counts cost little
    runs = [len(r) for r in "".join("p" if t != 7 else "." for t in used[20:]).split(".") if r]
    assert set(runs) == {3}


def test_each_probe_takes_the_next_other_count():
    gov = ThreadGovernor(4, GovernorConfig(probe_every=4, probe_calls=2))
    used = drive(gov, 60, lambda t, i: 0.01 if t == 4 else 0.02)  # 4 stays fastest
    probes = [t for t in used if t != 4]
    assert probes[:6] == [3, 3, 2, 2, 1, 1] and gov.switches == 0  # 2 calls each (the median needs both)


@pytest.mark.parametrize("field,value", [("probe_every", 0), ("probe_calls", 0), ("recent", 0), ("margin", 1.0),
                                         ("margin", -0.1)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        GovernorConfig(**{field: value})
    with pytest.raises(ValueError, match="most=1"):
        ThreadGovernor(1)


def test_only_an_open_thread_count_gets_a_governor():
    assert isinstance(governor_for(None, 2, None), ThreadGovernor)
    assert governor_for(2, 2, None) is None  # the caller's count
    assert governor_for(None, 2, "2") is None  # $EDGESPEC_THREADS
    assert isinstance(governor_for(None, 2, "0"), ThreadGovernor)  # 0: unset, as default_threads reads it
    assert governor_for(None, 1, None) is None  # one core: nothing to choose


def test_a_native_decoder_runs_each_call_on_the_governors_count_and_gets_the_same_ids(tmp_path, monkeypatch):
    """An engine opened without a thread count asks its governor for every call and reports every call's time;
    whatever count it picks, the ids are those of a fixed-count engine."""
    from test_native import _f16_checkpoint

    from edgespec.backends import native_lib, open_engine
    from edgespec.export.onnx_export import export_engine
    _f16_checkpoint(tmp_path / "ck", 21)
    export_engine(tmp_path / "ck", tmp_path / "eng", max_context=128, progress=False)
    monkeypatch.delenv("EDGESPEC_THREADS", raising=False)
    auto, fixed = open_engine(tmp_path / "eng", "cpu-native"), open_engine(tmp_path / "eng", "cpu-native", threads=1)
    assert auto.governor is not None and fixed.governor is None and auto.threads == auto.governor.most

    class Alternating(ThreadGovernor):  # 2, 1, 2, 1, ... whatever the times
        def __init__(self):
            super().__init__(2, GovernorConfig())
            self.n, self.seen = 0, []

        def threads(self, shape):
            self.n += 1
            return 1 if self.n % 2 == 0 else 2

        def observe(self, shape, threads, seconds):
            self.seen.append((shape, threads, seconds))

    auto.governor = Alternating()
    forward = native_lib.library().es_forward
    asked = []
    real = auto.lib

    class Spy:  # the thread count each es_forward call received (its last argument)
        def __getattr__(self, name):
            return getattr(real, name)

        def es_forward(self, *args):
            asked.append(args[-1])
            return forward(*args)

    auto.lib = Spy()
    a, b = auto.decoder(), fixed.decoder()
    rng = np.random.default_rng(0)
    for s in (7, 1, 1, 3, 1):
        ids = rng.integers(0, auto.manifest.vocab_size, (1, s))
        np.testing.assert_array_equal(np.array(a(ids)), np.array(b(ids)))
        assert (a.last_ids() == b.last_ids()).all()
        a.cache.commit(s)
        b.cache.commit(s)
    assert asked == [2, 1, 2, 1, 2]
    assert [(sh, t) for sh, t, _ in auto.governor.seen] == [((1, 7), 2), ((1, 1), 1), ((1, 1), 2), ((1, 3), 1),
                                                            ((1, 1), 2)]
    assert all(sec > 0 for _, _, sec in auto.governor.seen)


class FakeMachine:
    """A clock and the machine's cumulative idle CPU-seconds, advanced by each call: idle_rate(i, threads) cores
    idle while call i runs on `threads`."""

    def __init__(self):
        self.now, self.idle = 0.0, 0.0

    def run(self, gov, calls, cost, idle_rate, shape=(1, 1)) -> list[int]:
        used = []
        for i in range(calls):
            t = gov.threads(shape)
            dt = cost(t, i)
            self.now += dt
            self.idle += idle_rate(i, t) * dt
            gov.observe(shape, t, dt)
            used.append(t)
        return used


def _back_to_two(used, start):
    return next(i for i in range(start, len(used)) if used[i:i + 16] == [2] * 16)


def test_idle_cores_bring_it_back_up_before_the_next_probe():
    """A neighbour holds a core for calls 0..239 (one thread is faster beside it), then stops, 40 calls after the
    last probe. With the machine's idle time watched, the governor finds the free core within a window or two;
    without, at its next probe."""
    end = 240  # the regular probes of two (losing beside the neighbour) run at calls 132-134 and 199-201
    cost = lambda t, i: (0.012 if t == 2 else 0.009) if i < end else (0.007 if t == 2 else 0.009)  # noqa: E731
    idle_rate = lambda i, t: 0.0 if i < end else 2.0 - t  # noqa: E731  (the neighbour's core, then free)
    backs = {}
    for watched in (True, False):
        m = FakeMachine()
        gov = ThreadGovernor(2, GovernorConfig(probe_every=64), idle_seconds=(lambda: m.idle) if watched else None,
                             clock=lambda: m.now)
        used = m.run(gov, 600, cost, idle_rate)
        assert used[64:68] == [1] * 4 and gov.current((1, 1)) == 2  # moved down at the first probe, back up later
        assert used[68:end].count(2) == 2 * 3  # beside the neighbour: the two regular probes only, no idle ones
        backs[watched] = _back_to_two(used, end)
        assert gov.idle_probes == (1 if watched else 0)
    assert backs[True] < end + 2 * 12 + 4  # within two 0.1 s windows of 9 ms calls, then the probe
    assert backs[False] == 266  # the next regular probe: 64 calls after the last


def test_idle_probes_that_lose_back_off_to_the_probe_schedule():
    """A model whose calls are faster on one thread even on an idle machine: idle cores start probes of two, which
    lose; each waits twice as long as the last, until the regular schedule comes first."""
    m = FakeMachine()
    cfg = GovernorConfig(probe_every=64, idle_window=0.005)
    gov = ThreadGovernor(2, cfg, idle_seconds=lambda: m.idle, clock=lambda: m.now)
    used = m.run(gov, 3000, lambda t, i: 0.0012 if t == 2 else 0.0010, lambda i, t: 2.0 - t)
    assert gov.current((1, 1)) == 1 and gov.switches == 1
    assert gov.idle_probes == 3  # after 8, 16 and 32 calls; then the regular probe at 64 comes first
    assert used[1000:].count(2) <= 3 * (2000 // 64 + 1)  # from then on only the regular probes (3 calls each)


def test_no_idle_probe_where_the_idle_time_cannot_be_read():
    m = FakeMachine()
    gov = ThreadGovernor(2, GovernorConfig(probe_every=64), idle_seconds=lambda: None, clock=lambda: m.now)
    m.run(gov, 400, lambda t, i: 0.007 if t == 2 else 0.005 if i < 100 else 0.009, lambda i, t: 2.0 - t)
    assert gov.idle_probes == 0 and gov._idle_seconds is None


def test_the_engines_governor_watches_this_machines_idle_time():
    gov = governor_for(None, 2, None)
    assert gov.fresh()._idle_seconds is gov._idle_seconds is not None
    from edgespec.backends.threads import machine_idle_seconds
    assert machine_idle_seconds() > 0  # /proc/stat on the Linux machines the tests run on
    with pytest.raises(ValueError, match="idle_share"):
        GovernorConfig(idle_share=0)


def test_a_shape_started_on_one_thread_stays_there_until_a_probe_moves_it():
    gov = ThreadGovernor(2, GovernorConfig(probe_every=16))
    gov.start_on((1, 1), 1)
    used = drive(gov, 40, lambda t, i: 0.007 if t == 2 else 0.009)
    assert used[:16] == [1] * 16 and used[16:20] == [2] * 4 and gov.current((1, 1)) == 2
    with pytest.raises(ValueError, match=r"one of the ladder \[2, 1\], got 3"):
        gov.start_on((1, 1), 3)

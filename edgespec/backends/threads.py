"""How many threads each native call runs on, chosen from the times of the calls before it.

On an idle machine the native step is fastest on every core. Beside another CPU-bound process (a camera driver,
a ROS node, the control loop) one of its threads shares a core with that process, and the step waits for it
each time the scheduler puts it aside; one thread then beats two. Which is faster depends on what else runs, and
that changes while a robot runs, so the engine measures it instead of guessing: a ThreadGovernor keeps, for
each call shape (batch, S), the thread count now in use, and every `probe_every` calls of that shape runs
`probe_calls` calls on another count of its ladder (`ladder`: every core, one fewer, two fewer, then halving down
to one; on 2 cores just 2 and 1), taking the other counts in turn. When the probed count's median call is faster
than the median of the current count's last calls by more than `margin`, it becomes the current count. A probe
stops as soon as its median can no longer win (more than half of its calls already too slow), so probing a much
slower count costs little. The thread count never changes a result (every output is the same float32 chain on
any number of threads), only the time.

Why a ladder and not just "every core or one": beside one busy process on 8 cores the best count is 7; one
thread would be several times slower than either.

A fixed count (threads=N, or $EDGESPEC_THREADS) takes no governor: NativeEngine runs every call on N.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class GovernorConfig:
    probe_every: int = 64  # calls of one shape on the current count between probes of the other
    probe_calls: int = 4  # calls per probe; their median is compared
    recent: int = 8  # the current count's last calls compared against a probe
    margin: float = 0.03  # the other count takes over when its median is this much faster

    def __post_init__(self):
        if self.probe_every < 1:
            raise ValueError(f"probe_every: expected >= 1 call between probes, got {self.probe_every}")
        if self.probe_calls < 1:
            raise ValueError(f"probe_calls: expected >= 1 call per probe, got {self.probe_calls}")
        if self.recent < 1:
            raise ValueError(f"recent: expected >= 1 call to compare a probe with, got {self.recent}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin: expected a fraction in [0, 1), got {self.margin}")


def ladder(most: int) -> list[int]:
    """The thread counts a governor chooses among, most first: most, most - 1, most - 2, then most // 2, most // 4,
    ... down to 1 (2 cores: [2, 1]; 8: [8, 7, 6, 4, 2, 1])."""
    counts = [n for n in (most, most - 1, most - 2) if n >= 1]
    n = most // 2
    while n >= 1:
        counts.append(n)
        n //= 2
    counts.append(1)
    return sorted(set(counts), reverse=True)


@dataclass
class _Shape:
    """One call shape's state: the count in use, its recent call times, and a probe under way."""
    current: int
    since_probe: int = 0
    probe: list[float] = field(default_factory=list)  # the probe's call times (seconds); empty: no probe
    probing: int | None = None  # the count being probed
    turn: int = 0  # probes so far: which other count of the ladder the next one takes
    recent: deque = field(default_factory=deque)


class ThreadGovernor:
    """Chooses each native call's thread count among ladder(most) (calls of one shape measured against each other;
    shapes independent). Not thread-safe: one engine's calls come from one Python thread at a time."""

    def __init__(self, most: int, config: GovernorConfig | None = None):
        if most < 2:
            raise ValueError(f"a ThreadGovernor chooses between at least 2 threads and 1, got most={most}")
        self.most = most
        self.ladder = ladder(most)
        self.config = config or GovernorConfig()
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self.switches = 0  # times a probe changed a shape's count (for benches and tests)

    def _state(self, shape: tuple[int, int]) -> _Shape:
        st = self._shapes.get(shape)
        if st is None:
            st = self._shapes[shape] = _Shape(self.most, recent=deque(maxlen=self.config.recent))
        return st

    def _next_probe(self, st: _Shape) -> int:
        """The other counts of the ladder in turn (2 cores: always the other one)."""
        others = [n for n in self.ladder if n != st.current]
        n = others[st.turn % len(others)]
        st.turn += 1
        return n

    def threads(self, shape: tuple[int, int]) -> int:
        """The thread count for the next call of this (batch, S)."""
        st = self._state(shape)
        if st.probing is None and st.since_probe >= self.config.probe_every and st.recent:
            st.probing, st.probe = self._next_probe(st), []
        return st.probing if st.probing is not None else st.current

    def observe(self, shape: tuple[int, int], threads: int, seconds: float) -> None:
        """The call of this shape that threads() chose `threads` for took `seconds` inside the engine."""
        st = self._state(shape)
        cfg = self.config
        if st.probing is not None and threads == st.probing:
            st.probe.append(seconds)
            bar = (1.0 - cfg.margin) * np.median(st.recent)
            # more than half of probe_calls at or above the bar: the probe's median cannot get below it
            lost = sum(t >= bar for t in st.probe) > cfg.probe_calls // 2
            if lost or len(st.probe) >= cfg.probe_calls:
                if not lost and np.median(st.probe) < bar:
                    st.current = st.probing
                    st.recent.clear()
                    st.recent.extend(st.probe[-cfg.recent:])
                    self.switches += 1
                    st.turn = 0
                st.probing, st.probe, st.since_probe = None, [], 0
        elif threads == st.current:
            st.recent.append(seconds)
            st.since_probe += 1

    def current(self, shape: tuple[int, int]) -> int:
        """The count a shape runs on outside probes (`most` for a shape not seen yet)."""
        st = self._shapes.get(shape)
        return st.current if st is not None else self.most


def governor_for(asked: int | None, most: int, env_threads: str | None) -> ThreadGovernor | None:
    """A governor for an engine whose caller left the thread count open (asked None and no $EDGESPEC_THREADS,
    env_threads its value) and that may use `most` >= 2 threads; None where the count is fixed."""
    fixed = bool(asked) or int(env_threads or 0) > 0
    return None if fixed or most < 2 else ThreadGovernor(most)

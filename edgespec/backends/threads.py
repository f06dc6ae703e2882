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

A neighbour that stops is found sooner than the next probe: a shape on fewer threads than `most` watches the
machine's idle time (/proc/stat, read at most every `idle_window` seconds) and, once at least `idle_share` of a
core was idle per thread it could add, probes the next count up at once. Such a probe that loses (a model whose
calls are faster on fewer threads even on idle cores) doubles the calls before the next one, up to probe_every,
so it never probes more often than the regular schedule for long; a probe that wins resets it.

A fixed count (threads=N, or $EDGESPEC_THREADS) takes no governor: NativeEngine runs every call on N.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class GovernorConfig:
    probe_every: int = 64  # calls of one shape on the current count between probes of the other
    probe_calls: int = 4  # calls per probe; their median is compared
    recent: int = 8  # the current count's last calls compared against a probe
    margin: float = 0.03  # the other count takes over when its median is this much faster
    idle_window: float = 0.1  # seconds, at least, over which the machine's idle time is measured
    idle_share: float = 0.5  # idle cores per thread a probe would add that start it before probe_every

    def __post_init__(self):
        if self.probe_every < 1:
            raise ValueError(f"probe_every: expected >= 1 call between probes, got {self.probe_every}")
        if self.probe_calls < 1:
            raise ValueError(f"probe_calls: expected >= 1 call per probe, got {self.probe_calls}")
        if self.recent < 1:
            raise ValueError(f"recent: expected >= 1 call to compare a probe with, got {self.recent}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin: expected a fraction in [0, 1), got {self.margin}")
        if not self.idle_window > 0:
            raise ValueError(f"idle_window: expected seconds > 0, got {self.idle_window}")
        if not 0.0 < self.idle_share <= 1.0:
            raise ValueError(f"idle_share: expected a fraction in (0, 1], got {self.idle_share}")


def machine_idle_seconds() -> float | None:
    """Seconds all CPUs have spent idle since boot (/proc/stat's idle + iowait), or None where it cannot be read
    (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


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
    idle_wait: int = 0  # calls on the current count before idle cores may start a probe up
    idle_probe: bool = False  # the probe under way was started by idle cores


class ThreadGovernor:
    """Chooses each native call's thread count among ladder(most) (calls of one shape measured against each other;
    shapes independent). Not thread-safe: one engine's calls come from one Python thread at a time."""

    def __init__(self, most: int, config: GovernorConfig | None = None,
                 idle_seconds: Callable[[], float | None] | None = None, clock: Callable[[], float] = time.monotonic):
        """idle_seconds: the machine's cumulative idle CPU-seconds (machine_idle_seconds; None: no idle probes);
        clock: seconds, monotonic (both injectable for tests)."""
        if most < 2:
            raise ValueError(f"a ThreadGovernor chooses between at least 2 threads and 1, got most={most}")
        self.most = most
        self.ladder = ladder(most)
        self.config = config or GovernorConfig()
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self.switches = 0  # times a probe changed a shape's count (for benches and tests)
        self.idle_probes = 0  # probes started by idle cores (for benches and tests)
        self._idle_seconds, self._clock = idle_seconds, clock
        self._mark: tuple[float, float] | None = None  # (clock, idle seconds) where the idle window began
        self.idle_cores: float | None = None  # cores idle on average over the last whole window

    def fresh(self) -> "ThreadGovernor":
        """A governor with these settings and nothing measured (what a newly opened engine starts with)."""
        return ThreadGovernor(self.most, self.config, self._idle_seconds, self._clock)

    def start_on(self, shape: tuple[int, int], threads: int) -> None:
        """Put a shape on `threads` of the ladder with nothing measured, as after a probe that chose it (a bench's
        starting point: where a neighbour that has just stopped left it)."""
        if threads not in self.ladder:
            raise ValueError(f"threads: expected one of the ladder {self.ladder}, got {threads}")
        self._shapes[shape] = _Shape(threads, recent=deque(maxlen=self.config.recent), idle_wait=self.config.recent)

    def _state(self, shape: tuple[int, int]) -> _Shape:
        st = self._shapes.get(shape)
        if st is None:
            st = self._shapes[shape] = _Shape(self.most, recent=deque(maxlen=self.config.recent),
                                              idle_wait=self.config.recent)
        return st

    def _idle(self) -> float | None:
        """Idle cores over the last window of at least idle_window seconds (a new window starts when one ends)."""
        if self._idle_seconds is None:
            return None
        now = self._clock()
        if self._mark is None or now - self._mark[0] >= self.config.idle_window:
            idle = self._idle_seconds()
            if idle is None:  # unreadable: no idle probes from now on
                self._idle_seconds = None
                return None
            if self._mark is not None:
                self.idle_cores = (idle - self._mark[1]) / (now - self._mark[0])
            self._mark = (now, idle)
        return self.idle_cores

    def _up(self, st: _Shape) -> int | None:
        """The next count of the ladder above the current one, where idle cores say it would find a free core."""
        if st.current >= self.most:
            return None
        idle = self._idle()  # read while the shape waits too, so that a window has passed when the wait ends
        if st.since_probe < st.idle_wait or idle is None:
            return None
        up = min(n for n in self.ladder if n > st.current)
        return up if idle >= self.config.idle_share * (up - st.current) else None

    def _next_probe(self, st: _Shape) -> int:
        """The other counts of the ladder in turn (2 cores: always the other one)."""
        others = [n for n in self.ladder if n != st.current]
        n = others[st.turn % len(others)]
        st.turn += 1
        return n

    def threads(self, shape: tuple[int, int]) -> int:
        """The thread count for the next call of this (batch, S)."""
        st = self._state(shape)
        if st.probing is None and st.recent:
            if st.since_probe >= self.config.probe_every:
                st.probing, st.probe = self._next_probe(st), []
            elif (up := self._up(st)) is not None:
                st.probing, st.probe, st.idle_probe = up, [], True
                self.idle_probes += 1
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
                won = not lost and np.median(st.probe) < bar
                if won:
                    st.current = st.probing
                    st.recent.clear()
                    st.recent.extend(st.probe[-cfg.recent:])
                    self.switches += 1
                    st.turn = 0
                if won:
                    st.idle_wait = cfg.recent
                elif st.idle_probe:  # idle cores did not make the count up faster: wait longer before the next
                    st.idle_wait = min(2 * st.idle_wait, cfg.probe_every)
                st.probing, st.probe, st.since_probe, st.idle_probe = None, [], 0, False
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
    return None if fixed or most < 2 else ThreadGovernor(most, idle_seconds=machine_idle_seconds)

"""The control loop's action plumbing: a time-stamped action-chunk queue and the hold-then-stop latch.

A policy returns a chunk of H actions for the observation taken at time t0, one action per loop period dt.
By the time the chunk lands (now), d = ceil((now - t0) / dt) of its actions are already in the past: they
are dropped. What is left is merged with what is still queued (`latest`: the new chunk wins on the
overlap; `weighted`: the overlap is blended, the new chunk weighted by `new_weight`).

When the queue runs dry the loop holds the last *position* target (never repeats a velocity command) for
`hold_s`, then latches a safe stop that only an explicit `reset()` clears.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from .checks import check_chunk

MERGE_MODES = ("latest", "weighted")


@dataclass
class Chunk:
    t0: float  # loop-clock time (s) of the observation the chunk was computed from
    actions: np.ndarray  # (H, D) one action per period, the first for time t0

    def __post_init__(self):
        self.actions = check_chunk(self.actions)


class ChunkQueue:
    def __init__(self, dt: float, merge: str = "latest", new_weight: float = 0.5):
        if dt <= 0:
            raise ValueError(f"dt must be > 0 seconds, got {dt}")
        if merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
        if not 0 <= new_weight <= 1:
            raise ValueError(f"new_weight must be in [0, 1], got {new_weight}")
        self.dt, self.merge, self.new_weight = dt, merge, new_weight
        self.queue: deque[tuple[float, np.ndarray]] = deque()  # (due time, action)
        self.dropped_stale = 0

    def __len__(self) -> int:
        return len(self.queue)

    def stale_steps(self, t0: float, now: float) -> int:
        """d = ceil(latency / dt): actions of a chunk whose time passed while it was computed."""
        return max(0, math.ceil((now - t0) / self.dt - 1e-9))

    def push(self, chunk: Chunk, now: float) -> int:
        """Merge a landed chunk; returns how many of its actions were stale and dropped."""
        d = min(self.stale_steps(chunk.t0, now), len(chunk.actions))
        self.dropped_stale += d
        fresh = [(chunk.t0 + i * self.dt, a) for i, a in enumerate(chunk.actions) if i >= d]
        old = {round(t / self.dt): a for t, a in self.queue if t >= now - 1e-9}
        merged = []
        for t, a in fresh:
            prev = old.pop(round(t / self.dt), None)
            if prev is not None and self.merge == "weighted":
                a = self.new_weight * a + (1 - self.new_weight) * prev
            merged.append((t, a))
        first_new = fresh[0][0] if fresh else math.inf
        keep = sorted((k * self.dt, a) for k, a in old.items() if k * self.dt < first_new - 1e-9)
        self.queue = deque(keep + merged)
        return d

    def pop(self, now: float) -> np.ndarray | None:
        """The action due at `now` (dropping any whose time has passed), or None when the queue is dry."""
        while self.queue and self.queue[0][0] < now - self.dt / 2:
            self.queue.popleft()
            self.dropped_stale += 1
        if self.queue and self.queue[0][0] <= now + self.dt / 2:
            return self.queue.popleft()[1]
        return None

    def needs_more(self, threshold: int) -> bool:
        return len(self.queue) < threshold


class HoldThenStop:
    """On a dry queue: hold the last position target for `hold_s`, then latch a safe stop until reset()."""

    def __init__(self, hold_s: float):
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self.last_target: np.ndarray | None = None
        self.empty_since: float | None = None
        self.stopped = False
        self.reason = ""

    def on_action(self, action: np.ndarray) -> np.ndarray | None:
        """A fresh action arrived. Returns it, or None while the safe stop is latched."""
        if self.stopped:
            return None
        self.empty_since = None
        self.last_target = np.asarray(action)
        return self.last_target

    def on_empty(self, now: float, why: str = "queue empty") -> tuple[str, np.ndarray | None]:
        """('hold', last target) within hold_s of running dry, then ('stop', None), latched."""
        if self.stopped:
            return "stop", None
        if self.empty_since is None:
            self.empty_since = now
        if self.last_target is not None and now - self.empty_since <= self.hold_s:
            return "hold", self.last_target
        self.stopped, self.reason = True, f"{why} for {now - self.empty_since:.3f} s (hold limit {self.hold_s} s)"
        return "stop", None

    def latch(self, reason: str) -> None:
        self.stopped, self.reason = True, reason

    def reset(self) -> None:
        self.stopped, self.reason, self.empty_since = False, "", None

"""The last chunk as a policy's draft: a chunk is verified against the ids of the chunk the policy returned before.

    drafter = LastChunkDraft(inner, offset=P, last=[...], whole=True)   # inner: the policy's own drafter, or None
    # whole: the prefill (ctx = P placeholder ids) verifies all of `last`
    # later rounds: while the chunk so far is a prefix of `last`, the rest of `last`; otherwise inner's proposals
    #               (none without an inner drafter: a plain step)

A closed-loop policy replans every few control steps, and while the robot holds a pose its next chunk is often the
same ids as the last one (the three-target reacher, 4 steps executed per chunk: about half of an episode's
chunks, each a short one; bench/results/NOTES.md). Proposing them costs no model call, and a chunk verified whole
takes one target call. Acceptance is the policy's rule as for any draft: exact under greedy.

Extra prefill rows are not free: on a small decoder each block of rows re-reads the weights. So the prefill
verifies `last` only when it repeated the chunk before it (LastChunk.repeated: the robot was holding), and a
chunk that moved on is verified from the round after the prefill, once its first id shows it follows `last`.

The inner drafters stay in step: a round drafted from `last` is not passed to the inner drafter's commit (it
drafted nothing), the draft decoder catches up on the context at its next draft, and a hidden-state head reads
the row that emitted the context's last id from whichever call that was. An inner drafter that reads the prefill's
own rows at its first draft (`Drafter.reads_prefill`: a prompt policy's head) gets no round of ours after the
prefill, only the whole-chunk prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .drafts import Drafter, OneSequenceDrafter


@dataclass(frozen=True)
class LastChunk:
    """What a policy remembers of the chunk it returned last: its ids, and whether they repeated the chunk
    before them (then the next prefill verifies them whole)."""
    ids: tuple
    repeated: bool = False

    def __post_init__(self):
        if not self.ids or not all(isinstance(i, int) for i in self.ids):
            raise ValueError(f"LastChunk needs a chunk's ids (a non-empty tuple of ints), got {self.ids!r}")

    def then(self, ids) -> "LastChunk":
        """The record after a chunk with these ids."""
        ids = tuple(int(i) for i in ids)
        return LastChunk(ids, ids == self.ids)


class LastChunkDraft(OneSequenceDrafter):
    """One greedy sequence: a policy chunk after `offset` prefix rows (placeholder ids in ctx). whole: the
    prefill verifies all of `last` (the policy sets it when the last chunk repeated the one before it);
    otherwise the prefill is the inner drafter's (or plain), and `last` is proposed from the round after it
    while the chunk so far is a prefix of it."""

    def __init__(self, inner: Drafter | None, offset: int, last, whole: bool):
        last = [int(i) for i in last]
        if not last:
            raise ValueError("LastChunkDraft needs the last chunk's ids, got none")
        if offset < 1:
            raise ValueError(f"offset (the prefix rows before the chunk) must be >= 1, got {offset}")
        self.inner, self.offset, self.last, self.whole = inner, offset, last, bool(whole)
        self.from_prefix = self.whole or (inner is not None and inner.from_prefix)
        # an inner drafter that reads the prefill's own rows in the round after it (a hidden-state head's
        # start) cannot have a round of ours in between
        self._follow = inner is None or not inner.reads_prefill
        self.decoder = inner.decoder if inner is not None else None
        self.kept = 0  # ids of `last` the target kept in this chunk
        self._from_last = False  # the round being verified was drafted from `last`

    def span(self, gamma: int) -> int:
        return max(self.inner.span(gamma) if self.inner is not None else gamma, len(self.last))

    def _continuation(self, ctx) -> list[int]:
        """What `last` holds after the chunk so far, when the chunk so far is a prefix of it."""
        n = len(ctx) - self.offset
        if n == 0:
            return self.last if self.whole else []
        if not self._follow or n >= len(self.last) or ctx[-1] != self.last[n - 1]:
            return []
        return self.last[n:] if ctx[self.offset:] == self.last[:n] else []

    def draft(self, ctx, gamma, out) -> int:
        got = self._continuation(ctx)
        self._from_last = self.last_draft_unpriced = bool(got)
        if got:
            n = min(len(out), len(got))
            out[:n] = got[:n]
            return n
        if self.inner is None or not gamma or (len(ctx) == self.offset and not self.inner.from_prefix):
            return 0
        return self.inner.draft(ctx, gamma, out)

    def commit(self, accepted) -> None:
        if self._from_last:  # the inner drafter drafted nothing this round
            self.kept += int(np.asarray(accepted).reshape(-1)[0])
            self._from_last = False
        elif self.inner is not None:
            self.inner.commit(accepted)

    def room(self, contexts, active) -> int:
        return self.inner.room(contexts, active) if self.inner is not None else 1 << 30

    def reset(self, b: int) -> None:
        if self.inner is not None:
            self.inner.reset(b)

"""Drafts: anything that proposes up to γ next tokens per sequence.

    propose(contexts, gamma, pick, active) -> Proposal   # contexts[b]: prompt + emitted tokens (last = pending)
    draft(ctx, gamma, out) -> c                         # one greedy sequence: proposals in out[:c] (fast_round)
    commit(accepted)                                    # accepted (B,) or int: draft tokens the target kept

Kinds: `DraftModel` (a small engine with its own KV cache), `NgramDraft` (prompt lookup, no model) and
`draft_head.HeadDraft` (a numpy MLP over a VLA prefix). `propose` serves every batch and sampling mode;
`draft` is the lean path for one greedy sequence (by default it goes through `propose`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .backends.base import Decoder
from .sampling import check_ids

# pick(logits (B, V), positions (B,)) -> (tokens (B,), q (B, V) or None): how a model draft chooses a token
Picker = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, "np.ndarray | None"]]


@dataclass
class Proposal:
    tokens: np.ndarray  # (B, γ) int64, padded past counts[b]
    counts: np.ndarray  # (B,) proposals per sequence, <= γ
    q: np.ndarray | None = None  # (B, γ, V) draft distributions; None = deterministic (point mass)


class Drafter(ABC):
    """Proposes up to gamma tokens per sequence for the target to verify (speculative_round)."""

    # the last draft() skipped what this drafter's costs are measured on (a LookupDraft round drafted by
    # lookup): its time says nothing about a proposal's cost, so auto γ does not learn from it
    last_draft_unpriced = False
    decoder = None  # the draft model's Decoder when this drafter runs one (its calls, engine time and cache)
    from_prefix = False  # drafts a chunk's first tokens from a policy's prefix alone (the first round is the prefill)
    reads_prefill = False  # its first draft after a policy's prefill reads that call's rows (no round between)
    sees_every_round = False  # draft() runs in γ = 0 rounds too, to read what their target call wrote

    @abstractmethod
    def propose(self, contexts: list[list[int]], gamma: int, pick: Picker, active: np.ndarray) -> Proposal: ...

    def span(self, gamma: int) -> int:
        """The most proposals a round asked for gamma may get from this drafter (the round sizes its verify
        call by it): gamma, except where proposals cost no model call (LookupDraft's lookup_gamma)."""
        return gamma

    def draft(self, ctx: list[int], gamma: int, out: np.ndarray) -> int:
        """One greedy sequence: write up to gamma proposals for positions len(ctx).. into out[:gamma] and
        return how many. out may be longer (up to span(gamma)); only a drafter whose span says so fills it."""
        prop = self.propose([ctx], gamma, greedy_pick, np.ones(1, bool))
        c = int(prop.counts[0])
        out[:c] = prop.tokens[0, :c]
        return c

    def model_draft(self, ctx: list[int], gamma: int, out: np.ndarray) -> int:
        """draft() as its costs are priced: what auto γ's probe times and pipelined rounds draft ahead with (a
        LookupDraft: its draft model, without the lookup)."""
        return self.draft(ctx, gamma, out)

    def commit(self, accepted: np.ndarray) -> None:
        """The target kept accepted[b] of sequence b's proposals (before its correction/bonus token)."""

    def room(self, contexts: list[list[int]], active: np.ndarray) -> int:
        """The most tokens this draft can propose now (its own capacity limit)."""
        return 1 << 30

    def reset(self, b: int) -> None:
        """Sequence b finished: forget its state."""


def load_arrays(path: str | Path, names: list[str], what: str) -> dict[str, np.ndarray]:
    """The named arrays of a numpy draft's .npz weights file, or an error naming the file and what is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {what} weights")
    with np.load(path) as z:
        missing = [n for n in names if n not in z.files]
        if missing:
            raise ValueError(f"{path} is not a {what}: missing {missing}")
        return {n: np.asarray(z[n]) for n in names}


class OneSequenceDrafter(Drafter):
    """A drafter for one greedy sequence: `draft` is the whole of it, and `propose` goes through it. span (the
    generic round passes it when it exceeds gamma): the most proposals `draft` may write (its own span(gamma))."""

    def propose(self, contexts, gamma, pick, active, span: int | None = None) -> Proposal:
        if len(contexts) != 1:
            raise ValueError(f"{type(self).__name__} drafts one sequence, got {len(contexts)}")
        tokens = np.zeros((1, max(gamma, span or 0)), np.int64)
        c = self.draft(contexts[0], gamma, tokens[0]) if active[0] else 0
        return Proposal(tokens, np.array([c]), None)

    @abstractmethod
    def draft(self, ctx: list[int], gamma: int, out: np.ndarray) -> int: ...


def greedy_pick(logits: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, None]:
    """The greedy Picker: each row's argmax. A DraftModel handed this one asks its engine for argmax ids
    only (its next_ids output), so on a device no logits come back."""
    return logits.argmax(-1), None


def max_prob(logits: np.ndarray) -> np.ndarray:
    """logits (B, V) -> (B,) the softmax probability of each row's argmax."""
    z = logits - logits.max(-1, keepdims=True)
    return 1.0 / np.exp(z).sum(-1)


def mv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (N,) @ w (N, M) on the calling thread, for the host drafts' small products. numpy's matmul hands a
    product of more than ~9000 weights to a multithreaded BLAS, whose threads then wait for cores that the
    engine's own thread pool spins on between calls, or that another process holds (a robot's computer
    always runs others); einsum's loop never leaves this thread."""
    return np.einsum("n,nm->m", x, w, optimize=False)


def top(logits: np.ndarray) -> tuple[int, float]:
    """logits (V,) -> (argmax, its softmax probability): max_prob for one row, without the batch arrays."""
    best = int(logits.argmax())
    return best, float(1.0 / np.exp(logits - logits[best]).sum())


class DraftModel(Drafter):
    """A small decoder engine drafting autoregressively from its own cache.

    Its cache covers the context up to the pending token after a catch-up call (1 token, or 2 when the
    last round accepted everything), then it feeds d_1..d_{n-1}; rows of rejected drafts are rolled back.
    A greedy draft is the argmax among the engine's argmax ids (Manifest.argmax_range: a policy engine's
    action ids, a text engine's whole vocabulary).

    Dynamic draft length: with `stop_below` > 0 a sequence stops drafting after the first proposal whose
    confidence (the softmax probability of that argmax among the argmax ids) is below it; that proposal is
    still verified (it costs the target little), the draft is not run on it. γ is then the most per round.
    """

    def __init__(self, decoder: Decoder, stop_below: float = 0.0):
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below must be in [0, 1), got {stop_below!r}")
        self.dec = self.decoder = decoder
        self.stop_below = stop_below
        self.lo, self.hi = decoder.m.argmax_range
        self._ctx_len = np.zeros(decoder.batch, dtype=np.int64)
        self._prefix: np.ndarray | None = None  # a policy chunk's prefix, run at this chunk's first draft

    def begin(self, prefix: np.ndarray) -> None:
        """A policy's new chunk after prefix (1, P, E): the cache is emptied, and the prefix rows are run at the
        chunk's first draft (a chunk that never needs one, verified whole from the last chunk, skips them)."""
        self.dec.cache.rewind_to(0)
        self._prefix = prefix

    def _prime(self) -> None:
        if self._prefix is not None:
            prefix, self._prefix = self._prefix, None
            self.dec.run(None, embeds=prefix)
            self.dec.cache.commit(prefix.shape[1])

    def room(self, contexts, active) -> int:
        longest = max((len(c) for c, a in zip(contexts, active) if a), default=0)
        return self.dec.max_context - longest + 1

    def confidence(self, logits: np.ndarray) -> np.ndarray:
        """logits (B, V) -> (B,) the probability of each row's argmax among the argmax ids."""
        return max_prob(logits[:, self.lo:self.hi])

    def propose(self, contexts, gamma, pick, active) -> Proposal:
        self._prime()
        cache, b = self.dec.cache, self.dec.batch
        n_ctx = np.array([len(c) if a else 0 for c, a in zip(contexts, active)], dtype=np.int64)
        n_new = n_ctx - cache.lengths  # (B,) catch-up tokens, >= 1 for active sequences
        s = int(n_new.max())
        feed = np.zeros((b, s), dtype=np.int64)
        for i in range(b):
            if n_new[i]:
                feed[i, :n_new[i]] = contexts[i][int(cache.lengths[i]):]
        valid = np.arange(s)[None, :] < n_new[:, None] if (n_new != s).any() else None
        by_ids = pick is greedy_pick and not self.stop_below  # only argmax ids come back from the engine
        out = self.dec.ids(feed, valid) if by_ids else self.dec(feed, valid)  # (B, s) ids | (B, s, V) logits
        last = out[np.arange(b), np.maximum(n_new - 1, 0)]  # (B,) ids | (B, V) logits
        cache.commit(n_new)
        self._ctx_len = n_ctx
        tokens = np.zeros((b, gamma), dtype=np.int64)
        counts = np.full(b, gamma, dtype=np.int64)
        drafting = active.copy()  # (B,) sequences still proposing
        qs = None
        for j in range(gamma):
            if by_ids:
                check_ids(last[active], "draft", int(n_ctx.max()) + j)
                tok, q = last, None
            elif pick is greedy_pick:
                tok, q = last[:, self.lo:self.hi].argmax(-1) + self.lo, None
            else:
                tok, q = pick(last, n_ctx + j)  # token at position n_ctx + j
            tokens[:, j] = tok
            if q is not None:
                if qs is None:
                    qs = np.empty((b, gamma, q.shape[-1]), dtype=q.dtype)
                qs[:, j] = q
            if self.stop_below > 0:
                unsure = drafting & (self.confidence(last) < self.stop_below)
                counts[unsure] = j + 1
                drafting &= ~unsure
                if not drafting.any():
                    break
            if j + 1 < gamma:
                last = (self.dec.ids if by_ids else self.dec)(tokens[:, j:j + 1])[:, 0]
                cache.commit(1)
        return Proposal(tokens, counts, qs)

    def draft(self, ctx, gamma, out) -> int:
        """propose() for one greedy sequence without per-round arrays: catch up on what the cache lacks of
        ctx, then one engine call per proposal (next_ids only, or the logits when stop_below needs them)."""
        self._prime()
        dec, lo, hi, stop = self.dec, self.lo, self.hi, self.stop_below
        feed = np.array([ctx[int(dec.cache.lengths[0]):]], np.int64)  # (1, 1 or 2) catch-up ids
        self._ctx_len[0] = len(ctx)
        for j in range(gamma):
            if stop:
                best, p = top(dec(feed)[0, -1, lo:hi])
                out[j] = best + lo
                unsure = p < stop
            else:
                out[j] = dec.ids(feed)[0, -1]
                if out[j] < 0:  # NONFINITE_ID
                    check_ids(out[j:j + 1], "draft", len(ctx) + j)
                unsure = False
            dec.cache.commit(feed.shape[1])
            if unsure:
                return j + 1  # verified, never fed to the draft
            feed = out[None, j:j + 1]  # d_{j+1}: the next call's input
        return gamma

    def commit(self, accepted) -> None:
        c = self.dec.cache
        c.rewind_to(np.minimum(c.lengths, self._ctx_len + accepted))

    def rewind(self, n: int) -> None:
        """Keep at most the first n rows of every sequence's cache: after drafting ahead of what the target
        has verified (pipelined rounds), back to what it kept. The next draft() catches up from there."""
        c = self.dec.cache
        c.rewind_to(np.minimum(c.lengths, n))

    def reset(self, b) -> None:
        self._prefix = None
        lengths = self.dec.cache.lengths.copy()
        lengths[b] = 0
        self.dec.cache.rewind_to(lengths)
        self._ctx_len[b] = 0


class LookupDraft(DraftModel):
    """Prompt lookup first, the draft model otherwise. When the context's last n tokens (n from max_ngram down
    to `lookup`) occurred earlier and what followed them gives at least min(lookup, γ) proposals, those are
    the round's drafts: they cost microseconds and no draft call. Otherwise the draft model drafts as usual.

    lookup_gamma: the most proposals a lookup round makes (0: γ, as the model). Lookup proposals are free, so
    a round drafted by lookup may verify more of them than the model's γ: only the verify call grows.

    A round that drafted by lookup leaves the draft model's cache where it was: its next call catches up on
    everything the context gained since (one call of several tokens). With sampled acceptance a lookup
    proposal is a deterministic draft (q one-hot), which keeps the rejection rule exact."""

    def __init__(self, decoder: Decoder, lookup: int, max_ngram: int, stop_below: float = 0.0,
                 lookup_gamma: int = 0):
        super().__init__(decoder, stop_below)
        if not (isinstance(lookup_gamma, (int, np.integer)) and lookup_gamma >= 0):
            raise ValueError(f"lookup_gamma must be an int >= 0 (0: the round's γ), got {lookup_gamma!r}")
        self.lookup = lookup
        self.lookup_gamma = int(lookup_gamma)
        self.ngram = NgramDraft(decoder.batch, max_ngram, lookup)  # checks 1 <= lookup <= max_ngram
        self._hit = np.zeros(decoder.batch, bool)  # (B,) propose(): sequences whose drafts came from lookup
        self._skipped = False  # draft(): the model did not run this round
        self.hits = 0  # rounds (per sequence) drafted by lookup

    def span(self, gamma: int) -> int:
        return max(gamma, self.lookup_gamma) if gamma else 0

    def _found(self, b: int, ctx: list[int], gamma: int, most: int) -> list[int]:
        """Up to `most` lookup proposals, or none when fewer than min(lookup, gamma) were found."""
        got = self.ngram.lookup(b, ctx, most)
        return got if gamma and len(got) >= min(self.lookup, gamma) else []

    def draft(self, ctx, gamma, out) -> int:
        got = self._found(0, ctx, gamma, min(len(out), self.span(gamma)))
        self._skipped = self.last_draft_unpriced = bool(got)
        if not got:
            return super().draft(ctx, gamma, out)
        self.hits += 1
        out[:len(got)] = got
        return len(got)

    def model_draft(self, ctx, gamma, out) -> int:
        return DraftModel.draft(self, ctx, gamma, out)

    def propose(self, contexts, gamma, pick, active, span: int | None = None) -> Proposal:
        """span: the most proposals per sequence (default gamma; up to span(gamma): lookup rounds only)."""
        most = gamma if span is None else min(span, self.span(gamma))
        found = [self._found(i, c, gamma, most) if a else [] for i, (c, a) in enumerate(zip(contexts, active))]
        self._hit = np.array([bool(f) for f in found])
        self.hits += int(self._hit.sum())
        prop = super().propose(contexts, gamma, pick, active)  # every active sequence: a batch call costs as much
        wide = max(map(len, found)) - gamma
        if wide > 0:  # a lookup round longer than the model's γ: room for it (past counts[b]: padding)
            prop.tokens = np.pad(prop.tokens, ((0, 0), (0, wide)))
            if prop.q is not None:
                prop.q = np.pad(prop.q, ((0, 0), (0, wide), (0, 0)))
        for i, got in enumerate(found):
            if got:
                prop.tokens[i, :len(got)] = got
                prop.counts[i] = len(got)
                if prop.q is not None:  # a deterministic draft
                    prop.q[i, :len(got)] = 0.0
                    prop.q[i, np.arange(len(got)), got] = 1.0
        return prop

    def commit(self, accepted) -> None:
        if self._skipped:  # draft(): the model's cache is as it was, a prefix of the context
            self._skipped = False
            return
        # propose(): sequences drafted by lookup keep none of the model's rows past the context (its own drafts)
        super().commit(np.where(self._hit, 0, accepted))
        self._hit[:] = False

    def reset(self, b) -> None:
        super().reset(b)
        self.ngram.reset(b)
        self._hit[b], self._skipped = False, False


class NgramDraft(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (longest n first)
    and propose what followed it (running on into its own proposals at the context's end). Costs
    microseconds, needs no model; pays on repetitive text and code."""

    def __init__(self, batch: int, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_n, self.min_n = max_ngram, min_ngram
        self._index = [dict() for _ in range(batch)]  # (n-gram tuple) -> end index of its latest occurrence
        self._upto = [0] * batch  # context positions already indexed

    def _extend(self, b: int, ctx: list[int]) -> None:
        idx, end = self._index[b], len(ctx) - 1  # index n-grams ending before the last token only
        for e in range(self._upto[b] + 1, end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                idx[tuple(ctx[e - n:e])] = e
        self._upto[b] = max(self._upto[b], end)

    def lookup(self, b: int, ctx: list[int], gamma: int) -> list[int]:
        """Up to gamma proposals: what followed the latest earlier occurrence of the context's last n tokens.
        A continuation that reaches the end of the context goes on with its own proposals (as an LZ77 copy
        overlaps its source): a span that repeats with period p is proposed for as long as asked, not p."""
        self._extend(b, ctx)
        idx = self._index[b]
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            e = idx.get(tuple(ctx[-n:]))
            if e is not None and e < len(ctx):
                got = ctx[e:e + gamma]
                back = len(ctx) - e  # the period: proposal i repeats proposal i - back
                while len(got) < gamma:
                    got.append(got[len(got) - back])
                return got
        return []

    def draft(self, ctx, gamma, out) -> int:
        got = self.lookup(0, ctx, gamma)
        out[:len(got)] = got
        return len(got)

    def propose(self, contexts, gamma, pick, active) -> Proposal:
        b = len(contexts)
        tokens = np.zeros((b, max(gamma, 1)), dtype=np.int64)
        counts = np.zeros(b, dtype=np.int64)
        for i, (ctx, a) in enumerate(zip(contexts, active)):
            if a and gamma:
                got = self.lookup(i, ctx, gamma)
                tokens[i, :len(got)] = got
                counts[i] = len(got)
        return Proposal(tokens[:, :gamma], counts, None)

    def reset(self, b) -> None:
        self._index[b], self._upto[b] = {}, 0

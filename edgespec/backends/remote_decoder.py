"""A remote target's decoder: the Decoder interface (base.py) over a RemoteTarget (remote.py), whose "KV cache"
is the committed token ids per sequence (`TokenCache`, the Cache protocol): the K/V rows live in the server's
prefix cache. A call that the server misses runs on the local target's decoder (exact fallback).
"""
from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..remote import RemoteError, RemoteUnavailable, _Failure
from .base import Capabilities, Decoder


@dataclass
class Pending:
    """A verify in flight: its new tokens, how many tokens it was sent after, its future (None: run it
    locally when its result is asked for) and when it was sent."""
    new: list[int]
    base: int
    future: Future | None
    t0: float


class TokenCache:
    """A remote decoder's cache: the committed token ids per sequence (their K/V live in the server's
    prefix cache), with KVCache's verbs: reserve, wrote, commit, rewind_to. An inputs_embeds target's also
    keeps the committed rows' embeddings (`rows`, (L, E) per sequence; ids -1 where a row came as an
    embedding, e.g. a VLA prefix)."""

    def __init__(self, batch: int, max_context: int, width: int | None = None):
        self.max_context = max_context
        self.tokens: list[list[int]] = [[] for _ in range(batch)]  # committed
        self.pending: list[list[int]] = [[] for _ in range(batch)]  # written by the last call, not committed
        self.rows = [np.zeros((0, width), np.float32) for _ in range(batch)] if width else None  # committed
        self.pending_rows = [r[:0] for r in self.rows] if width else None
        self._lengths = np.zeros(batch, np.int64)
        self._view = self._lengths.view()
        self._view.flags.writeable = False
        self.local = None  # the local target's KVCache (once a call fell back), which may lag behind
        self.follower = None  # the local target's KVCache while its last call ran there: commits go to it too

    @property
    def lengths(self) -> np.ndarray:
        return self._view

    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return self.max_context

    def reserve(self, rows: int) -> None:
        if rows > self.max_context:
            raise ValueError(f"the remote target needs {rows} positions but its max context is {self.max_context}")

    def write(self, rows: list[list[int]], embeds: list[np.ndarray] | None = None) -> None:
        self.pending = [list(r) for r in rows]
        if self.rows is not None:
            self.pending_rows = list(embeds)

    def wrote(self, s: int) -> None:
        """S rows per sequence of unknown tokens (zeros): for timing only, as KVCache.wrote."""
        self.pending = [[0] * s for _ in self.tokens]
        if self.rows is not None:
            self.pending_rows = [np.zeros((s, r.shape[1]), np.float32) for r in self.rows]

    def commit(self, n) -> None:
        n = np.broadcast_to(np.asarray(n, np.int64), self._lengths.shape)
        if (n < 0).any() or any(int(k) > len(p) for k, p in zip(n, self.pending)):
            raise ValueError(f"commit({n.tolist()}): can keep 0..{[len(p) for p in self.pending]}")
        for b, k in enumerate(n.tolist()):
            self.tokens[b].extend(self.pending[b][:k])
            self.pending[b] = self.pending[b][k:]
            self._lengths[b] = len(self.tokens[b])
            if self.rows is not None:
                self.rows[b] = np.concatenate([self.rows[b], self.pending_rows[b][:k]])
                self.pending_rows[b] = self.pending_rows[b][k:]
        if self.follower is not None:
            self.follower.commit(n)

    def rewind_to(self, lengths) -> None:
        new = np.broadcast_to(np.asarray(lengths, np.int64), self._lengths.shape)
        if (new < 0).any() or (new > self._lengths).any():
            raise ValueError(f"rewind_to({new.tolist()}): lengths must be in 0..{self._lengths.tolist()}")
        for b, k in enumerate(new.tolist()):
            del self.tokens[b][k:]
            self.pending[b] = []
            self._lengths[b] = k
            if self.rows is not None:
                self.rows[b] = self.rows[b][:k]
                self.pending_rows[b] = self.rows[b][:0]
        self.follower = None
        if self.local is not None:  # the local cache may lag behind (it catches up when it is next used)
            self.local.rewind_to(np.minimum(self.local.lengths, new))


class RemoteDecoder(Decoder):
    """The Decoder interface over a RemoteTarget: `ids(tokens)` / `__call__(tokens)` verify S new tokens per
    sequence after the committed ones; the caller commits what it keeps. Falls back to a local decoder.
    `run()` is a verify by ids whose result last_ids() then returns."""

    def __init__(self, engine, batch: int):  # engine: a RemoteTarget (remote.py)
        embeds = engine.embedding is not None
        cache = TokenCache(batch, engine.manifest.max_context, engine.manifest.hidden_size if embeds else None)
        super().__init__(engine, batch, None, cache, engine.embedding)  # embedding: (V, E) or None
        self.caps = Capabilities(logits=not embeds, batch=not embeds, embeds=embeds, steps=False,
                                 pipeline=not embeds and engine.config.pipeline, fallbacks=True)
        self.local = None  # the local target's Decoder, made at the first fallback
        self.salt = uuid.uuid4().hex  # per generation: the prefix cache only serves this one's own calls
        self.fallbacks = 0
        self._last_ids: np.ndarray | None = None

    def reset(self) -> None:
        super().reset()
        if self.local is not None:
            self.local.reset()
        self.salt = uuid.uuid4().hex
        self.fallbacks = 0

    def run(self, tokens: np.ndarray | None, valid: np.ndarray | None = None, embeds=None) -> None:
        self.ids(tokens, valid, embeds)

    # -- the calls ----------------------------------------------------------------------------------
    def ids(self, tokens: np.ndarray | None, valid: np.ndarray | None = None, embeds=None,
            last: int | None = None) -> np.ndarray:
        """(B, S) the target's argmax ids at the S new positions (rows past a sequence's valid count: 0).
        An inputs_embeds target takes ids (embedded with its table) or `embeds` (1, S, E), and computes only
        the `last` positions the caller reads (-1 before them)."""
        if self.embedding is not None:
            self._last_ids = self._call_embeds(tokens, valid, embeds, last)
        elif embeds is not None:
            raise RemoteError(f"{self.engine.dir} takes token ids, not embeddings")
        else:
            self._last_ids = self._call(tokens, valid, full=False)
        return self._last_ids

    def __call__(self, tokens: np.ndarray, valid: np.ndarray | None = None, embeds=None) -> np.ndarray:
        """(B, S, V) the target's log-probabilities at the S new positions (as logits: softmax gives the
        target's distribution). Needs a server that returns full distributions."""
        if self.embedding is not None:
            raise RemoteError("a remote inputs_embeds target verifies by ids only (greedy or relaxed acceptance): "
                              "vLLM returns no per-position distributions for embedding prompts")
        if self.engine.full_distribution is False:
            raise RemoteError(f"{self.engine.config.url}: sampled acceptance needs the target's full "
                              f"distribution at every verified position, and this server returns fewer "
                              f"log-probabilities than the vocabulary ({self.m.vocab_size}); restart it with "
                              f"--max-logprobs -1 (edgespec serve-target does), or decode greedily")
        return self._call(tokens, valid, full=True)

    def last_ids(self) -> np.ndarray:
        return self._last_ids

    # -- pipelined calls (one sequence, greedy): pipeline.py ----------------------------------------
    def submit(self, new: list[int], ahead: list[int] = ()) -> "Pending":
        """Send the verify of `new` after the committed tokens and `ahead` (tokens not committed yet that the
        call bets will be); returns at once. `result()` waits for it and writes it as a call would. Without
        the server (back-off), the call will run on the local target at result()."""
        if self.embedding is not None:
            raise RemoteError("pipelined rounds take token ids; this remote target is an inputs_embeds one")
        prefix = self.cache.tokens[0] + list(ahead)
        fut = None
        if self.engine.available():
            fut = self.engine.submit(prefix + list(new), len(prefix), self.salt)
        return Pending(list(new), len(prefix), fut, time.perf_counter())

    def result(self, p: "Pending") -> np.ndarray:
        """(len(new),) the target's argmax ids of a submitted call, whose base must now be exactly the
        committed tokens; its rows are written (commit what is kept)."""
        if p.base != len(self.cache.tokens[0]):
            raise ValueError(f"this verify was sent after {p.base} tokens, but {len(self.cache.tokens[0])} are "
                             f"committed")
        got, where = None, "remote"
        if p.future is not None:
            try:
                got = p.future.result()
            except _Failure as e:
                self.engine._failed(e)
        if got is None:
            got, where = self._local(np.array([p.new], np.int64), None, False)[0], "local"
        self._wrote([p.new], where, p.t0)
        self._last_ids = got[None]
        return got

    def _wrote(self, rows: list[list[int]], where: str, t0: float, embeds: list[np.ndarray] | None = None) -> None:
        """A call's bookkeeping: its rows written (uncommitted) into the token cache, and into the local
        cache's commits when it ran there; counters and the trace event."""
        t1 = time.perf_counter()
        self.cache.write(rows, embeds)
        self.cache.follower = self.local.cache if where == "local" else None
        self.calls += 1
        self.engine_s += t1 - t0
        if self.trace is not None:
            self.trace.append((f"{self.trace_name}.{where} S={len(rows[0])}", t0, t1))

    def hidden_at(self, b: int, position: int):
        raise RemoteError("a remote target does not return its hidden state (the text draft head needs it)")

    def _call(self, tokens, valid, full: bool) -> np.ndarray:
        if tokens is None:
            raise RemoteError("a remote target takes token ids, not embeddings")
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch:
            raise ValueError(f"tokens must be (B={self.batch}, S) ids, got shape {tokens.shape}")
        b, s = tokens.shape
        counts = valid.sum(1).astype(int) if valid is not None else np.full(b, s)
        self.cache.reserve(int(self.cache.lengths.max()) + s)
        rows = [tokens[i, :counts[i]].tolist() for i in range(b)]
        eng = self.engine
        t0 = time.perf_counter()
        got, where = None, "remote"
        if eng.available():
            try:
                got = eng.verify([self.cache.tokens[i] + rows[i] for i in range(b)],
                                 [len(t) for t in self.cache.tokens], self.salt, full)
            except _Failure as e:
                eng._failed(e)
        if got is None:
            got, where = self._local(tokens, valid, full), "local"
        # rows past a sequence's count are padding: they are written (as KVCache's are) but never kept
        self._wrote(tokens.tolist(), where, t0)
        out = np.zeros((b, s) + ((self.m.vocab_size,) if full else ()), np.float32 if full else np.int64)
        for i in range(b):
            out[i, :counts[i]] = got[i]
        return out

    def _call_embeds(self, tokens, valid, embeds, last) -> np.ndarray:
        """ids() on an inputs_embeds target (one sequence): the new rows are `embeds` (1, S, E), or the
        embeddings of `tokens` (1, S)."""
        if valid is not None:
            raise ValueError("a remote inputs_embeds target takes one sequence: no valid mask")
        if embeds is not None:
            x = np.asarray(embeds, np.float32)
            if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.m.hidden_size:
                raise ValueError(f"embeds must be (1, S, {self.m.hidden_size}), got shape {x.shape}")
            ids = [-1] * x.shape[1]
        else:
            t = np.asarray(tokens, np.int64)
            if t.ndim != 2 or t.shape[0] != 1:
                raise ValueError(f"tokens must be (1, S) ids, got shape {t.shape}")
            if t.size and (t.min() < 0 or t.max() >= self.m.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.m.vocab_size}), got {t.tolist()}")
            x, ids = self.embedding[t], t[0].tolist()
        s = x.shape[1]
        n = s if last is None else last
        if not 1 <= n <= s:
            raise ValueError(f"last must be in 1..{s} (the call's new rows), got {last}")
        self.cache.reserve(int(self.cache.lengths[0]) + s)
        eng, t0 = self.engine, time.perf_counter()
        got, where = None, "remote"
        if eng.available():
            try:
                got = eng.verify_embeds(np.concatenate([self.cache.rows[0], x[0]]), n, self.salt)
            except _Failure as e:
                eng._failed(e)
        if got is None:
            got, where = self._local_embeds(x, n), "local"
        self._wrote([ids], where, t0, [x[0]])
        out = np.full((1, s), -1, np.int64)
        out[0, s - n:] = got
        return out

    def _local_embeds(self, x: np.ndarray, n: int) -> np.ndarray:
        """_call_embeds on the local target, after catching up on the committed rows it has not seen."""
        loc = self._local_decoder()
        have = int(loc.cache.lengths[0])
        missing = self.cache.rows[0][have:]
        if len(missing):
            loc.run(None, embeds=missing[None])
            loc.cache.commit(len(missing))
        out = loc.ids(None, embeds=x)[0, -n:]
        self._count_fallback()
        return out

    def _local_decoder(self):
        """The local target's decoder (made at the first fallback); raises RemoteUnavailable without one."""
        eng = self.engine
        if eng.config.on_failure == "raise":
            why = "on_failure is 'raise'" if eng.local is not None else \
                "on_failure is 'raise' (no local target: load with local=ENGINE_DIR)"
            raise RemoteUnavailable(f"{eng.config.url}: the verify failed ({_last_failure(eng)}) and {why}")
        if self.local is None:
            self.local = eng.local.decoder(self.batch, self.embedding)
            self.cache.local = self.local.cache
        return self.local

    def _count_fallback(self) -> None:
        self.fallbacks += 1
        with self.engine.lock:
            self.engine.counters.fallbacks += 1

    def _local(self, tokens, valid, full) -> list[np.ndarray]:
        """The call on the local target, after catching up on the committed tokens it has not seen."""
        loc = self._local_decoder()
        have = loc.cache.lengths
        missing = [self.cache.tokens[i][int(have[i]):] for i in range(self.batch)]
        if any(missing):
            width = max(map(len, missing))
            feed = np.zeros((self.batch, width), np.int64)
            for i, m in enumerate(missing):
                feed[i, :len(m)] = m
            counts = np.array([len(m) for m in missing])
            loc.run(feed, np.arange(width)[None] < counts[:, None] if (counts != width).any() else None)
            loc.cache.commit(counts)
        out = loc(tokens, valid) if full else loc.ids(tokens, valid)
        if full:  # logits -> log-probabilities, as the server returns them
            out = out - np.logaddexp.reduce(out, axis=-1, keepdims=True)
        self._count_fallback()
        counts = valid.sum(1) if valid is not None else np.full(self.batch, tokens.shape[1])
        return [out[i, :counts[i]] for i in range(self.batch)]


def _last_failure(eng) -> str:  # eng: a RemoteTarget
    return ", ".join(f"{k} x{v}" for k, v in eng.counters.failures.items()) or "unreachable"

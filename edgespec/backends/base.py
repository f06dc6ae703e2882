"""The seam every backend implements: an `Engine` (an engine folder on a provider), the `Decoder` it binds to
its KV cache, and the `Cache` protocol that cache follows.

    engine = open_engine(dir, provider)        # backends/__init__.py reads the provider table
    dec = engine.decoder(batch)                 # a Decoder subclass of this backend
    ids = dec.ids(tokens)                       # (B, S) argmax ids; dec(tokens) -> (B, S, V) logits
    dec.cache.commit(n)                         # keep n of the rows the call wrote

`Decoder` holds what every backend shares: the fields (engine, manifest, batch, memory, cache, embedding,
counters, trace), the checks of a call's first input, and the epilogue of a call (`_called`: the rows the
call wrote, its outputs, the scrub of a row whose outputs were not finite, counters, trace). A backend
implements `run()` and, where its outputs are not in `_last.ids` / `_last.logits` / `_last.hidden`,
`_fetch_ids` / `last_logits`.

A decoder declares what it can do in `caps` (Capabilities); the decode loop and the drafts read those, never
the decoder's type.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from .. import contract as C
from ..compat import compat_call
from ..masks import step_inputs
from ..memory import HostMemory
from ..sampling import check_ids


@dataclass(frozen=True)
class Capabilities:
    """What a decoder can do; callers read these instead of testing the decoder's type."""
    hidden: bool = False  # hidden_at(): the final hidden state (an engine exported with --hidden)
    logits: bool = True  # __call__ returns (B, S, V) logits (sampled acceptance); else argmax ids only
    batch: bool = True  # more than one sequence per call
    embeds: bool = False  # run(None, embeds=...) on an inputs_embeds engine
    steps: bool = True  # greedy_steps(): plain greedy calls back to back (the plain decode loop)
    pipeline: bool = False  # submit() / result(): a verify in flight while the device drafts (pipeline.py)
    fallbacks: bool = False  # counts calls that ran elsewhere (`fallbacks`: a remote target's local calls)


@runtime_checkable
class Cache(Protocol):
    """What a decoder's cache offers its callers: committed rows per sequence and the verbs that move them."""

    @property
    def lengths(self) -> np.ndarray: ...  # (B,) committed rows, read-only

    def reserve(self, rows: int) -> None: ...  # room for `rows` rows per sequence

    def wrote(self, s: int) -> None: ...  # a call wrote S rows per sequence at the committed lengths

    def commit(self, n) -> None: ...  # keep n (int or (B,)) more of the written rows

    def rewind_to(self, lengths) -> None: ...  # lower the committed lengths


@runtime_checkable
class Engine(Protocol):
    """An engine folder opened on a provider (backends/__init__.py, open_engine)."""
    dir: object  # Path of the folder
    manifest: C.Manifest
    provider: str

    @property
    def embedding(self) -> np.ndarray | None: ...  # (V, E) for inputs_embeds engines, else None

    def decoder(self, batch: int = 1) -> "Decoder": ...


class EmbeddingTable:
    """Mixin for engines: `embedding`, the folder's (V, E) table for an inputs_embeds engine, loaded once."""
    _embedding: np.ndarray | None = None

    @property
    def embedding(self) -> np.ndarray | None:
        m = self.manifest
        if m.input_mode != "embeds":
            return None
        if self._embedding is None:
            self._embedding = np.load(self.dir / m.embedding_file)
        return self._embedding


class Decoder(ABC):
    """An engine bound to its KV cache: `ids(tokens)` / `__call__(tokens)` run S new tokens per sequence at the
    committed lengths; the caller commits what it keeps (`cache.commit`)."""
    caps = Capabilities()

    def __init__(self, engine, batch: int, memory: HostMemory, cache, embedding: np.ndarray | None = None):
        self.engine, self.m = engine, engine.manifest
        self.batch = batch
        self.memory = memory
        self.cache = cache
        self.embedding = embedding if embedding is not None else engine.embedding  # (V, E) or None
        self._last = None  # the last call's outputs (backend-specific: .logits, .ids, .hidden buffers)
        self.last_start = np.zeros(batch, np.int64)  # (B,) the cache length before the last call
        self._ids_host: np.ndarray | None = None  # the last call's next_ids on the host, once fetched
        self.calls = 0
        self.engine_s = 0.0  # wall time inside the engine's run (the rest of a call is host overhead)
        self.trace: list | None = None  # (name, start, end) events when profiling
        self.trace_name = "engine"

    @property
    def vocab_size(self) -> int:
        return self.m.vocab_size

    @property
    def max_context(self) -> int:
        return self.m.max_context

    def reset(self) -> None:
        """Empty cache (rewound to 0, buffers kept), zero counters, no trace."""
        self.cache.rewind_to(0)
        self.calls, self.engine_s, self.trace, self.trace_name = 0, 0.0, None, "engine"
        self._last, self._ids_host = None, None

    # -- a call's inputs -------------------------------------------------------------------------------
    def _first(self, tokens, embeds) -> np.ndarray:
        """The call's first input on the host: ids (B, S) int64, or embeds (B, S, E) float32, checked."""
        if embeds is not None:
            if self.m.input_mode != "embeds" or embeds.ndim != 3 or embeds.shape[2] != self.m.hidden_size:
                raise ValueError(f"embeds must be (B, S, {self.m.hidden_size}) for an inputs_embeds engine; "
                                 f"got {embeds.shape} for a {self.m.input_mode!r} engine")
            first = np.ascontiguousarray(embeds, dtype=np.float32)
        elif self.m.input_mode == "embeds":
            first = self.embedding[np.asarray(tokens)]
        else:
            first = np.ascontiguousarray(tokens, dtype=np.int64)
        if first.shape[0] != self.batch:
            raise ValueError(f"this decoder runs batches of {self.batch}, got {first.shape[0]} sequences")
        return first

    def _ids_or_rows(self, tokens, valid, embeds, provider: str) -> tuple[np.ndarray, np.ndarray | None]:
        """A native step's inputs (cpu-native, cuda-native): -> (ids (B, S) int64, in range; rows (B, S, E)
        float32 or None). An inputs_embeds engine gives its rows (the caller's, or its table's rows of the ids,
        checked) and zero ids; an ids engine its ids, padding (valid False) as id 0 (computed, never committed)."""
        if self.m.input_mode == "embeds":
            if tokens is not None and embeds is None:
                self._check_ids(np.asarray(tokens))
            rows = np.ascontiguousarray(self._first(tokens, embeds), np.float32)
            return np.zeros(rows.shape[:2], np.int64), rows
        if embeds is not None:
            raise ValueError(f"provider {provider!r} takes embeds on inputs_embeds engines only; this one reads ids")
        ids = self._first(tokens, None)  # (B, S) int64, checked
        if valid is not None:
            ids = np.where(valid, ids, 0)
        ids = np.ascontiguousarray(ids, np.int64)
        self._check_ids(ids)
        return ids, None

    def _check_ids(self, ids: np.ndarray) -> None:
        flat = ids.ravel().tolist()  # a call's few ids: Python's min and max are quicker than numpy's here
        if flat and (min(flat) < 0 or max(flat) >= self.m.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.m.vocab_size - 1}, got {min(flat)}..{max(flat)}")

    def _prepare(self, tokens, valid, embeds) -> tuple[np.ndarray, dict]:
        """-> (first input, the flavour's small inputs by name: masks.step_inputs) on the host, cache reserved."""
        first = self._first(tokens, embeds)
        cache, lengths = self.cache, self.cache.lengths
        cache.reserve(int(lengths.max()) + first.shape[1])
        return first, step_inputs(self.m, lengths, first.shape[1], cache.capacity, valid)

    def _inputs(self, tokens, valid, embeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A portable engine's -> (first input, position_ids (B, S), attention_bias (B, 1, S, P)) on the host,
        cache reserved (the TensorRT decoder binds these)."""
        first, small = self._prepare(tokens, valid, embeds)
        return first, small[C.POSITION_IDS], small[C.ATTENTION_BIAS]

    # -- a call ---------------------------------------------------------------------------------------
    @abstractmethod
    def run(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None) -> None:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1: one engine call; the new rows land
        in the cache, the outputs stay in the engine's memory (read them with ids() / last_logits()).

        valid (B, S) bool marks real tokens when sequences feed different counts (right padding).
        embeds (B, S, E) float32 replaces `tokens` on inputs_embeds engines (a VLA encoder's prefix).
        Every backend's run() ends in `_called`."""

    def _called(self, s: int, last, t0: float, t1: float, start: np.ndarray | None = None,
                valid: np.ndarray | None = None) -> None:
        """After an engine call of S tokens per sequence (t0..t1 inside the engine): the rows it wrote are the
        cache's, `last` holds its outputs (start: (B,) the position of its first row), a row whose outputs are
        not finite is scrubbed, and the counters and the trace move on."""
        self.cache.wrote(s)
        self._last, self._ids_host = last, None
        if start is not None:
            self.last_start = start
        self._scrub_if_failed(s, valid)
        self.engine_s += t1 - t0
        self.calls += 1
        if self.trace is not None:
            self.trace.append((f"{self.trace_name}.run S={s}", t0, t1))

    def _scrub_if_failed(self, s: int, valid: np.ndarray | None = None) -> None:
        """A call with NaN or inf logits (next_ids = NONFINITE_ID) in a real (valid) row may have written
        non-finite K/V rows: zero them, so no later call reads them (the caller still sees the failure in its
        outputs). Padding rows' outputs mean nothing (the ort flavour leaves them unspecified)."""
        ids = self.last_ids()
        if valid is not None:
            ids = np.where(valid, ids, 0)
        if ids.min() < 0:
            self.cache.zero_written(s)

    # -- the last call's outputs ----------------------------------------------------------------------
    def last_logits(self) -> np.ndarray:
        """(B, S, V) logits of the last call, on the host (on the CPU: the bound array, reused by the next
        call with the same S, so read it before then)."""
        return self.memory.to_host(self._last.logits)

    def hidden_at(self, b: int, position: int) -> np.ndarray:
        """(E,) the final hidden state the last call computed at sequence b's `position` (an engine exported
        with --hidden; the row that predicted the token at position + 1), on the host."""
        if not self.m.has_hidden:
            raise C.EngineError(f"{self.engine.dir}: this engine does not output its hidden state; re-export it "
                                f"with `edgespec export ... --hidden`")
        row = position - int(self.last_start[b])
        if self._last is None or not 0 <= row < self._last.hidden.shape[1]:
            raise ValueError(f"position {position} is not a row of the last call (it wrote rows "
                             f"{int(self.last_start[b])}.. of sequence {b})")
        return self.memory.to_host(self._last.hidden)[b, row]

    def last_ids(self) -> np.ndarray:
        """(B, S) int64 argmax ids of the last call over the manifest's argmax_ids, on the host (copied back
        once per call)."""
        if self._ids_host is None:
            self._ids_host = self._fetch_ids()
        return self._ids_host

    def _fetch_ids(self) -> np.ndarray:
        return self.memory.to_host(self._last.ids)

    def __call__(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
                 embeds: np.ndarray | None = None) -> np.ndarray:
        """run(), then the logits (B, S, V) on the host."""
        if self.m.kind == "optimum":
            return compat_call(self, tokens, valid)
        self.run(tokens, valid, embeds)
        return self.last_logits()

    def ids(self, tokens: np.ndarray | None, valid: np.ndarray | None = None,
            embeds: np.ndarray | None = None, last: int | None = None) -> np.ndarray:
        """run(), then only the argmax ids (B, S) come back to the host (greedy and relaxed decoding).
        last: the caller reads only the last `last` positions' ids (a remote target computes only those and
        returns -1 before them; an engine computes every position anyway)."""
        if self.m.kind == "optimum":
            lo, hi = self.m.argmax_range
            return compat_call(self, tokens, valid)[..., lo:hi].argmax(-1) + lo
        self.run(tokens, valid, embeds)
        return self.last_ids()

    # -- plain greedy decoding --------------------------------------------------------------------------
    def greedy_steps(self, pending: int, n: int) -> Iterator[int]:
        """Plain greedy decoding of one sequence: up to n S=1 calls, the first fed `pending` (the sequence's
        last id, not yet in the cache), each later one the argmax id of the call before; yields each call's
        id. The caller may close the generator after any id; then the cache has committed exactly the rows
        of the ids it was fed. NaN or inf logits: that row is zeroed and FloatingPointError raised. A backend
        may run the calls back to back (the ONNX Runtime decoder does); this one goes through ids()."""
        return self.greedy_steps_reference(pending, n)

    def _steps_back_to_back(self, pending: int, n: int, start: int, one, last) -> Iterator[int]:
        """The loop of a backend's greedy_steps, its calls back to back: `one(tok, row)` runs one S = 1 call of
        id `tok` at cache row `row` (the cache already reserved through row start + n - 1) and returns (t0, t1
        around the engine call, the call's argmax id); `last` is that call's outputs (the decoder's `_last`
        after the run). Yields each finite id. The lengths are committed when the run ends or the caller closes
        the generator; a non-finite row (NONFINITE_ID) is zeroed and FloatingPointError raised."""
        cache = self.cache
        tok, kept, ran = pending, 0, 0  # kept: rows whose ids came back finite (committed at the end)
        try:
            for _ in range(n):
                t0, t1, tok = one(tok, start + kept)
                self.engine_s += t1 - t0
                self.calls += 1
                ran += 1
                if self.trace is not None:
                    self.trace.append((f"{self.trace_name}.run S=1", t0, t1))
                if tok < 0:  # NONFINITE_ID: this row may hold NaN or inf
                    break
                kept += 1
                yield tok
        finally:
            cache.wrote(kept)
            cache.commit(kept)
            if ran:
                self._last, self._ids_host, self.last_start = last, None, np.array([start + ran - 1], np.int64)
        if ran > kept:
            cache.wrote(1)
            cache.zero_written(1)
            check_ids(np.array([tok]), "target", start + ran)

    def greedy_steps_reference(self, pending: int, n: int) -> Iterator[int]:
        """greedy_steps through ids() and commit(), one call at a time (slow, obvious)."""
        if self.batch != 1:
            raise ValueError(f"greedy_steps decodes one sequence; this decoder runs batches of {self.batch}")
        tok = pending
        for _ in range(n):
            tok = int(self.ids(np.array([[tok]], np.int64))[0, 0])
            check_ids(np.array([tok]), "target", int(self.cache.lengths[0]) + 1)
            self.cache.commit(1)
            yield tok

    def reference_call(self, tokens: np.ndarray, valid: np.ndarray | None = None,
                       embeds: np.ndarray | None = None) -> np.ndarray:
        """The same as __call__ through a plain, unbound engine call (slow, obvious): for tests. Backends
        without one say what to compare with instead."""
        raise NotImplementedError(f"{type(self).__name__} has no reference call: compare it with the ONNX "
                                  f"Runtime decoder of the same folder (backends/ort.py)")


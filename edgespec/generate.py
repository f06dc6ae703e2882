"""The public API: `load` an engine pair, then `generate` / `stream`.

    gen = edgespec.load("engines/demo-target", draft="engines/demo-draft")   # or draft="ngram" / None
    out = gen.generate("def fibonacci(n):", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_second, out.stats.acceptance_rate)
    for piece in gen.stream("import os\n", max_new_tokens=64): print(piece, end="")
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import contract as C
from .contract import EngineError
from .costmodel import CONTEXT_BUCKETS, DEFAULT_GAMMA_MAX, GAMMA_MAX_LIMIT, AcceptanceEstimator, CostModel, monotone
from .decoder import Decoder
from .drafts import DraftModel, Drafter, LookupDraft, NgramDraft, Proposal, greedy_pick
from .engine import OrtEngine, default_provider, draft_provider, open_engine
from .profiling import Timer
from .pipeline import PipelinedRounds
from .remote import RemoteConfig, RemoteDecoder, RemoteTarget, is_url
from .sampling import ACCEPTANCE_MODES, GumbelNoise, SamplingConfig, check_finite, check_ids, probs, sample
from .speculative import fast_round, speculative_round
from .text_head import TextHead, TextHeadDraft
from .tokenizer import TextTokenizer, check_pair

NGRAM_MAX = 4  # the n-gram draft's longest lookup, unless load(max_ngram=) says otherwise
PROBE_EVERY = 8  # with auto at γ = 0, still draft one token every this many rounds to keep α current
MEASURE_BUDGET_S = 2.0  # load-time cost measurement: repeat passes until this much time is spent ...
MEASURE_REPS = (3, 40)  # ... but at least / at most this many passes (each timing every call once)


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds that stopped at a rejected draft (α̂ = accepted / (accepted + rejections))
    gamma_max: int = 0  # presizes the lists below (they grow if a longer draft is ever seen)
    accepted_by_position: list = field(default_factory=list)  # drafts kept at position i
    tried_by_position: list = field(default_factory=list)  # drafts proposed at position i
    histogram: list = field(default_factory=list)  # rounds that kept k drafts
    gamma_history: list = field(default_factory=list)  # (new tokens so far, γ chosen)
    time_s: dict = field(default_factory=dict)  # prefill, draft, verify, sampling, other, decode, total
    target_calls: int = 0
    draft_calls: int = 0
    engine_s: float = 0.0  # time inside engine runs (target + draft) while decoding
    fallbacks: int = 0  # remote target: verify calls that ran on the local target instead (remote.py)

    def __post_init__(self):
        self._grow(self.gamma_max)

    def _grow(self, gamma: int) -> None:
        for lst, n in ((self.accepted_by_position, gamma), (self.tried_by_position, gamma),
                       (self.histogram, gamma + 1)):
            lst.extend([0] * (n - len(lst)))

    def add_round(self, kept: int, drafted: int) -> None:
        """One sequence's round: `drafted` proposals, the first `kept` of them accepted."""
        self._grow(drafted)
        self.drafted += drafted
        self.accepted += kept
        self.histogram[kept] += 1
        self.rejections += int(kept < drafted)
        for j in range(drafted):
            self.tried_by_position[j] += 1
            self.accepted_by_position[j] += int(j < kept)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding (after the prompt's prefill)."""
        d = self.time_s.get("decode", 0.0)
        return self.new_tokens / d if d else 0.0

    @property
    def host_fraction(self) -> float:
        """Share of decode wall time spent outside engine runs (Python, numpy, binding)."""
        return 1.0 - self.engine_s / self.time_s["decode"] if self.time_s.get("decode") else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Emitted tokens per target call (the prefill counts: it emits the first token); plain = 1."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(acceptance_rate=self.acceptance_rate,
                 mean_accepted_per_round=self.accepted / self.rounds if self.rounds else 0.0,
                 tokens_per_round=self.tokens_per_round, tokens_per_second=self.tokens_per_second,
                 host_fraction=self.host_fraction,
                 acceptance_by_position=[a / t if t else None for a, t in
                                         zip(self.accepted_by_position, self.tried_by_position)])
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "capacity"
    stats: Stats


@dataclass
class _Seq:
    prompt: list[int]
    ctx: list[int]
    finish: str | None = None
    text_len: int | None = None  # where a stop string cut the text


def check_text(text: str, what: str = "prompt") -> str:
    """`text` if it can be encoded as UTF-8. A str from sys.argv or os.fsdecode carries undecodable bytes as
    lone surrogates ('\\udcff'); the tokenizer cannot encode those, so refuse them here, by position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the {what} is not valid UTF-8 text: {text[e.start:e.end]!a} at character {e.start} "
                         f"(undecodable bytes, e.g. from a command line in another encoding); "
                         f"pass UTF-8 text") from None
    return text


def check_token_ids(prompt) -> list[int]:
    """A prompt of token ids (list, tuple or 1-D integer array) -> list of int. Bytes are refused: iterating
    b"def" gives the byte values 100, 101, 102, which are not this engine's token ids."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"prompt must be text (str) or a list of token ids, got {type(prompt).__name__}; "
                        f"decode bytes first, e.g. prompt.decode('utf-8')")
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise TypeError(f"prompt must be text (str) or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or isinstance(t, bool)]
    if bad:
        raise TypeError(f"token ids must be integers, got {bad[:5]!r}")
    return [int(t) for t in prompt]


def check_gamma(gamma, gamma_max: int):
    if not (gamma == "auto" or (isinstance(gamma, int) and not isinstance(gamma, bool) and 0 <= gamma <= gamma_max)):
        raise ValueError(f"gamma must be 'auto' or an integer in [0, {gamma_max}] (gamma_max {gamma_max}: raise it "
                         f"with gamma_max= / --gamma-max, up to {GAMMA_MAX_LIMIT}), got {gamma!r}")
    return gamma


def check_gamma_max(gamma_max) -> int:
    if not (isinstance(gamma_max, (int, np.integer)) and not isinstance(gamma_max, bool)
            and 1 <= gamma_max <= GAMMA_MAX_LIMIT):
        raise ValueError(f"gamma_max (the longest draft) must be an integer in [1, {GAMMA_MAX_LIMIT}], "
                         f"got {gamma_max!r}")
    return int(gamma_max)


def check_lookup_gamma(lookup_gamma, lookup: int) -> int:
    """lookup_gamma: the most proposals a round drafted by prompt lookup makes (0: the round's γ). It is not
    bounded by gamma_max (the model's longest draft): lookup proposals cost no draft call."""
    if not (isinstance(lookup_gamma, (int, np.integer)) and 0 <= lookup_gamma <= GAMMA_MAX_LIMIT):
        raise ValueError(f"lookup_gamma must be an int in 0..{GAMMA_MAX_LIMIT}: the most proposals a round drafted "
                         f"by lookup makes (0: γ); got {lookup_gamma!r}")
    if lookup_gamma and not lookup:
        raise ValueError(f"lookup_gamma={lookup_gamma} goes with lookup= (prompt lookup before the draft model)")
    return int(lookup_gamma)


def _filled(dec: Decoder, n: int) -> Decoder:
    """dec with n committed rows of zeros in its cache: for timing only (a call costs the same whatever the
    rows hold), it saves the prefill of every measured context."""
    dec.cache.reserve(n)
    dec.cache.wrote(n)
    dec.cache.commit(n)
    return dec


class _FixedDraft(Drafter):
    """Proposes γ copies of token 0 at no cost: load-time rounds with it time the host's part of a round."""

    def propose(self, contexts, gamma, pick, active) -> Proposal:
        return Proposal(np.zeros((len(contexts), gamma), np.int64), np.where(active, gamma, 0))

    def draft(self, ctx, gamma, out) -> int:
        out[:gamma] = 0
        return gamma


class Generator:
    """Decodes text with a target engine and an optional drafter. drafter_kind: None (plain decoding),
    "model" (`draft` engine), "ngram", "head" (`text_head`, over the target's hidden-state output: one greedy
    sequence), or "custom" with `drafter_factory(batch) -> Drafter`."""

    def __init__(self, target: OrtEngine, drafter_kind: str | None = None, draft: OrtEngine | None = None,
                 tokenizer: TextTokenizer | None = None, gamma: int | str = "auto",
                 gamma_max: int = DEFAULT_GAMMA_MAX, drafter_factory: Callable[[int], Drafter] | None = None,
                 max_ngram: int = NGRAM_MAX, text_head: TextHead | None = None, lookup: int = 0,
                 lookup_gamma: int = 0):
        if (drafter_kind == "head") != (text_head is not None):
            raise ValueError(f"drafter_kind 'head' goes with a text_head: got kind {drafter_kind!r}")
        if text_head is not None and not target.manifest.has_hidden:
            raise EngineError(f"{target.dir}: the text draft head reads the target's hidden state, which this "
                              f"engine does not output; re-export it with `edgespec export ... --hidden`")
        self.text_head = text_head
        if (drafter_kind == "custom") != (drafter_factory is not None):
            raise ValueError(f"drafter_kind 'custom' goes with a drafter_factory: got kind {drafter_kind!r} and "
                             f"factory {drafter_factory!r}")
        self.target, self.draft, self.drafter_kind, self.tok = target, draft, drafter_kind, tokenizer
        self.drafter_factory = drafter_factory
        NgramDraft(1, max_ngram)  # checks it
        self.max_ngram = max_ngram  # the n-gram draft's longest lookup
        if lookup and drafter_kind != "model":
            raise ValueError(f"lookup goes before a draft model (a draft engine folder); got draft kind "
                             f"{drafter_kind!r}")
        if not (isinstance(lookup, (int, np.integer)) and 0 <= lookup <= max_ngram):
            raise ValueError(f"lookup must be an int in 0..max_ngram ({max_ngram}): the shortest n-gram whose "
                             f"earlier continuation is proposed before the draft model runs (0: off); got {lookup!r}")
        self.lookup = int(lookup)
        self.gamma_max = check_gamma_max(gamma_max)
        self.lookup_gamma = check_lookup_gamma(lookup_gamma, lookup)
        if self.gamma_max + 2 > target.manifest.max_context:
            raise ValueError(f"gamma_max {gamma_max} does not fit the target's context capacity "
                             f"{target.manifest.max_context} (a verify call needs gamma_max + 1 rows after the prompt)")
        self.gamma = check_gamma(gamma, self.gamma_max)
        self.eos = set(target.manifest.eos_token_ids)
        self.cost: CostModel | None = None
        self.refine_costs = True  # auto γ: blend measured round costs into the load-time cost model
        self._free: dict[tuple, list[Decoder]] = {}  # (id(engine), batch) -> decoders no generate() holds
        self._lock = threading.Lock()
        self.trace: list | None = None  # set to a list to record (name, start, end) events (edgespec profile)
        self.lean = True  # one greedy sequence decodes through fast_round (False: the generic round, as a reference)

    # -- building blocks -------------------------------------------------------------------------
    def _decoder(self, engine: OrtEngine, batch: int) -> Decoder:
        """A decoder of `engine` for `batch` sequences: a free one from this generator's pool (its cache
        rewound, counters reset: its buffers, bindings and CUDA graphs are kept), else a new one. Each
        generate() holds its own until it ends (_release), so concurrent calls never share a cache."""
        with self._lock:
            free = self._free.get((id(engine), batch))
            dec = free.pop() if free else None
        if dec is None:
            emb = None
            if engine.manifest.input_mode == "embeds":
                emb = np.load(engine.dir / engine.manifest.embedding_file)
            dec = engine.decoder(batch, emb)
        else:
            dec.reset()
        if self.trace is not None:
            dec.trace = self.trace
            dec.trace_name = "target" if engine is self.target else "draft"
        return dec

    def _release(self, *decoders) -> None:
        with self._lock:
            for d in decoders:
                if d is not None:
                    self._free.setdefault((id(d.engine), d.batch), []).append(d)

    def _drafter(self, batch: int, target: Decoder | None = None) -> Drafter | None:
        """This generation's drafter; the head reads `target`'s last call (None: zeros, for timing)."""
        if self.drafter_kind == "head":
            if batch != 1:
                raise ValueError(f"the text draft head drafts one sequence at a time, got a batch of {batch}")
            zero = np.zeros(self.target.manifest.hidden_size, np.float32)
            return TextHeadDraft(self.text_head, (lambda ctx: target.hidden_at(0, len(ctx) - 2)) if target
                                 else (lambda ctx: zero))
        if self.drafter_kind == "model":
            dec = self._decoder(self.draft, batch)
            return LookupDraft(dec, self.lookup, self.max_ngram, lookup_gamma=self.lookup_gamma) if self.lookup \
                else DraftModel(dec)
        if self.drafter_kind == "ngram":
            return NgramDraft(batch, self.max_ngram)
        if self.drafter_kind == "custom":
            return self.drafter_factory(batch)
        return None

    def measure_costs(self, budget_s: float = MEASURE_BUDGET_S, min_reps: int = MEASURE_REPS[0],
                      max_reps: int = MEASURE_REPS[1], contexts=CONTEXT_BUCKETS, reps: int | None = None) -> CostModel:
        """Time what a round is made of on this device, at each context bucket (capped at the engines'
        capacity): target calls of S = 1..γmax+1 tokens, the drafter asked for 1 and for a few tokens (per
        proposal and per round), and whole rounds with a free draft (the host's part). After one warm-up
        pass, passes that time every call once, in a shuffled order, repeat until `budget_s` is spent (at
        least min_reps, at most max_reps passes); each cost is the median over passes. `reps`: min_reps."""
        min_reps = min_reps if reps is None else reps
        if not (budget_s >= 0 and 1 <= min_reps <= max_reps):
            raise ValueError(f"need budget_s >= 0 and 1 <= min_reps <= max_reps, got {budget_s}, {min_reps}, {max_reps}")
        m, gmax = self.target.manifest, self.gamma_max
        cap = min([m.max_context] + ([self.draft.manifest.max_context] if self.draft is not None else []))
        top = cap - gmax - 2  # room for a verify call of γmax+1 tokens (and a draft run) after the context
        if top < 1:
            raise ValueError(f"gamma_max {gmax} leaves no context to measure at (capacity {cap})")
        ctxs = sorted({min(int(c), top) for c in contexts})
        rng = np.random.default_rng(0)
        block = rng.integers(0, m.vocab_size, 32)  # contexts repeat it, so an n-gram draft finds continuations
        probes = {}  # key -> a call to time; ("verify", k, s) | ("draft", k, g) | ("round",)
        counts = {}  # ("draft", k, g) -> proposals per call
        g2 = min(4, gmax)
        for k, n in enumerate(ctxs):
            tgt = _filled(self.target.decoder(1), n)  # fresh, never pooled: it grows to this bucket's length
            for s in range(1, gmax + 2):
                probes[("verify", k, s)] = partial(tgt.ids, rng.integers(0, m.vocab_size, (1, s)))
            drafter = self._drafter(1) if self.drafter_kind else None
            if isinstance(drafter, DraftModel):
                _filled(drafter.dec, n - 1)  # the probe's draft runs catch up on the last token only
            for g in sorted({1, g2}) if drafter else ():
                probes[("draft", k, g)] = partial(self._draft_probe, drafter, list(np.resize(block, n)), g,
                                                  counts.setdefault(("draft", k, g), []))
        if self.drafter_kind:
            log: list = []
            probes[("round",)] = self._round_probe(np.resize(block, ctxs[0]).tolist(), g2, log)
        times = {key: [] for key in probes}
        keys = list(probes)
        t0, passes = time.perf_counter(), -1  # pass -1 warms every shape and is not kept
        while passes < min_reps or (passes < max_reps and time.perf_counter() - t0 < budget_s):
            if passes == 0:
                t0 = time.perf_counter()
            for i in rng.permutation(len(keys)):
                key = keys[i]
                t = time.perf_counter()
                probes[key]()
                if passes >= 0:
                    times[key].append(time.perf_counter() - t)
            passes += 1
        med = {key: float(np.median(v)) for key, v in times.items()}
        t_verify = [monotone([med[("verify", k, s)] for s in range(1, gmax + 2)]) for k in range(len(ctxs))]
        t_draft, fixed, t_round = [0.0] * len(ctxs), [0.0], 0.0
        if self.drafter_kind:
            fixed = []
            for k in range(len(ctxs)):
                (t1, c1), (t2, c2) = [(med[("draft", k, g)], float(np.median(counts[("draft", k, g)])))
                                      for g in (1, g2)]
                if c2 > c1:  # time = fixed + c·per proposal, through the two points
                    per = max(0.0, (t2 - t1) / (c2 - c1))
                    t_draft[k], f = per, max(0.0, t1 - c1 * per)
                elif c1 > 0:
                    t_draft[k], f = t1 / c1, 0.0
                else:  # never proposed anything: all of it is per round
                    f = t1
                fixed.append(f)
            host = [h for _, _, _, _, h in log[len(log) // 4:]]  # the first rounds warm up
            t_round = float(np.median(host)) if host else 0.0
        self.cost = CostModel(t_verify, t_draft, t_round, contexts=ctxs, t_draft_round=float(np.median(fixed)))
        return self.cost

    @staticmethod
    def _draft_probe(drafter: Drafter, ctx: list[int], gamma: int, counts: list) -> None:
        """One draft run over ctx (its last token pending), then the drafter forgets it again, so every run
        does a round's work at the same context: a catch-up of one token and γ proposals."""
        out = np.empty(gamma, np.int64)
        # a LookupDraft is timed as its draft model: lookup rounds cost next to nothing, model rounds are priced
        draft = DraftModel.draft if isinstance(drafter, LookupDraft) else type(drafter).draft
        counts.append(draft(drafter, ctx, gamma, out))
        if isinstance(drafter, DraftModel):  # back to ctx[:-1] in its cache
            drafter.dec.cache.rewind_to(np.minimum(drafter.dec.cache.lengths, len(ctx) - 1))

    def _round_probe(self, prompt: list[int], gamma: int, log: list):
        """-> a call that runs one real round (the decode loop's own code, logged into `log`) with a free
        draft, restarting the sequence when it ends."""
        state = [None]

        def one_round() -> None:
            for _ in range(2):
                if state[0] is None:
                    state[0] = self._rounds(self.target.decoder(1), _FixedDraft(), [prompt],
                                            self.target.manifest.max_context, SamplingConfig(), "greedy", gamma,
                                            [], log=log)
                if next(state[0], None) is not None:
                    return
                state[0] = None
        return one_round

    # -- decoding ----------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A prompt (str text, or a list / tuple / 1-D array of int token ids) -> token ids, checked."""
        if isinstance(prompt, str):
            if self.tok is None:
                raise ValueError("this engine folder has no tokenizer.json; pass token ids instead of text")
            ids = self.tok.encode(check_text(prompt))
        else:
            ids = check_token_ids(prompt)
            bad = [t for t in ids if not 0 <= t < self.target.manifest.vocab_size]
            if bad:
                raise ValueError(f"token ids must be in [0, {self.target.manifest.vocab_size}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        cap = self.target.manifest.max_context
        if len(ids) >= cap:
            raise ValueError(f"the prompt has {len(ids)} tokens but the engine's context capacity is {cap} "
                             f"(prompt plus at least one new token must fit)")
        if self.draft is not None and len(ids) >= self.draft.manifest.max_context:
            raise ValueError(f"the prompt has {len(ids)} tokens but the draft's context capacity is "
                             f"{self.draft.manifest.max_context}")
        return ids

    def _run(self, prompts: list[list[int]], max_new_tokens: int, cfg: SamplingConfig, mode: str,
             gamma: int | str, stop: list[str]) -> Iterator[tuple[list[_Seq], Stats]]:
        """Prefill, then rounds until every sequence is finished; yields after every round."""
        if self.drafter_kind == "head" and mode != "greedy":
            raise ValueError(f"the text draft head drafts for greedy decoding; got acceptance {mode!r} "
                             f"(temperature > 0): load without draft='head' to sample")
        target = self._decoder(self.target, len(prompts))
        drafter = self._drafter(len(prompts), target)
        try:
            yield from self._rounds(target, drafter, prompts, max_new_tokens, cfg, mode, gamma, stop)
        finally:
            self._release(target, drafter.dec if isinstance(drafter, DraftModel) else None)

    def _rounds(self, target: Decoder, drafter: Drafter | None, prompts: list[list[int]], max_new_tokens: int,
                cfg: SamplingConfig, mode: str, gamma: int | str, stop: list[str],
                log: list | None = None) -> Iterator[tuple[list[_Seq], Stats]]:
        """The decode loop. log: a list to append (asked γ, proposed c, draft s, verify s, host s) per round."""
        b = len(prompts)
        stats, timer = Stats(prompt_tokens=sum(map(len, prompts)), gamma_max=self.gamma_max), Timer(self.trace)
        rng = np.random.default_rng(cfg.seed)
        noise = GumbelNoise(cfg.seed or 0, self.target.manifest.vocab_size) if mode == "coupled" else None
        t0 = time.perf_counter()

        def sampled_pick(logits, positions):  # logits (B, V) -> tokens (B,), q (B, V) | None
            check_finite(logits, "draft", int(positions.max()))
            if mode == "coupled":
                return np.array([noise.pick(logits[i], cfg, i, int(positions[i])) for i in range(b)]), None
            q = probs(logits, cfg)
            return np.array([sample(q[i], rng) for i in range(b)]), q

        pick = greedy_pick if mode == "greedy" else sampled_pick  # greedy: engines return argmax ids only
        seqs = [_Seq(p, list(p)) for p in prompts]
        # prefill the prompts; the first new token comes from the prefill's last logits
        with timer("prefill"):
            lens = np.array([len(p) for p in prompts], dtype=np.int64)
            feed = np.zeros((b, int(lens.max())), dtype=np.int64)
            for i, p in enumerate(prompts):
                feed[i, :len(p)] = p
            valid = np.arange(feed.shape[1])[None] < lens[:, None] if (lens != lens.max()).any() else None
            if mode == "greedy":
                first = target.ids(feed, valid)[np.arange(b), lens - 1]  # (B,)
                check_ids(first, "target", 0)
            else:
                last = target(feed, valid)[np.arange(b), lens - 1]  # (B, V)
                check_finite(last, "target", 0)
                first, _ = pick(last, lens)
            target.cache.commit(lens)
        t_first = time.perf_counter()
        prefill_engine_s = target.engine_s
        for s, tok in zip(seqs, first):
            self._append(s, [int(tok)], max_new_tokens, stop)
        stats.new_tokens = b
        est = AcceptanceEstimator(positions=self.gamma_max)
        cap = self.target.manifest.max_context
        if b == 1 and mode == "greedy" and self.lean:
            clock = (t0, t_first, prefill_engine_s)
            if drafter is None and isinstance(target, Decoder):
                yield from self._plain_rounds(target, seqs[0], stats, timer, est, max_new_tokens, stop, clock, log)
            else:
                yield from self._lean_rounds(target, drafter, seqs[0], stats, timer, est, gamma, max_new_tokens,
                                             stop, clock, log)
            return
        while not all(s.finish for s in seqs):
            t_round0 = time.perf_counter()
            active = np.array([s.finish is None for s in seqs])
            longest = max(len(s.ctx) for s in seqs if s.finish is None)
            left = min(max_new_tokens - (len(s.ctx) - len(s.prompt)) for s in seqs if s.finish is None)
            room = min(cap - longest, left - 1, drafter.room([s.ctx for s in seqs], active) if drafter else 0)
            g = max(0, min(self._choose_gamma(gamma, est, stats, longest, room), room))
            span = min(drafter.span(g), room) if drafter else g  # lookup rounds may propose more than g
            stats.gamma_history.append((stats.new_tokens, g))
            t_draft0, t_verify0 = timer.t["draft"], timer.t["verify"]
            with timer("round"):
                new, k, n = speculative_round(target, drafter, [s.ctx for s in seqs], active, g, mode, cfg, rng,
                                              noise, pick, timer, span=span if span > g else None)
            draft_s, verify_s = timer.t["draft"] - t_draft0, timer.t["verify"] - t_verify0
            stats.rounds += 1
            for i, s in enumerate(seqs):
                if not active[i]:
                    continue
                stats.add_round(int(k[i]), int(n[i]))
                est.update(int(k[i]), int(n[i]), max(g, int(n[i])))  # lookup: n may pass g
                stats.new_tokens += self._append(s, new[i], max_new_tokens, stop)
                if s.finish is None and len(s.ctx) > cap:
                    s.finish = "capacity"
                if s.finish:
                    target.cache.rewind_to(np.where(np.arange(b) == i, 0, target.cache.lengths))  # rows unneeded
                    if drafter:
                        drafter.reset(i)
            self._close(stats, timer, target, drafter, (t0, t_first, prefill_engine_s))
            # what the round really cost, credited to what ran: c = n proposals, a verify call of c+1 tokens
            host_s = time.perf_counter() - t_round0 - draft_s - verify_s
            if log is not None:
                log.append((g, int(n.max()), draft_s, verify_s, host_s))
            if gamma == "auto" and self.cost is not None and self.refine_costs and b == 1:  # batches: not measured
                self.cost.observe(max(g, int(n[0])), int(n[0]), draft_s, verify_s, longest, host_s)
            yield seqs, stats
        self._close(stats, timer, target, drafter, (t0, t_first, prefill_engine_s))  # also when no round ran
        yield seqs, stats

    def _lean_rounds(self, target: Decoder, drafter: Drafter | None, s: _Seq, stats: Stats, timer: Timer,
                     est: AcceptanceEstimator, gamma: int | str, max_new_tokens: int, stop: list[str], clock: tuple,
                     log: list | None) -> Iterator[tuple[list[_Seq], Stats]]:
        """_rounds' loop for one greedy sequence (after the prefill): the same rounds, statistics and stops, with
        only what one sequence needs between engine calls (the host time between calls also lets the engine's
        worker threads fall asleep, which slows the next call). Tests compare it with Generator.lean = False."""
        cap, ctx, n_prompt = self.target.manifest.max_context, s.ctx, len(s.prompt)
        auto = gamma == "auto" and self.drafter_kind is not None
        fixed = gamma if self.drafter_kind is not None and not auto else 0
        one = np.ones(1, bool)
        pipelined = isinstance(target, RemoteDecoder) and target.engine.config.pipeline and \
            isinstance(drafter, DraftModel)
        round_fn = PipelinedRounds() if pipelined else fast_round
        while s.finish is None:
            t_round0 = time.perf_counter()
            n = len(ctx)
            room = min(cap - n, max_new_tokens - (n - n_prompt) - 1)
            if drafter is not None:
                room = min(room, drafter.room([ctx], one))
            g = max(0, min(self._choose_gamma(gamma, est, stats, n, room) if auto else fixed, room))
            span = min(drafter.span(g), room) if drafter is not None and not pipelined else g
            stats.gamma_history.append((stats.new_tokens, g))
            t_draft0, t_verify0 = timer.t["draft"], timer.t["verify"]
            t_fr = time.perf_counter()
            wide = {"span": span} if span > g else {}  # a lookup round may propose more than g
            new, k, c = round_fn(target, drafter if g or pipelined else None, ctx, g, timer=timer, **wide)
            if timer.events is not None:  # the profiler's per-round lane
                timer.events.append(("round", t_fr, time.perf_counter()))
            stats.rounds += 1
            stats.add_round(k, c)
            if auto:  # only auto γ reads the estimate
                est.update(k, c, max(g, c))  # a lookup round may propose more than g
            stats.new_tokens += self._append(s, new, max_new_tokens, stop)
            if s.finish is None and len(ctx) > cap:
                s.finish = "capacity"
            if auto or log is not None:
                draft_s, verify_s = timer.t["draft"] - t_draft0, timer.t["verify"] - t_verify0
                host_s = time.perf_counter() - t_round0 - draft_s - verify_s
                if log is not None:
                    log.append((g, c, draft_s, verify_s, host_s))
                if auto and self.cost is not None and self.refine_costs:
                    priced_s = 0.0 if drafter is not None and drafter.last_draft_unpriced else draft_s
                    self.cost.observe(max(g, c), c, priced_s, verify_s, n, host_s)  # draft 0 s: not learned from
            if s.finish is not None:
                break
            yield [s], stats
        target.cache.rewind_to(0)  # rows unneeded
        if drafter:
            drafter.reset(0)
        self._close(stats, timer, target, drafter, clock)
        yield [s], stats

    def _plain_rounds(self, target: Decoder, s: _Seq, stats: Stats, timer: Timer, est: AcceptanceEstimator,
                      max_new_tokens: int, stop: list[str], clock: tuple,
                      log: list | None) -> Iterator[tuple[list[_Seq], Stats]]:
        """_lean_rounds without a drafter: the target's greedy_steps run the calls back to back, and between
        two of them only the new token's bookkeeping (the same statistics, stops and per-round log)."""
        cap, ctx, n_prompt = self.target.manifest.max_context, s.ctx, len(s.prompt)
        n = len(ctx)
        steps = min(max_new_tokens - (n - n_prompt), cap - n + 1)  # calls until "length" or "capacity"
        if s.finish is None and steps < 1:  # no room at all: the generic loop says why
            yield from self._lean_rounds(target, None, s, stats, timer, est, 0, max_new_tokens, stop, clock, log)
            return
        if s.finish is None:  # (the prefill's token may have ended it)
            calls = target.greedy_steps(ctx[-1], steps)
            t_prev = time.perf_counter()
            try:
                for tok in calls:
                    t_tok = time.perf_counter()
                    timer.add("verify", t_prev, t_tok)  # the call, as fast_round counts it
                    if timer.events is not None:  # the profiler's per-round lane
                        timer.events.append(("round", t_prev, t_tok))
                    stats.gamma_history.append((stats.new_tokens, 0))
                    stats.rounds += 1
                    stats.add_round(0, 0)
                    stats.new_tokens += self._append(s, [tok], max_new_tokens, stop)
                    if s.finish is None and len(ctx) > cap:
                        s.finish = "capacity"
                    if log is not None:
                        log.append((0, 0, 0.0, t_tok - t_prev, time.perf_counter() - t_tok))
                    if s.finish is not None:
                        break
                    yield [s], stats
                    t_prev = time.perf_counter()
            finally:
                calls.close()
        target.cache.rewind_to(0)  # rows unneeded
        self._close(stats, timer, target, None, clock)
        yield [s], stats

    def _close(self, stats: Stats, timer: Timer, target: Decoder, drafter: Drafter | None, clock: tuple) -> None:
        """Bring stats' times and call counts up to now. clock: (start, first token, prefill engine s)."""
        t0, t_first, prefill_engine_s = clock
        stats.time_s = self._times(timer, t0, t_first)
        stats.target_calls = target.calls
        stats.fallbacks = getattr(target, "fallbacks", 0)
        stats.draft_calls = drafter.dec.calls if isinstance(drafter, DraftModel) else 0
        stats.engine_s = target.engine_s - prefill_engine_s + (
            drafter.dec.engine_s if isinstance(drafter, DraftModel) else 0.0)

    @staticmethod
    def _times(timer: Timer, t0: float, t_first: float) -> dict:
        now = time.perf_counter()
        t = dict(timer.t)
        named = sum(v for k, v in t.items() if k not in ("prefill", "round"))
        return {"prefill": t.get("prefill", 0.0), "draft": t.get("draft", 0.0), "verify": t.get("verify", 0.0),
                "sampling": t.get("sampling", 0.0), "other": max(0.0, (now - t_first) - named),
                "decode": now - t_first, "total": now - t0}

    def _choose_gamma(self, gamma, est: AcceptanceEstimator, stats: Stats, context: int, limit: int) -> int:
        """γ for the next round: the fixed one, or under `auto` the γ in 0..limit with the most expected tokens
        per second at this context length."""
        if self.drafter_kind is None:
            return 0
        if gamma != "auto":
            return gamma
        if self.cost is None:
            self.measure_costs()
        g = self.cost.best_gamma(est.alpha, min(limit, self.gamma_max), context, est)
        if g == 0 and stats.rounds % PROBE_EVERY == PROBE_EVERY - 1:
            g = 1  # probe: keep the acceptance estimate alive while not speculating
        return g

    def _append(self, s: _Seq, toks: list[int], max_new: int, stop: list[str]) -> int:
        """Append emitted tokens up to the first stop condition; return how many were kept."""
        kept = 0
        for t in toks:
            s.ctx.append(t)
            kept += 1
            if t in self.eos:
                s.finish = "eos"
            elif len(s.ctx) - len(s.prompt) >= max_new:
                s.finish = "length"
            if stop and self.tok is not None:
                text = self.tok.decode(s.ctx[len(s.prompt):])
                cut = min((text.find(x) for x in stop if x in text), default=-1)
                if cut >= 0:
                    s.finish, s.text_len = "stop", cut
            if s.finish:
                break
        return kept

    def _result(self, s: _Seq, stats: Stats) -> GenerationResult:
        ids = s.ctx[len(s.prompt):]
        text = self.tok.decode(ids) if self.tok is not None else ""
        if s.text_len is not None:
            text = text[:s.text_len]
        return GenerationResult(text, ids, s.finish or "length", stats)

    def _prepare(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, acceptance, gamma, stop):
        cfg = SamplingConfig(temperature, top_k, top_p, seed)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        mode = acceptance or ("greedy" if cfg.greedy else "rejection")
        if mode not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODES}, got {mode!r}")
        if mode == "greedy" and not cfg.greedy:
            raise ValueError(f"acceptance 'greedy' needs temperature 0, got {temperature}; "
                             f"use 'rejection' or 'coupled' to sample")
        if mode != "greedy" and cfg.greedy:
            mode = "greedy"  # temperature 0: every mode reduces to greedy
        gamma = check_gamma(self.gamma if gamma is None else gamma, self.gamma_max)
        if stop is not None and (isinstance(stop, str) or not all(isinstance(x, str) and x for x in stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        return [self.encode(p) for p in prompts], cfg, mode, gamma, list(stop or [])

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, acceptance: str | None = None,
                 gamma: int | str | None = None, stop: list[str] | None = None):
        """One prompt (text or ids) -> GenerationResult; a list of prompts -> a list (decoded as one batch).
        Text is a str (bytes are refused: decode them first). temperature 0 is greedy decoding; a sampling
        temperature must be >= sampling.TEMPERATURE_MIN (1e-4), below which ValueError asks for 0 instead."""
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], (int, np.integer))
        prompts = prompt if batch else [prompt]
        ids, cfg, mode, gamma, stop = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p,
                                                    seed, acceptance, gamma, stop)
        for seqs, stats in self._run(ids, max_new_tokens, cfg, mode, gamma, stop):
            pass
        out = [self._result(s, stats) for s in seqs]
        return out if batch else out[0]

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, acceptance: str | None = None,
               gamma: int | str | None = None, stop: list[str] | None = None) -> Iterator[str]:
        """Yield text as tokens are committed (one prompt). Stop strings are never streamed.
        Arguments are checked before the first token (errors raise here, not at the first next())."""
        if self.tok is None:
            raise ValueError("stream needs a tokenizer.json in the engine folder")
        ids, cfg, mode, gamma, stop = self._prepare([prompt], max_new_tokens, temperature, top_k, top_p, seed,
                                                    acceptance, gamma, stop)
        return self._stream(ids, max_new_tokens, cfg, mode, gamma, stop)

    def _stream(self, ids, max_new_tokens, cfg, mode, gamma, stop) -> Iterator[str]:
        sent, hold = 0, max((len(x) for x in stop), default=1) - 1
        for seqs, stats in self._run(ids, max_new_tokens, cfg, mode, gamma, stop):
            s = seqs[0]
            text = self._result(s, stats).text
            upto = len(text) if s.finish else max(sent, len(text) - hold)
            if text[:upto].endswith("\ufffd") and not s.finish:
                upto -= 1  # an incomplete UTF-8 sequence: wait for its next byte
            if upto > sent:
                yield text[sent:upto]
                sent = upto
        self.last_stats = stats


DRAFT_THREADS = 1  # an ONNX Runtime draft runs on the calling thread: a second ORT thread pool would fight the
#                   target's pool for the cores. A cpu-native draft shares the target's pool (one step runs
#                   at a time), so it gets the target's threads (bench/results/NOTES.md, "draft threads").


def draft_threads_for(draft_provider: str, draft_threads: int | None, threads: int | None) -> int | None:
    """The draft engine's threads: the caller's choice, else the target's on cpu-native, else DRAFT_THREADS."""
    if draft_threads is not None:
        return draft_threads
    return threads if draft_provider == "cpu-native" else DRAFT_THREADS


def load(target: str | Path, draft: str | Path | None = None, provider: str | None = None,
         threads: int | None = None, gamma: int | str = "auto", draft_threads: int | None = None,
         gamma_max: int = DEFAULT_GAMMA_MAX, max_ngram: int = NGRAM_MAX, lookup: int = 0,
         local: str | Path | None = None, remote: RemoteConfig | None = None, lookup_gamma: int = 0) -> Generator:
    """Load a target engine folder and an optional draft ('ngram' or an engine folder). gamma_max (1..16) is
    the longest draft `auto` may choose and a fixed gamma may ask for; max_ngram the longest n-gram the
    'ngram' draft looks up. lookup N (with a draft engine, 1..max_ngram): before the draft model runs, look
    the context's last N..max_ngram tokens up earlier in it, and when what followed gives at least min(N, γ)
    proposals, draft those instead (prompt lookup, no draft call). lookup_gamma (0..16): the most proposals
    such a round makes (0: γ, as the model); lookup proposals cost no draft call, so they may run longer.

    A target "http://HOST:PORT" is a vLLM server (remote.py): the draft runs here, the server verifies.
    local: a target engine folder of the same model, for the calls the server misses (exact fallback);
    remote: a RemoteConfig for the deadline, back-off and failure policy (its url is `target`)."""
    gamma_max = check_gamma_max(gamma_max)
    check_gamma(gamma, gamma_max)
    check_lookup_gamma(lookup_gamma, lookup)
    provider = provider or default_provider()
    if is_url(target):
        tgt = _remote_target(target, draft, local, remote, provider, threads)
    elif local is not None or remote is not None:
        raise ValueError(f"local= and remote= go with a target URL (a vLLM server), got target={target!r}")
    else:
        tgt = open_engine(target, provider, threads)
    tok = TextTokenizer.from_engine(tgt.dir, tgt.manifest)
    dft, kind, head = None, None, None
    if draft is not None and str(draft) == "ngram":
        kind = "ngram"
    elif draft is not None and (str(draft) == "head" or str(draft).endswith(".npz")):
        kind, head = "head", TextHead.load(tgt.dir / C.TEXT_HEAD_FILE if str(draft) == "head" else draft)
    elif draft is not None:
        dprov = draft_provider(provider, draft)
        dft = open_engine(draft, dprov, draft_threads_for(dprov, draft_threads, threads))
        check_pair(tgt.manifest, dft.manifest, target, draft)
        kind = "model"
    if gamma != "auto" and kind is None and gamma != 0:
        raise EngineError(f"gamma={gamma} needs a draft (an engine folder or 'ngram')")
    if lookup and kind != "model":
        raise ValueError(f"lookup={lookup} goes with a draft engine folder (it drafts before the draft model); "
                         f"got draft={draft!r}")
    gen = Generator(tgt, kind, dft, tok, gamma, gamma_max, max_ngram=max_ngram, text_head=head, lookup=lookup,
                    lookup_gamma=lookup_gamma)
    if gamma == "auto" and kind is not None:
        gen.measure_costs()  # at load, so the first generate's timings are its own
    return gen


def _remote_target(url: str, draft, local, remote: RemoteConfig | None, provider: str, threads) -> RemoteTarget:
    """A vLLM server as the target; its vocabulary side (tokenizer, EOS) comes from the local target engine, or
    else from the draft engine."""
    if str(draft) == "head" or str(draft).endswith(".npz"):
        raise ValueError("the text draft head reads the target's hidden state, which a remote target does not "
                         "return; use a draft engine folder or 'ngram'")
    if local is None and (draft is None or str(draft) == "ngram"):
        raise ValueError(f"a remote target needs a local engine folder for its vocabulary and tokenizer: pass "
                         f"local=TARGET_ENGINE_DIR (also the fallback) or a draft engine folder; got draft={draft!r}")
    config = dataclasses.replace(remote, url=url) if remote is not None else RemoteConfig(url)
    loc = open_engine(local, provider, threads) if local is not None else None
    side = loc.dir if loc is not None else Path(draft)
    m = loc.manifest if loc is not None else C.Manifest.read(side)
    return RemoteTarget(config, m, side, TextTokenizer.from_engine(side, m), loc)

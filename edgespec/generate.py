"""The public API: `load` an engine pair, then `generate` / `stream`.

    gen = edgespec.load("engines/demo-target", draft="engines/demo-draft")   # or draft="ngram" / None
    out = gen.generate("def fibonacci(n):", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_second, out.stats.acceptance_rate)
    for piece in gen.stream("import os\n", max_new_tokens=64): print(piece, end="")

A Generator prefills the prompts and hands the rest to the decode loop (loop.py, its round strategy chosen
once per call); how to speculate is a SpeculationConfig; automatic γ measures its costs in costmodel.py.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import contract as C
from .backends import default_provider, draft_provider as auto_draft_provider, open_engine, spec as provider_spec
from .backends.base import Decoder, Engine
from .backends.remote import RemoteTarget
from .contract import EngineError
from .costmodel import CONTEXT_BUCKETS, MEASURE_BUDGET_S, MEASURE_REPS, AcceptanceEstimator, CostModel, measure
from .drafts import DraftModel, Drafter, LookupDraft, NgramDraft, greedy_pick
from .loop import Loop, SampledRounds, Sequence, choose_rounds
from .profiling import Timer
from .remote import RemoteConfig, is_url
from .sampling import ACCEPTANCE_MODES, GumbelNoise, SamplingConfig, check_finite, check_ids, probs, sample
from .speculation import DEFAULT_GAMMA_MAX, NGRAM_MAX, SpeculationConfig, check_gamma
from .stats import RoundStats
from .attn_head import AttnHead, AttnHeadDraft, is_attention_head
from .text_head import TextHead, TextHeadDraft
from .tokenizer import TextTokenizer, check_pair

PROBE_EVERY = 8  # with auto at γ = 0, still draft one token every this many rounds to keep α current
Stats = RoundStats  # the public API's name for a generation's statistics


@dataclass
class GenerationResult:
    text: str  # token_ids' text, less a final EOS that is a special token of the tokenizer (a reply's end of turn)
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "capacity"
    stats: RoundStats



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


class Generator:
    """Decodes text with a target engine and an optional drafter. drafter_kind: None (plain decoding),
    "model" (`draft` engine), "ngram", "head" (`text_head`, over the target's hidden-state output: one greedy
    sequence), or "custom" with `drafter_factory(batch) -> Drafter`. spec: how to speculate (the keywords
    gamma .. lookup_gamma build one when it is not given)."""

    def __init__(self, target: Engine, drafter_kind: str | None = None, draft: Engine | None = None,
                 tokenizer: TextTokenizer | None = None, gamma: int | str = "auto",
                 gamma_max: int = DEFAULT_GAMMA_MAX, drafter_factory: Callable[[int], Drafter] | None = None,
                 max_ngram: int = NGRAM_MAX, text_head: TextHead | AttnHead | None = None, lookup: int = 0,
                 lookup_gamma: int = 0, spec: SpeculationConfig | None = None):
        spec = spec or SpeculationConfig(gamma, gamma_max, lookup, lookup_gamma, max_ngram)
        if (drafter_kind == "head") != (text_head is not None):
            raise ValueError(f"drafter_kind 'head' goes with a text_head: got kind {drafter_kind!r}")
        if text_head is not None and not target.manifest.has_hidden:
            raise EngineError(f"{target.dir}: the text draft head reads the target's hidden state, which this "
                              f"engine does not output; re-export it with `edgespec export ... --hidden`")
        m = target.manifest
        if text_head is not None and text_head.w.embed.shape != (m.vocab_size, m.hidden_size):
            raise ValueError(f"the text draft head was trained on a target with a {text_head.w.embed.shape} embedding "
                             f"table; {target.dir} has ({m.vocab_size}, {m.hidden_size})")
        if text_head is not None and spec.stop_below and not text_head.gives_confidence:
            raise ValueError(f"stop_below={spec.stop_below}: the attention head gives no confidence to stop on")
        self.text_head = text_head
        if (drafter_kind == "custom") != (drafter_factory is not None):
            raise ValueError(f"drafter_kind 'custom' goes with a drafter_factory: got kind {drafter_kind!r} and "
                             f"factory {drafter_factory!r}")
        self.target, self.draft, self.drafter_kind, self.tok = target, draft, drafter_kind, tokenizer
        self.drafter_factory = drafter_factory
        if spec.lookup and drafter_kind != "model":
            raise ValueError(f"lookup goes before a draft model (a draft engine folder); got draft kind "
                             f"{drafter_kind!r}")
        if spec.stop_below and drafter_kind not in ("model", "head"):
            raise ValueError(f"stop_below={spec.stop_below} stops a draft model's or the text head's run when its "
                             f"confidence falls below it; draft kind {drafter_kind!r} gives no confidence")
        self.spec = spec
        self.gamma, self.gamma_max, self.max_ngram = spec.gamma, spec.gamma_max, spec.max_ngram
        self.lookup, self.lookup_gamma = spec.lookup, spec.lookup_gamma
        if self.gamma_max + 2 > target.manifest.max_context:
            raise ValueError(f"gamma_max {self.gamma_max} does not fit the target's context capacity "
                             f"{target.manifest.max_context} (a verify call needs gamma_max + 1 rows after the prompt)")
        self.eos = set(target.manifest.eos_token_ids)
        self.cost: CostModel | None = None
        self.refine_costs = True  # auto γ: blend measured round costs into the load-time cost model
        self._free: dict[tuple, list[Decoder]] = {}  # (id(engine), batch) -> decoders no generate() holds
        self._lock = threading.Lock()
        self.trace: list | None = None  # set to a list to record (name, start, end) events (edgespec profile)
        self.lean = True  # one greedy sequence decodes through fast_round (False: the generic round, as a reference)

    def plain(self) -> "Generator":
        """A generator of the same target without a draft (plain decoding: the lossless reference)."""
        return Generator(self.target, None, None, self.tok, gamma=0)

    # -- building blocks -------------------------------------------------------------------------
    def _decoder(self, engine: Engine, batch: int) -> Decoder:
        """A decoder of `engine` for `batch` sequences: a free one from this generator's pool (its cache
        rewound, counters reset: its buffers, bindings and CUDA graphs are kept), else a new one. Each
        generate() holds its own until it ends (_release), so concurrent calls never share a cache."""
        with self._lock:
            free = self._free.get((id(engine), batch))
            dec = free.pop() if free else None
        if dec is None:
            dec = engine.decoder(batch)
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
            if self.text_head.reads_every_position:  # the attention head: the state at each position
                return AttnHeadDraft(self.text_head, (lambda p: target.hidden_at(0, p)) if target else
                                     (lambda p: zero))
            return TextHeadDraft(self.text_head, (lambda ctx: target.hidden_at(0, len(ctx) - 2)) if target
                                 else (lambda ctx: zero), self.spec.stop_below or 0.0)
        if self.drafter_kind == "model":
            dec = self._decoder(self.draft, batch)
            stop = self.spec.stop_below or 0.0  # dynamic draft length (0: always γ)
            return LookupDraft(dec, self.lookup, self.max_ngram, stop, self.lookup_gamma) if self.lookup \
                else DraftModel(dec, stop)
        if self.drafter_kind == "ngram":
            return NgramDraft(batch, self.max_ngram)
        if self.drafter_kind == "custom":
            return self.drafter_factory(batch)
        return None

    def measure_costs(self, budget_s: float = MEASURE_BUDGET_S, min_reps: int = MEASURE_REPS[0],
                      max_reps: int = MEASURE_REPS[1], contexts=CONTEXT_BUCKETS, reps: int | None = None) -> CostModel:
        """Measure auto γ's cost model on this device (costmodel.measure) and keep it. `reps`: min_reps."""
        cap = min([self.target.manifest.max_context] + ([self.draft.manifest.max_context] if self.draft else []))
        self.cost = measure(self.target, lambda: self._drafter(1) if self.drafter_kind else None, self.gamma_max,
                            cap, budget_s, min_reps if reps is None else reps, max_reps, contexts)
        return self.cost

    # -- decoding ----------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A prompt (str text, or a list / tuple / 1-D array of int token ids) -> token ids, checked."""
        if isinstance(prompt, str):
            if self.tok is None:
                raise ValueError("this engine folder has no tokenizer.json; pass token ids instead of text")
            ids = self.tok.encode_prompt(check_text(prompt))  # with the tokenizer's own BOS, as transformers
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
             gamma: int | str, stop: list[str]) -> Iterator[tuple[list[Sequence], RoundStats]]:
        """Prefill, then rounds until every sequence is finished; yields after every round."""
        if self.drafter_kind == "head" and mode != "greedy":
            raise ValueError(f"the text draft head drafts for greedy decoding; got acceptance {mode!r} "
                             f"(temperature > 0): load without draft='head' to sample")
        target = self._decoder(self.target, len(prompts))
        drafter = self._drafter(len(prompts), target)
        try:
            yield from self._decode(target, drafter, prompts, max_new_tokens, cfg, mode, gamma, stop)
        finally:
            self._release(target, drafter.decoder if drafter is not None else None)

    def _decode(self, target: Decoder, drafter: Drafter | None, prompts: list[list[int]], max_new_tokens: int,
                cfg: SamplingConfig, mode: str, gamma: int | str,
                stop: list[str]) -> Iterator[tuple[list[Sequence], RoundStats]]:
        """The prompts' prefill (its last logits give each sequence's first token), then the decode loop."""
        b = len(prompts)
        stats, timer = RoundStats(prompt_tokens=sum(map(len, prompts)), gamma_max=self.gamma_max), Timer(self.trace)
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
        seqs = [Sequence(p, list(p)) for p in prompts]
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
        clock = (t0, time.perf_counter(), target.engine_s)  # start, first token, the prefill's engine time
        for s, tok in zip(seqs, first):
            self._append(s, [int(tok)], max_new_tokens, stop)
        stats.new_tokens = b
        auto = gamma == "auto" and self.drafter_kind is not None
        est = AcceptanceEstimator(positions=self.gamma_max) if auto else None
        cap = self.target.manifest.max_context
        rounds = choose_rounds(target, drafter, b, mode == "greedy", self.lean,
                               lambda s: min(max_new_tokens - (len(s.ctx) - len(s.prompt)), cap - len(s.ctx) + 1),
                               lambda: SampledRounds(mode, cfg, rng, noise, pick))
        loop = Loop(target, drafter, rounds, lambda n, room, st: self._choose_gamma(gamma, est, st, n, room),
                    lambda s, toks: self._append(s, toks, max_new_tokens, stop), max_new_tokens, stats, timer,
                    est, self._observe if auto else None)
        for seqs in loop.run(seqs):
            yield seqs, stats
        self._close(stats, timer, target, drafter, clock)
        yield seqs, stats

    def _observe(self, *round_costs) -> None:
        """Auto γ: a round's measured costs refine the cost model (CostModel.observe)."""
        if self.cost is not None and self.refine_costs:
            self.cost.observe(*round_costs)

    def _close(self, stats: RoundStats, timer: Timer, target: Decoder, drafter: Drafter | None, clock: tuple) -> None:
        """Bring stats' times and call counts up to now. clock: (start, first token, prefill engine s)."""
        t0, t_first, prefill_engine_s = clock
        stats.time_s = self._times(timer, t0, t_first)
        stats.target_calls = target.calls
        stats.fallbacks = target.fallbacks if target.caps.fallbacks else 0
        dd = drafter.decoder if drafter is not None else None
        stats.draft_calls = dd.calls if dd is not None else 0
        stats.engine_s = target.engine_s - prefill_engine_s + (dd.engine_s if dd is not None else 0.0)

    @staticmethod
    def _times(timer: Timer, t0: float, t_first: float) -> dict:
        now = time.perf_counter()
        t = dict(timer.t)
        named = sum(v for k, v in t.items() if k not in ("prefill", "round"))
        return {"prefill": t.get("prefill", 0.0), "draft": t.get("draft", 0.0), "verify": t.get("verify", 0.0),
                "sampling": t.get("sampling", 0.0), "other": max(0.0, (now - t_first) - named),
                "decode": now - t_first, "total": now - t0}

    def _choose_gamma(self, gamma, est: AcceptanceEstimator, stats: RoundStats, context: int, limit: int) -> int:
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

    def _append(self, s: Sequence, toks: list[int], max_new: int, stop: list[str]) -> int:
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

    def _result(self, s: Sequence, stats: RoundStats) -> GenerationResult:
        ids = s.ctx[len(s.prompt):]
        shown = ids  # the text leaves out an EOS that is a control token (<|im_end|>, <|endoftext|>): not text
        if s.finish == "eos" and self.tok is not None and ids and ids[-1] in self.tok.control:
            shown = ids[:-1]
        text = self.tok.decode(shown) if self.tok is not None else ""
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

    def chat_ids(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """A conversation ([{"role": "user", "content": "..."}, ...]) -> prompt ids through the checkpoint's chat
        template (edgespec/chat.py), as transformers' apply_chat_template(..., tokenize=True) gives them.
        template_kwargs reach the template (Qwen3: enable_thinking=False)."""
        if self.tok is None:
            raise ValueError(f"{self.target.dir}: chat needs a tokenizer.json and a chat template in the engine "
                             f"folder")
        if self.tok.chat_template is None:
            raise ValueError(f"{self.target.dir}: no chat template (expected chat_template.jinja, or chat_template in "
                             f"tokenizer_config.json, copied by `edgespec export` from an instruct checkpoint); give "
                             f"a text prompt to generate() instead")
        text = self.tok.chat_template.render(messages, add_generation_prompt, **template_kwargs)
        return self.encode(self.tok.encode(text))  # the template writes its own special tokens; checked as ids

    def chat(self, messages, max_new_tokens: int = 128, template_kwargs: dict | None = None, **kwargs):
        """The assistant's reply to a conversation -> GenerationResult (kwargs: generate()'s). It ends at an EOS id
        of engine.json (the export takes generation_config.json's, which lists an instruct model's end of turn)."""
        return self.generate(self.chat_ids(messages, **(template_kwargs or {})), max_new_tokens, **kwargs)

    def stream_chat(self, messages, max_new_tokens: int = 128, template_kwargs: dict | None = None,
                    **kwargs) -> Iterator[str]:
        """stream() of the assistant's reply to a conversation."""
        return self.stream(self.chat_ids(messages, **(template_kwargs or {})), max_new_tokens, **kwargs)

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
    return threads if provider_spec(draft_provider).shared_pool else DRAFT_THREADS


def load(target: str | Path, draft: str | Path | None = None, provider: str | None = None,
         threads: int | None = None, gamma: int | str = "auto", draft_threads: int | None = None,
         gamma_max: int = DEFAULT_GAMMA_MAX, max_ngram: int = NGRAM_MAX, lookup: int = 0,
         local: str | Path | None = None, remote: RemoteConfig | None = None, lookup_gamma: int = 0,
         spec: SpeculationConfig | None = None, draft_provider: str | None = None,
         stop_below: float = 0.0) -> Generator:
    """Load a target engine folder and an optional draft ('ngram' or an engine folder). gamma_max (1..16) is
    the longest draft `auto` may choose and a fixed gamma may ask for; max_ngram the longest n-gram the
    'ngram' draft looks up. lookup N (with a draft engine, 1..max_ngram): before the draft model runs, look
    the context's last N..max_ngram tokens up earlier in it, and when what followed gives at least min(N, γ)
    proposals, draft those instead (prompt lookup, no draft call). lookup_gamma (0..16): the most proposals
    such a round makes (0: γ, as the model); lookup proposals cost no draft call, so they may run longer.
    stop_below (0..1, a draft engine or the text head): a round stops drafting after a proposal the draft gives a
    probability below it (that proposal is still verified); 0 drafts γ every round.

    A target "http://HOST:PORT" is a vLLM server (remote.py): the draft runs here, the server verifies.
    local: a target engine folder of the same model, for the calls the server misses (exact fallback);
    remote: a RemoteConfig for the deadline, back-off and failure policy (its url is `target`).
    spec: a SpeculationConfig in place of gamma, gamma_max, max_ngram, lookup, lookup_gamma and stop_below.
    draft_provider: where a draft engine folder runs (default: the target's provider, or 'cpu' where that is a
    native provider and the draft folder has no native weights): e.g. a cuda-native target with a cpu-native draft."""
    spec = spec or SpeculationConfig(gamma, gamma_max, lookup, lookup_gamma, max_ngram, stop_below)
    gamma, lookup = spec.gamma, spec.lookup
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
        path = tgt.dir / C.TEXT_HEAD_FILE if str(draft) == "head" else Path(draft)
        kind, head = "head", (AttnHead if is_attention_head(path) else TextHead).load(path)
    elif draft is not None:
        dprov = draft_provider or auto_draft_provider(provider, draft)
        dft = open_engine(draft, dprov, draft_threads_for(dprov, draft_threads, threads))
        check_pair(tgt.manifest, dft.manifest, target, draft)
        kind = "model"
    if gamma != "auto" and kind is None and gamma != 0:
        raise EngineError(f"gamma={gamma} needs a draft (an engine folder or 'ngram')")
    if lookup and kind != "model":
        raise ValueError(f"lookup={lookup} goes with a draft engine folder (it drafts before the draft model); "
                         f"got draft={draft!r}")
    gen = Generator(tgt, kind, dft, tok, text_head=head, spec=spec)
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

"""VLA policies: image + state + instruction -> an H x D chunk of continuous actions, decoded as action
tokens with optional speculative decoding.

    policy = edgespec.load_policy("engines/vla-reacher", draft="head")           # exact (greedy) by default
    actions = policy.act(image, state, "reach the red target")                  # (H, D) float64
    policy.last_info  # encode_ms, decode_ms, rounds, accepted, drafted, tokens_per_round, max_dev_bins, ...
    policy.state_names, policy.action_kind, policy.action_names, policy.action_units  # from policy.json
    edgespec.load_policy("engines/vla-reacher", draft="head", remote="http://HOST:PORT")  # target on vLLM

A Policy is safe to call from several threads (calls run one at a time). Inputs are checked as the encoder
sees them (float32 state: a value that overflows to inf is refused, by name), the encoder's prefix must be
finite, and NaN/inf logits raise FloatingPointError without leaving anything behind for the next call.

A policy folder (export/vla.py; read by policy_folder.py) holds encoder.onnx (image, state, instruction ->
prefix embeddings), a target decoder, optionally a draft decoder and a draft head (draft_head.py),
policy.json and action_stats.json. A prompt policy (export/vlm_policy.py: OpenVLA, Llava) has no state: its
encoder maps the image to image rows, and the prefix is its tokenized prompt's embeddings (the target's table)
with those rows after BOS or in place of the image token. A chunk is decoded, constrained to the action ids,
through the decode loop (loop.py, LeanRounds): H*D bins, or FAST tokens until END (then FAST's inverse DCT).
Drafts: draft="head" (from the prefix alone: the first round is the target's prefill; a prompt policy's head
reads the target's hidden state after the prefill instead; a FAST policy's, or draft="feature-head", is the
feature-level head of text_head.py, over the target's hidden state each round), draft=True (the draft decoder)
or a draft engine folder; both stop early after an unsure proposal (stop_below). Acceptance (docs/vla.md):
"greedy", exact; "relaxed", opt-in and lossy: a draft action token within `radius` bins of the target's choice
is kept (never on binary dimensions); `worst_case_deviation()`
bounds it in action units, last_info["max_dev_bins"] says what was accepted. last_chunk=True (any draft, or
none): each chunk is verified against the ids of the chunk act() returned before it (at the prefill when that
chunk repeated the one before it, else from the round after it; last_chunk.py): a robot holding a pose replans
the same chunk, which then takes one target call.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from . import contract as C
from . import policy_contract as PC
from .backends import default_provider, open_engine
from .backends.base import Decoder
from .backends.ort import plain_session
from .backends.remote import RemoteTarget
from .draft_head import HeadDraft, HiddenHeadDraft
from .drafts import DraftModel, Drafter
from .last_chunk import LastChunk, LastChunkDraft
from .loop import LeanRounds, Loop, Sequence
from .masks import step_inputs
from .policy_folder import (check_inputs, checked_file, instruction_ids, load_fast, load_feature_head, load_head,
                            load_prompt_tokenizer, prompt_ids, read_folder)
from .remote import RemoteConfig
from .speculation import DRAFT_DEFAULTS, PolicyConfig, SpeculationConfig  # noqa: F401 (this API's names)
from .speculative import RelaxedRule, greedy_rule
from .stats import RoundStats
from .text_head import TextHeadDraft

class Policy:
    def __init__(self, policy_dir: str | Path, draft: bool | str | Path = False, cfg: SpeculationConfig | None = None,
                 provider: str | None = None, threads: int | None = 1, check_hashes: bool = True,
                 remote: "str | RemoteConfig | None" = None):
        self.dir = Path(policy_dir)
        kind = "head" if draft in ("head", "feature-head") else None if draft is False or draft is None else "decoder"
        self.meta, self.manifest, self.tok = read_folder(self.dir, check_hashes)
        m = self.manifest
        if kind == "head" and m.fast:  # a FAST policy's head is its feature head, with defaults of its own
            kind = "fast-head"
        self.cfg = cfg = (cfg or PolicyConfig()).resolved(*DRAFT_DEFAULTS[kind])
        self.horizon, self.dims, self.image_size, self.state_dim = m.horizon, m.dims, m.image_size, m.state_dim
        self.words, self.instr_len, self.prefix_len = list(m.words or []), m.instr_len, m.prefix_len
        self.prompt = m.prompt  # None: word ids; else the text prompt (OpenVLA) and its tokenizer
        self.tokenizer = load_prompt_tokenizer(self.dir, m, check_hashes) if self.prompt else None
        self.fast = load_fast(self.dir, m, check_hashes) if m.fast else None  # FAST action tokens, or bins
        # the most action tokens a chunk takes: H*D bins, or FAST's longest chunk + its END
        self.max_tokens = int(m.fast["max_tokens"]) if self.fast else m.horizon * m.dims
        if self.fast is not None and cfg.acceptance != "greedy":
            raise ValueError("relaxed acceptance keeps a draft id within `radius` bins of the target's; a FAST id is "
                             "a BPE piece of DCT coefficients, so a near id is not a near action: decode FAST "
                             "policies with mode='greedy' (exact)")
        # what the state and the actions mean (robots/ read these)
        self.embodiment, self.action_kind = m.embodiment, m.action_kind
        self.state_names, self.state_units = list(m.state_names), list(m.state_units)
        self.action_names, self.action_units = list(m.action_names), list(m.action_units)
        enc = checked_file(self.dir / m.encoder_file, m.encoder_sha256, check_hashes, self.dir / PC.POLICY_FILE)
        provider = provider or default_provider()
        self.encoder = plain_session(enc, provider, threads)
        local = open_engine(self.dir / "target", provider, threads, check_hashes)
        self.remote: RemoteTarget | None = None
        if remote is not None:  # the server verifies; the folder's target is the identity probe and the fallback
            rc = RemoteConfig(remote) if isinstance(remote, str) else remote
            if not isinstance(rc, RemoteConfig):
                raise TypeError(f"remote must be a URL or a RemoteConfig, got {type(remote).__name__}")
            self.remote = RemoteTarget(rc, local.manifest, local.dir, None, local, local.embedding)
        self.target: Decoder = (self.remote or local).decoder(1)
        self._check_argmax(self.target.m, self.dir / "target")
        self.draft, self.head, self._head_draft = None, None, None
        # "head": the folder's per-dimension head, or its feature head when it has no per-dimension one (FAST never
        # does); "feature-head": the feature head
        feature = draft == "feature-head" or (draft == "head" and (
            self.fast is not None or (m.draft_head_sha256 is None and m.feature_head_sha256 is not None)))
        if feature:  # the feature-level head, over the target's hidden state each round
            tm = self.target.m
            self.head = load_feature_head(self.dir, m, self.tok, check_hashes, tm.vocab_size, tm.hidden_size)
            if not self.target.caps.hidden:
                raise C.EngineError(f"{self.dir}/target does not output its hidden state, which this policy's "
                                    f"draft head reads; re-export the policy with its feature head")
            # ctx: the prefix's placeholder ids, then the chunk's; the row that emitted ctx[-1] is len(ctx) - 2
            self._head_draft = TextHeadDraft(self.head, lambda ctx: self.target.hidden_at(0, len(ctx) - 2),
                                             cfg.stop_below)
        elif draft == "head":
            self.head = load_head(self.dir, m, self.tok, check_hashes, self.target.m.hidden_size)
            if self.prompt is not None:  # its prefix varies: the head reads the target's hidden state instead
                if not self.target.caps.hidden:
                    raise C.EngineError(f"{self.dir}/target does not output its hidden state, which this policy's "
                                        f"draft head reads; re-export the policy with its draft head")
                self._head_draft = HiddenHeadDraft(self.head, lambda pos: self.target.hidden_at(0, pos),
                                                   self.tok.first_id, cfg.stop_below)
            else:
                self._head_draft = HeadDraft(self.head, self.prefix_len, cfg.stop_below)
        elif kind == "decoder":
            ddir = self.dir / "draft" if draft is True else Path(draft)
            if not ddir.is_dir():
                raise FileNotFoundError(f"{ddir}: no draft engine folder" + (
                    f" ({self.dir} has no draft/; load without draft=True)" if draft is True else ""))
            self.draft = DraftModel(open_engine(ddir, provider, threads, check_hashes).decoder(1), cfg.stop_below)
            dm = self.draft.decoder.m
            self._check_argmax(dm, ddir)
            if dm.input_mode != "embeds":
                raise ValueError(f"{ddir} takes input_ids; a policy draft must read the encoder's prefix "
                                 f"(an inputs_embeds engine)")
            if dm.vocab_size != self.target.m.vocab_size:
                raise ValueError(f"draft vocabulary {dm.vocab_size} != target {self.target.m.vocab_size}")
        n = self.max_tokens
        if self.prefix_len + n > self.target.m.max_context:
            raise ValueError(f"prefix {self.prefix_len} + {n} action tokens exceed the decoder's context "
                             f"{self.target.m.max_context}")
        # per chunk position: how many bins a relaxed draft may be off (0 on binary / unmasked dims)
        binary = set(m.binary_dims) | set(np.nonzero(~self.tok.stats.mask)[0].tolist())
        r = cfg.radius if cfg.acceptance == "relaxed" else 0
        self._radius = np.array([0 if (j % self.dims) in binary else r for j in range(n)], np.int64)  # (H*D,)
        self.last_info: dict = {}
        self.last_chunk: LastChunk | None = None  # the chunk act() returned last (what cfg.last_chunk drafts)
        self._last_draft: LastChunkDraft | None = None  # this chunk's, when it drafts the last chunk
        # one call at a time: the decoders' caches, the draft head's context and last_info are shared state
        self._lock = threading.RLock()

    def _check_argmax(self, m: C.Manifest, where: Path) -> None:
        want = (self.tok.first_id, self.tok.vocab_end)
        if m.argmax_range != want:
            raise C.EngineError(f"{where}: its next_ids pick among ids {list(m.argmax_range)}, this policy's action "
                                f"ids are {list(want)}; re-export the policy with `edgespec export-policy`")

    # -- inputs ------------------------------------------------------------------------------------
    def instruction_ids(self, instruction: str) -> np.ndarray:
        """-> (1, L): the word ids (right-padded to instr_len), or the prompt's token ids (BOS first)."""
        if self.prompt is not None:
            p = self.prompt
            return prompt_ids(self.tokenizer, p["template"], instruction, p["append_id"])[None]
        return instruction_ids(instruction, self.words, self.instr_len)[None]

    def __call__(self, obs: dict) -> np.ndarray:
        """obs {"image", "state", "instruction"} -> (H, D): the callable the control loop and node take. A policy
        that reads no state (state_dim 0: OpenVLA's) is not given the robot's: the loop observes it for every policy."""
        return self.act(obs["image"], obs["state"] if self.state_dim else None, obs["instruction"])

    def check_inputs(self, image, state) -> tuple[np.ndarray, np.ndarray]:
        """-> image (1, S, S, 3) uint8, state (1, N) float32, checked (policy_folder.check_inputs)."""
        return check_inputs(image, state, self.manifest)

    def encode(self, image, state, instruction: str) -> np.ndarray:
        """-> prefix embeddings (1, P, E), all finite."""
        img, st = self.check_inputs(image, state)
        ids = self.instruction_ids(instruction)  # (1, L)
        if self.prompt is not None:
            # where the image rows go: right after BOS (OpenVLA), or in place of the one image token (Llava)
            image_id = self.prompt["image_token_id"]
            if image_id is None:
                at, text = 1, ids[0]
            else:
                where = np.nonzero(ids[0] == image_id)[0]
                if len(where) != 1:
                    raise ValueError(f"the prompt must hold the image token ({image_id}) once, got {len(where)}: "
                                     f"{self.prompt['template']!r}")
                at, text = int(where[0]), np.delete(ids[0], where[0])
            n, p = self.max_tokens, len(text) + self.prefix_len  # prefix_len: the image rows (+ BOS for OpenVLA)
            p -= 1 if image_id is None else 0  # OpenVLA's BOS is both in the text and in prefix_len
            if p + n > self.target.m.max_context:
                raise ValueError(f"the prompt has {ids.shape[1]} tokens: with the image rows and {n} action tokens "
                                 f"that is {p + n} positions, over the decoder's context {self.target.m.max_context}")
            with self._lock:
                rows = self.encoder.run([PC.ENC_IMAGE_EMBEDS], {PC.ENC_IMAGE: img})[0]  # (1, N, E)
            emb = self.target.embedding[text].astype(np.float32)[None]  # (1, L, E)
            prefix = np.concatenate([emb[:, :at], rows, emb[:, at:]], 1)
        else:
            feeds = {PC.ENC_IMAGE: img, PC.ENC_STATE: st, PC.ENC_INSTRUCTION: ids}
            with self._lock:  # one run at a time, like the decoders
                prefix = self.encoder.run([PC.ENC_PREFIX], feeds)[0]
        if not np.isfinite(prefix).all():
            bad = int((~np.isfinite(prefix)).sum())
            raise FloatingPointError(f"the encoder produced {bad} NaN/inf prefix values for this observation; "
                                     f"refusing to decode actions from them")
        return prefix

    # -- decoding ----------------------------------------------------------------------------------
    def _pick(self, logits: np.ndarray):  # logits (B, V) -> action ids (B,): the constrained argmax
        lo, hi = self.tok.first_id, self.tok.vocab_end
        return logits[:, lo:hi].argmax(-1) + lo

    def act(self, image, state, instruction: str) -> np.ndarray:
        """-> (H, D) continuous actions in robot units (the reacher: fingertip position targets, m)."""
        with self._lock:  # threads wait here: a call is never interleaved with another
            self.last_info = {}  # a call that raises leaves no numbers of an earlier one behind
            t0 = time.perf_counter()
            prefix = self.encode(image, state, instruction)  # (1, P, E)
            t1 = time.perf_counter()
            ids, info = self.decode_ids(prefix, last=self.last_chunk)
            t2 = time.perf_counter()
            actions = self.ids_to_actions(ids)
            # a whole chunk (ids_to_actions checked it): what the next chunk drafts first
            self.last_chunk = self.last_chunk.then(ids) if self.last_chunk else LastChunk(tuple(map(int, ids)))
            info.update(encode_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3,
                        act_ms=(time.perf_counter() - t0) * 1e3)
            self.last_info = info
            return actions

    def ids_to_actions(self, ids) -> np.ndarray:
        """A chunk's ids -> (H, D) actions in robot units: bin centres, or FAST's inverse DCT (ids through END),
        un-normalised; ids that are not a whole chunk raise ValueError saying what was got."""
        if self.fast is None:
            return self.tok.decode_chunk(np.asarray(ids), self.horizon, self.dims)
        ids = [int(i) for i in ids]
        if not ids or ids[-1] != self.fast.end_id:
            raise ValueError(f"the policy emitted {len(ids)} FAST tokens without the END token ({self.fast.end_id}); "
                             f"a chunk takes at most {self.max_tokens} with END")
        return self.tok.stats.unnormalize(self.fast.decode(ids))

    def decode_ids(self, prefix: np.ndarray, use_draft: bool | None = None, reference: bool = False,
                   last: LastChunk | None = None) -> tuple[list[int], dict]:
        """Prefix (1, P, E) -> the H*D action ids (time-major) and decoding statistics. Every target call is one
        fast_round (γ = 0 without a draft); reference=True: the generic round (slow, obvious; tests compare).
        last: a LastChunk (act() passes self.last_chunk, the chunk it returned before) that cfg.last_chunk
        drafts from; None: none. use_draft=False drafts nothing, not even the last chunk.
        NaN/inf logits raise FloatingPointError; the rows of that call are zeroed by the decoder and every
        call starts from empty caches, so a failed call changes no later one."""
        if last is not None:
            self._check_last(last)
        with self._lock:  # the caches are shared: one decode at a time
            return self._decode_ids(prefix, use_draft, reference, last)

    def _check_last(self, last) -> None:
        """A last chunk must be a LastChunk of this policy's action ids, at most max_tokens of them."""
        if not isinstance(last, LastChunk):
            raise TypeError(f"last must be a LastChunk (policy.last_chunk) or None, got {type(last).__name__}")
        lo, hi = self.tok.first_id, self.tok.vocab_end
        bad = [i for i in last.ids if not lo <= i < hi]
        if bad or len(last.ids) > self.max_tokens:
            raise ValueError(f"last chunk: want at most {self.max_tokens} action ids in [{lo}, {hi}), got "
                             f"{len(last.ids)} ids" + (f", {bad[:4]} outside" if bad else ""))

    def _drafter(self, prefix: np.ndarray, use_draft: bool | None, last: LastChunk | None) -> Drafter | None:
        """This chunk's drafter, primed with the prefix (None: plain decoding); with cfg.last_chunk and a last
        chunk, wrapped so that its ids are proposed first (LastChunkDraft)."""
        self._last_draft = None
        if use_draft is False:
            return None
        inner = self.draft
        if self._head_draft is not None:
            self._head_draft.begin(prefix)  # the prefix head projects it; the hidden-state head waits for the prefill
            inner = self._head_draft
        elif self.draft is not None:
            self.draft.begin(prefix)  # its prefix rows run at its first draft
        if self.cfg.last_chunk and last is not None:
            self._last_draft = LastChunkDraft(inner, prefix.shape[1], last.ids, last.repeated)
        return self._last_draft or inner

    def _decode_ids(self, prefix: np.ndarray, use_draft: bool | None, reference: bool,
                    last: LastChunk | None) -> tuple[list[int], dict]:
        n, p, target = self.max_tokens, prefix.shape[1], self.target
        end = self.fast.end_id if self.fast is not None else None
        target.cache.rewind_to(0)
        counter = self.head if self._head_draft is not None else self.draft.decoder if self.draft else None
        calls0 = counter.calls if counter is not None else 0
        fallbacks0 = target.fallbacks if target.caps.fallbacks else 0  # a remote target's calls run locally
        drafter = self._drafter(prefix, use_draft, last)
        # a draft that proposes from the prefix alone (the head) makes the chunk's first round the prefill; a
        # draft decoder needs the prefill's first id, so that first call is a plain step
        fused = drafter is not None and drafter.from_prefix
        rule = greedy_rule if self.cfg.acceptance == "greedy" else \
            RelaxedRule(self.tok.first_id, self.tok.vocab_end, self._radius, p)
        gamma = self.cfg.gamma

        def pace(length: int, room: int, stats) -> int:
            return 0 if drafter is None or (length == p and not fused) else gamma

        def append(s: Sequence, ids: list[int]) -> int:
            if end is not None and end in ids:  # FAST: the chunk ends at END; ids accepted after it are dropped
                ids = ids[:ids.index(end) + 1]
                s.finish = "eos"
            s.ctx += ids
            if s.finish is None and len(s.ctx) - p >= n:
                s.finish = "length"
            return len(ids)

        stats = RoundStats()
        seq = Sequence([0] * p, [0] * p)  # placeholder ids for the prefix rows, then the chunk's ids
        loop = Loop(target, drafter, LeanRounds(rule, prefix, reference), pace, append, n, stats, release=False)
        for _ in loop.run([seq]):
            pass
        stats.target_calls = stats.rounds  # one target call per round
        if counter is not None and drafter is not None:
            stats.draft_calls = counter.calls - calls0
        info = stats.policy_info()
        info["last_chunk_kept"] = self._last_draft.kept if self._last_draft is not None else None
        info["max_dev_bins"] = getattr(rule, "max_dev_bins", 0)
        if self.remote is not None:
            info["fallbacks"] = target.fallbacks - fallbacks0
        return seq.ctx[p:p + n], info

    def worst_case_deviation(self) -> np.ndarray:
        """(D,) the most a relaxed token can differ from the target's choice, per action dimension in that
        dimension's unit (self.action_names[j] in self.action_units[j]; the reacher: fingertip.x / .y in m)."""
        s = self.tok.stats
        r = self._radius[:self.dims].astype(np.float64)
        return r * (s.q99 - s.q01) / (self.tok.n_bins - 1) * np.where(s.mask, 1.0, 0.0)

    def reference_ids(self, prefix: np.ndarray) -> list[int]:
        """Plain greedy decoding through whole-sequence engine calls without a cache (slow, obvious): for tests."""
        n, m, emb = self.max_tokens, self.target.m, self.target.embedding
        ids: list[int] = []
        while len(ids) < n and (self.fast is None or not ids or ids[-1] != self.fast.end_id):  # no cache
            x = np.concatenate([prefix[0], emb[ids]], 0)[None] if ids else prefix
            s = x.shape[1]
            feeds = {m.inputs[0].name: x.astype(np.float32), **step_inputs(m, np.zeros(1, np.int64), s, s)}
            for past, _ in C.cache_names(m.num_layers):  # rows 0..s-1: written by the call
                feeds[past] = np.zeros((1, m.num_kv_heads, s, m.head_dim), m.cache_dtype)
            ids.append(int(self._pick(self.target.engine.run(feeds)[C.LOGITS][0, -1][None])[0]))
        return ids


def load_policy(policy_dir: str | Path, draft: bool | str | Path = False, mode: str = "greedy", radius: int = 5,
                gamma: int | None = None, stop_below: float | None = None, provider: str | None = None,
                threads: int | None = 1, remote: str | RemoteConfig | None = None,
                spec: SpeculationConfig | None = None, last_chunk: bool = False) -> Policy:
    """Load an exported VLA policy folder. draft="head" decodes speculatively with the folder's numpy draft
    head (the fastest here; its feature head when it has no per-dimension one), draft="feature-head" with its
    feature head, draft=True with its draft/ decoder engine, a path with that draft engine folder.
    gamma / stop_below default per draft kind (DRAFT_DEFAULTS); last_chunk=True: each chunk is verified against
    the ids of the chunk act() returned before it first (with any draft, or none; last_chunk.py); spec: a
    SpeculationConfig (kind "policy") in place of mode, radius, gamma, stop_below and last_chunk. provider: as
    edgespec.load (None: cuda where it exists).

    remote: a vLLM server serving the policy's target checkpoint (`edgespec serve-target
    models/vla-reacher/target`), as a URL or a RemoteConfig. The drafts stay on the device and the server
    verifies them; a verify that fails runs on the folder's own target (on_failure "local", exact), or
    raises RemoteUnavailable (on_failure "raise": in the control loop the robot holds, then stops).
    last_info["fallbacks"] counts the chunk's calls that ran locally."""
    return Policy(policy_dir, draft, spec or PolicyConfig(mode, radius, gamma, stop_below, last_chunk), provider,
                  threads, remote=remote)

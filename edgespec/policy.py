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

A policy folder (export/vla.py) holds encoder.onnx (image, state, instruction -> prefix embeddings), a
target decoder and optionally a draft decoder (inputs_embeds engines that read the prefix, then action
ids) and a draft head (draft_head.npz: a numpy MLP over the prefix and the ids so far, edgespec/draft_head.py),
policy.json and action_stats.json. Decoding is constrained to the action ids. policy.json is checked
at load (PolicyManifest: one PolicyFileError naming the file and the field) and, with check_hashes, so are
its content and action_stats.json against the content hash export wrote (check_policy_content).

Decoding: every target call is one `speculative.fast_round` (a plain step is a round with γ = 0).
Drafts: draft="head" (the numpy draft head: it drafts from the prefix alone, so a chunk's first round is
the target's prefill), draft=True (the draft decoder engine) or a draft engine folder. Both stop a round
early after a proposal they are unsure of (stop_below); γ and stop_below default per draft kind
(DRAFT_DEFAULTS, picked by bench/bench_vla.py's sweeps).

Acceptance:
  "greedy"   exact: the actions are identical to plain greedy decoding with the target;
  "relaxed"  opt-in, lossy: a draft action token is kept when it is within `radius` bins of the target's
             choice at that position (same action dimension by construction); binary dimensions and
             non-action tokens are never relaxed. `worst_case_deviation()` gives the bound per token in
             action units; last_info reports the largest bin distance actually accepted.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import contract as C
from .contract import HEAD_FILE, STATS_FILE, PolicyManifest, check_policy_content, read_policy_json, require_content_hash
from .actions import ActionStats, ActionTokenizer
from .decoder import Decoder
from .draft_head import DraftHead, HeadDraft
from .drafts import DraftModel, Drafter
from .engine import open_engine, session_options
from .masks import step_inputs
from .remote import RemoteConfig, RemoteTarget
from .speculative import RelaxedRule, fast_round, greedy_rule, reference_round

MODES = ("greedy", "relaxed")
# (gamma, stop_below) when not given, per draft kind: picked by bench/bench_vla.py's sweeps on this CPU
# (bench/results/vla.json "settings"). The head is cheap, so it drafts long runs and stops when unsure.
DRAFT_DEFAULTS = {"head": (15, 0.7), "decoder": (8, 0.5), None: (8, 0.0)}


def instruction_ids(instruction: str, words: list[str], length: int) -> np.ndarray:
    """The instruction's word ids (L,), right-padded with 0 (<pad>); unknown words are an error."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
    got = instruction.lower().split()
    unknown = [w for w in got if w not in words]
    if unknown:
        raise ValueError(f"unknown words {unknown} in instruction {instruction!r}; the policy knows "
                         f"{[w for w in words if w != '<pad>']}")
    if len(got) > length:
        raise ValueError(f"instruction has {len(got)} words; the policy takes at most {length}")
    ids = np.zeros(length, np.int64)
    ids[:len(got)] = [words.index(w) for w in got]
    return ids


@dataclass
class PolicyConfig:
    mode: str = "greedy"
    radius: int = 5  # relaxed: bins a draft token may differ from the target's choice
    gamma: int | None = None  # the most draft tokens per round (None: the draft kind's default, DRAFT_DEFAULTS)
    stop_below: float | None = None  # dynamic draft length: stop after a proposal the draft gives p < this
    #                                  (0: always γ; None: the draft kind's default)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.radius, int) or self.radius < 0:
            raise ValueError(f"radius must be an integer >= 0 (bins), got {self.radius!r}")
        if self.gamma is not None and (not isinstance(self.gamma, int) or not 1 <= self.gamma <= 32):
            raise ValueError(f"gamma must be an integer in [1, 32], got {self.gamma!r}")
        if self.stop_below is not None and (not isinstance(self.stop_below, (int, float))
                                            or not 0.0 <= self.stop_below < 1.0):
            raise ValueError(f"stop_below must be a probability in [0, 1), got {self.stop_below!r}")


class Policy:
    def __init__(self, policy_dir: str | Path, draft: bool | str | Path = False, cfg: PolicyConfig | None = None,
                 provider: str = "cpu", threads: int | None = 1, check_hashes: bool = True,
                 remote: "str | RemoteConfig | None" = None):
        import onnxruntime as ort

        self.dir = Path(policy_dir)
        cfg = cfg or PolicyConfig()
        kind = "head" if draft == "head" else None if draft is False or draft is None else "decoder"
        g, sb = DRAFT_DEFAULTS[kind]
        self.cfg = cfg = PolicyConfig(cfg.mode, cfg.radius, g if cfg.gamma is None else cfg.gamma,
                                      sb if cfg.stop_below is None else cfg.stop_below)
        path = self.dir / C.POLICY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{self.dir} is not a policy folder: no {C.POLICY_FILE} "
                                    f"(export one with `edgespec export-policy`)")
        self.meta = meta = read_policy_json(path)
        if check_hashes:
            require_content_hash(path, meta)  # an older export: say "re-export" before naming missing fields
        self.manifest = m = PolicyManifest.from_dict(meta, path)
        if check_hashes:
            check_policy_content(self.dir, meta)
        self.horizon, self.dims, self.image_size, self.state_dim = m.horizon, m.dims, m.image_size, m.state_dim
        self.words, self.instr_len, self.prefix_len = list(m.words), m.instr_len, m.prefix_len
        # what the state and the actions mean (robots/ read these)
        self.embodiment, self.action_kind = m.embodiment, m.action_kind
        self.state_names, self.state_units = list(m.state_names), list(m.state_units)
        self.action_names, self.action_units = list(m.action_names), list(m.action_units)
        stats = ActionStats.load(self.dir / STATS_FILE)
        if stats.dims != self.dims:
            raise ValueError(f"{self.dir}/{STATS_FILE} has {stats.dims} dimensions but the policy emits "
                             f"{self.dims} per step")
        self.tok = ActionTokenizer(m.vocab_end, m.n_bins, stats)
        enc_path = self.dir / m.encoder_file
        if check_hashes and m.encoder_sha256 and C.file_sha256(enc_path) != m.encoder_sha256:
            raise C.EngineError(f"{enc_path} does not match the sha256 in {path}")
        self.encoder = ort.InferenceSession(str(enc_path), sess_options=session_options(threads),
                                            providers=["CPUExecutionProvider"])
        local = open_engine(self.dir / "target", provider, threads, check_hashes)
        self.remote: RemoteTarget | None = None
        if remote is not None:  # the server verifies; the folder's target is the identity probe and the fallback
            rc = RemoteConfig(remote) if isinstance(remote, str) else remote
            if not isinstance(rc, RemoteConfig):
                raise TypeError(f"remote must be a URL or a RemoteConfig, got {type(remote).__name__}")
            self.remote = RemoteTarget(rc, local.manifest, local.dir, None, local,
                                       np.load(local.dir / local.manifest.embedding_file))
        self.target = self._decoder(self.remote or local)
        self._check_argmax(self.target.m, self.dir / "target")
        self.draft, self.head, self._head_draft = None, None, None
        if draft == "head":
            hpath = self.dir / HEAD_FILE
            if not hpath.is_file():
                raise FileNotFoundError(f"{hpath}: this policy folder has no draft head (collect its data "
                                        f"with `python -m edgespec.robots.demos on-policy`, then train it with "
                                        f"`python -m edgespec.export.train_draft_head`)")
            if check_hashes and m.draft_head_sha256 and C.file_sha256(hpath) != m.draft_head_sha256:
                raise C.EngineError(f"{hpath} does not match the sha256 in {path}")
            self.head = DraftHead.load(hpath)
            if self.tok.first_id != 0 or self.head.n_ids != self.tok.vocab_end:
                raise ValueError(f"the draft head proposes ids 0..{self.head.n_ids - 1}; this policy's action ids "
                                 f"are {self.tok.first_id}..{self.tok.vocab_end - 1}")
            if (self.head.dims, self.head.w.horizon) != (self.dims, self.horizon):
                raise ValueError(f"draft head is for {self.head.w.horizon}x{self.head.dims} chunks, the policy "
                                 f"emits {self.horizon}x{self.dims}")
            self._head_draft = HeadDraft(self.head, self.prefix_len, self.cfg.stop_below)
        elif draft is not False and draft is not None:
            ddir = self.dir / "draft" if draft is True else Path(draft)
            if not ddir.is_dir():
                raise FileNotFoundError(f"{ddir}: no draft engine folder" + (
                    f" ({self.dir} has no draft/; load without draft=True)" if draft is True else ""))
            self.draft = DraftModel(self._decoder(open_engine(ddir, provider, threads, check_hashes)),
                                    self.cfg.stop_below)
            self._check_argmax(self.draft.dec.m, ddir)
            if self.draft.dec.m.input_mode != "embeds":
                raise ValueError(f"{ddir} takes input_ids; a policy draft must read the encoder's prefix "
                                 f"(an inputs_embeds engine)")
            if self.draft.dec.m.vocab_size != self.target.m.vocab_size:
                raise ValueError(f"draft vocabulary {self.draft.dec.m.vocab_size} != target "
                                 f"{self.target.m.vocab_size}")
        n = self.horizon * self.dims
        if self.prefix_len + n > self.target.m.max_context:
            raise ValueError(f"prefix {self.prefix_len} + {n} action tokens exceed the decoder's context "
                             f"{self.target.m.max_context}")
        # per chunk position: how many bins a relaxed draft may be off (0 on binary / unmasked dims)
        binary = set(m.binary_dims) | set(np.nonzero(~stats.mask)[0].tolist())
        r = self.cfg.radius if self.cfg.mode == "relaxed" else 0
        self._radius = np.array([0 if (j % self.dims) in binary else r for j in range(n)], np.int64)  # (H*D,)
        self.last_info: dict = {}
        # one call at a time: the decoders' caches, the draft head's context and last_info are shared state
        self._lock = threading.RLock()

    def _check_argmax(self, m: C.Manifest, where: Path) -> None:
        want = (self.tok.first_id, self.tok.vocab_end)
        if m.argmax_range != want:
            raise C.EngineError(f"{where}: its next_ids pick among ids {list(m.argmax_range)}, this policy's action "
                                f"ids are {list(want)}; re-export the policy with `edgespec export-policy`")

    @staticmethod
    def _decoder(engine) -> Decoder:
        return engine.decoder(1, np.load(engine.dir / engine.manifest.embedding_file))

    # -- inputs ------------------------------------------------------------------------------------
    def instruction_ids(self, instruction: str) -> np.ndarray:
        return instruction_ids(instruction, self.words, self.instr_len)[None]  # (1, L)

    def __call__(self, obs: dict) -> np.ndarray:
        """obs {"image", "state", "instruction"} -> (H, D): the callable the control loop and node take."""
        return self.act(obs["image"], obs["state"], obs["instruction"])

    def check_inputs(self, image, state) -> tuple[np.ndarray, np.ndarray]:
        """-> image (1, S, S, 3) uint8, state (1, N) float32: checked as the encoder will see them (a state
        finite in float64 can still overflow to inf in float32)."""
        image, state = np.asarray(image), np.asarray(state)
        want = (self.image_size, self.image_size, 3)
        if image.shape != want or image.dtype != np.uint8:
            raise ValueError(f"image must be {want} uint8 RGB, got {image.shape} {image.dtype}")
        if state.shape != (self.state_dim,) or state.dtype.kind not in "biuf":
            raise ValueError(f"state must have shape ({self.state_dim},), numbers ({', '.join(self.state_names)}); "
                             f"got {state.shape} {state.dtype}")
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is reported below, by name
            st = state.astype(np.float32)
        bad = np.nonzero(~np.isfinite(st))[0]
        if len(bad):
            got = ", ".join(f"{self.state_names[j]} = {float(state[j])!r}" for j in bad)
            raise ValueError(f"state must be finite float32 values (|x| < {np.finfo(np.float32).max:.3g}); "
                             f"got NaN, inf or out of range: {got}")
        return image[None], st[None]

    def encode(self, image, state, instruction: str) -> np.ndarray:
        """-> prefix embeddings (1, P, E), all finite."""
        img, st = self.check_inputs(image, state)
        feeds = {C.ENC_IMAGE: img, C.ENC_STATE: st, C.ENC_INSTRUCTION: self.instruction_ids(instruction)}
        with self._lock:  # one run at a time, like the decoders
            prefix = self.encoder.run([C.ENC_PREFIX], feeds)[0]
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
            ids, info = self.decode_ids(prefix)
            t2 = time.perf_counter()
            actions = self.tok.decode_chunk(np.asarray(ids), self.horizon, self.dims)
            info.update(encode_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3,
                        act_ms=(time.perf_counter() - t0) * 1e3)
            self.last_info = info
            return actions

    def decode_ids(self, prefix: np.ndarray, use_draft: bool | None = None,
                   reference: bool = False) -> tuple[list[int], dict]:
        """Prefix (1, P, E) -> the H*D action ids (time-major) and decoding statistics. Every target call is
        one round of `speculative.fast_round` (γ = 0 without a draft: a plain step); reference=True runs the
        same rounds through the generic `speculative_round` (slow, obvious; tests compare the two).
        NaN/inf logits from the target raise FloatingPointError; the rows such a call wrote are zeroed by the
        decoder, and every call starts from empty caches, so a failed call changes no later one."""
        with self._lock:  # the caches are shared: one decode at a time
            return self._decode_ids(prefix, use_draft, reference)

    def _drafter(self, prefix: np.ndarray, use_draft: bool | None) -> Drafter | None:
        """This chunk's drafter, primed with the prefix (None: plain decoding)."""
        if use_draft is False:
            return None
        if self._head_draft is not None:
            self._head_draft.start(prefix)
            return self._head_draft
        if self.draft is not None:
            dd = self.draft.dec
            dd.cache.rewind_to(0)
            dd.run(None, embeds=prefix)
            dd.cache.commit(prefix.shape[1])
        return self.draft

    def _decode_ids(self, prefix: np.ndarray, use_draft: bool | None, reference: bool) -> tuple[list[int], dict]:
        n, p = self.horizon * self.dims, prefix.shape[1]
        target = self.target
        target.cache.rewind_to(0)
        counter = self.head if self._head_draft is not None else self.draft.dec if self.draft is not None else None
        calls0 = counter.calls if counter is not None else 0
        drafter = self._drafter(prefix, use_draft)
        # the head drafts from the prefix alone, so its first round is the prefill; a draft decoder needs the
        # prefill's first id, so that first call is a plain step
        fused = isinstance(drafter, HeadDraft)
        rule = greedy_rule if self.cfg.mode == "greedy" else \
            RelaxedRule(self.tok.first_id, self.tok.vocab_end, self._radius, p)
        round_ = reference_round if reference else fast_round
        info = {"rounds": 0, "drafted": 0, "accepted": 0, "target_calls": 0, "draft_calls": 0, "max_dev_bins": 0}
        fallbacks0 = getattr(target, "fallbacks", 0)  # a remote target's calls that ran on the local one
        ctx = [0] * p  # placeholder ids for the prefix rows, then the chunk's ids
        while len(ctx) < p + n:
            first = len(ctx) == p
            g = 0 if drafter is None or (first and not fused) else min(self.cfg.gamma, p + n - len(ctx) - 1)
            new, k, c = round_(target, drafter if g else None, ctx, g, rule, prefix if first else None)
            ctx += new
            info["target_calls"] += 1
            if g:
                info["rounds"] += 1
                info["drafted"] += c
                info["accepted"] += k
        if drafter is not None:
            info["draft_calls"] = counter.calls - calls0
        info["max_dev_bins"] = getattr(rule, "max_dev_bins", 0)
        info["tokens_per_round"] = n / info["target_calls"]  # emitted tokens per target call
        if self.remote is not None:
            info["fallbacks"] = target.fallbacks - fallbacks0
        return ctx[p:p + n], info

    def worst_case_deviation(self) -> np.ndarray:
        """(D,) the most a relaxed token can differ from the target's choice, per action dimension in that
        dimension's unit (self.action_names[j] in self.action_units[j]; the reacher: fingertip.x / .y in m)."""
        s = self.tok.stats
        r = self._radius[:self.dims].astype(np.float64)
        return r * (s.q99 - s.q01) / (self.tok.n_bins - 1) * np.where(s.mask, 1.0, 0.0)

    def reference_ids(self, prefix: np.ndarray) -> list[int]:
        """Plain greedy decoding through `Decoder.reference_call` (slow, obvious): for tests."""
        n = self.horizon * self.dims
        sess = self.target.engine
        ids: list[int] = []
        seq = prefix[0]
        emb = self.target.embedding
        for _ in range(n):  # no cache: the whole sequence every step
            x = np.concatenate([seq, emb[ids]], 0)[None] if ids else seq[None]
            s = x.shape[1]
            feeds = {self.target.m.inputs[0].name: x.astype(np.float32),
                     **step_inputs(self.target.m, np.zeros(1, np.int64), s, s)}  # either graph flavour
            for past, _ in C.cache_names(self.target.m.num_layers):
                feeds[past] = np.zeros((1, self.target.m.num_kv_heads, s, self.target.m.head_dim),
                                       self.target.m.cache_dtype)  # rows 0..s-1: written by the call
            logits = sess.run(feeds)[C.LOGITS][0, -1]
            ids.append(int(self._pick(logits[None])[0]))
        return ids


def load_policy(policy_dir: str | Path, draft: bool | str | Path = False, mode: str = "greedy", radius: int = 5,
                gamma: int | None = None, stop_below: float | None = None, provider: str = "cpu",
                threads: int | None = 1, remote: str | RemoteConfig | None = None) -> Policy:
    """Load an exported VLA policy folder. draft="head" decodes speculatively with the folder's numpy draft
    head (the fastest here), draft=True with its draft/ decoder engine, a path with that draft engine folder.
    gamma / stop_below default per draft kind (DRAFT_DEFAULTS).

    remote: a vLLM server serving the policy's target checkpoint (`edgespec serve-target
    models/vla-reacher/target`), as a URL or a RemoteConfig. The drafts stay on the device and the server
    verifies them; a verify that fails runs on the folder's own target (on_failure "local", exact), or
    raises RemoteUnavailable (on_failure "raise": in the control loop the robot holds, then stops).
    last_info["fallbacks"] counts the chunk's calls that ran locally."""
    return Policy(policy_dir, draft, PolicyConfig(mode, radius, gamma, stop_below), provider, threads,
                  remote=remote)

"""VLA policies: image + state + instruction -> an H x D chunk of continuous actions, decoded as action
tokens with optional speculative decoding.

    policy = edgespec.load_policy("engines/vla-reacher", draft="head")           # exact (greedy) by default
    actions = policy.act(image, state, "reach the red target")                  # (H, D) float64
    policy.last_info  # encode_ms, decode_ms, rounds, accepted, drafted, tokens_per_round, max_dev_bins, ...
    policy.state_names, policy.action_kind, policy.action_names, policy.action_units  # from policy.json

A Policy is safe to call from several threads (calls run one at a time). Inputs are checked as the encoder
sees them (float32 state: a value that overflows to inf is refused, by name), the encoder's prefix must be
finite, and NaN/inf logits raise FloatingPointError without leaving anything behind for the next call.

A policy folder (export/vla.py) holds encoder.onnx (image, state, instruction -> prefix embeddings), a
target decoder and optionally a draft decoder (inputs_embeds engines that read the prefix, then action
ids) and a draft head (draft_head.npz: a numpy MLP over the prefix and the ids so far, edgespec/draft_head.py),
policy.json and action_stats.json. Decoding is constrained to the action ids. policy.json is checked
at load (PolicyManifest: one PolicyFileError naming the file and the field) and, with check_hashes, so are
its content and action_stats.json against the content hash export wrote (check_policy_content).

Drafts: draft="head" (the fastest here: ~0.02 ms a proposal, and its first round is fused into the
target's prefill), draft=True (the draft decoder engine, ~0.12 ms a proposal) or a draft engine folder.
Both stop a round early after a proposal they are unsure of (stop_below); γ and stop_below default per
draft kind (DRAFT_DEFAULTS, from bench/bench_vla.py's sweeps).

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
from .drafts import DraftModel, max_prob
from .engine import open_engine, session_options
from .profiling import Timer
from .sampling import SamplingConfig, check_ids
from .speculative import accept_relaxed, speculative_round

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
                 provider: str = "cpu", threads: int | None = 1, check_hashes: bool = True):
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
        self.target = self._decoder(open_engine(self.dir / "target", provider, threads, check_hashes))
        self._check_argmax(self.target.m, self.dir / "target")
        self.draft, self.head = None, None
        if draft == "head":
            hpath = self.dir / HEAD_FILE
            if not hpath.is_file():
                raise FileNotFoundError(f"{hpath}: this policy folder has no draft head (train one with "
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
        elif draft is not False and draft is not None:
            ddir = self.dir / "draft" if draft is True else Path(draft)
            if not ddir.is_dir():
                raise FileNotFoundError(f"{ddir}: no draft engine folder" + (
                    f" ({self.dir} has no draft/; load without draft=True)" if draft is True else ""))
            self.draft = DraftModel(self._decoder(open_engine(ddir, provider, threads, check_hashes)),
                                    self.cfg.stop_below, self._confidence)
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
    def _pick(self, logits: np.ndarray, positions=None):  # logits (B, V) -> action ids (B,), constrained
        lo, hi = self.tok.first_id, self.tok.vocab_end
        return logits[:, lo:hi].argmax(-1) + lo, None

    def _confidence(self, logits: np.ndarray) -> np.ndarray:  # (B, V) -> (B,) p of the constrained argmax
        return max_prob(logits[:, self.tok.first_id:self.tok.vocab_end])

    def _accept(self, drafts: np.ndarray, t: np.ndarray, pos: int, info: dict) -> tuple[int, int]:
        """accept_relaxed for drafts (c,) at chunk index pos, t (c+1,) the target's action ids there (exact
        where the radius is 0); notes the largest bin distance it accepted in info["max_dev_bins"]."""
        lo, hi, radius = self.tok.first_id, self.tok.vocab_end, self._radius
        check_ids(t, "target", self.prefix_len + pos)
        k, nxt = accept_relaxed(drafts, t, lo, hi, radius[pos:pos + len(drafts)])
        if k and radius[pos:pos + k].any():
            info["max_dev_bins"] = max(info["max_dev_bins"], int(np.abs(drafts[:k] - t[:k]).max()))
        return k, nxt

    def _step_id(self, token: int) -> int:
        """One plain target step: the action id after `token` (committed)."""
        t = self.target.ids(np.array([[token]]))[0]  # (1,)
        check_ids(t, "target", int(self.target.cache.lengths[0]))
        self.target.cache.commit(1)
        return int(t[0])

    def act(self, image, state, instruction: str) -> np.ndarray:
        """-> (H, D) continuous actions in robot units (the reacher: fingertip position targets, m)."""
        with self._lock:  # threads wait here: a call is never interleaved with another
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
        """Prefix (1, P, E) -> the H*D action ids (time-major) and decoding statistics.
        Speculative decoding runs a lean single-sequence loop; reference=True runs the same decoding through
        the generic `speculative_round` + `DraftModel` (slow, obvious; tests compare the two).
        NaN/inf logits from the target raise FloatingPointError (check_ids); the rows such a call wrote are
        zeroed by the decoder, and every call starts from empty caches, so a failed call changes no later one."""
        with self._lock:  # the caches are shared: one decode at a time
            return self._decode_ids(prefix, use_draft, reference)

    def _decode_ids(self, prefix: np.ndarray, use_draft: bool | None, reference: bool) -> tuple[list[int], dict]:
        n, p = self.horizon * self.dims, prefix.shape[1]
        target = self.target
        target.cache.rewind_to(0)
        if self.head is not None and (use_draft is None or use_draft):
            return self._decode_head(prefix, n, p, reference)
        first = target.ids(None, embeds=prefix)[0, -1:]  # the prefill's last id
        check_ids(first, "target", p)
        target.cache.commit(p)
        ids = [int(first[0])]
        info = {"rounds": 0, "drafted": 0, "accepted": 0, "target_calls": 1, "draft_calls": 0, "max_dev_bins": 0}
        draft = self.draft if use_draft is None or use_draft else None
        if draft is None:
            while len(ids) < n:  # plain decoding
                ids.append(self._step_id(ids[-1]))
            info["target_calls"] = n
            info["tokens_per_round"] = 1.0
            return ids, info
        dd = draft.dec
        dd.cache.rewind_to(0)
        dd.run(None, embeds=prefix)
        dd.cache.commit(p)
        if not reference:
            return self._speculative_fast(ids, n, p, info)
        draft._ctx_len[:] = p
        ctx = [0] * p + ids  # placeholder ids stand for the prefix rows already in both caches
        timer = Timer()

        def relax(d, lg, at):  # d (k,), lg (k+1, V), at: absolute position of d[0]
            return self._accept(d, lg, at - p, info)

        calls0 = dd.calls
        while len(ids) < n:
            g = min(self.cfg.gamma, n - len(ids) - 1)
            if g == 0:
                ids.append(self._step_id(ids[-1]))
                info["target_calls"] += 1
                continue
            new, k, m = speculative_round(target, draft, [ctx], np.ones(1, bool), g, "relaxed", SamplingConfig(),
                                          None, None, self._pick, timer, relax=relax)
            ids += new[0]
            ctx += new[0]
            info["rounds"] += 1
            info["drafted"] += int(m[0])
            info["accepted"] += int(k[0])
            info["target_calls"] += 1
        info["draft_calls"] = dd.calls - calls0 + 1
        info["tokens_per_round"] = (n - 1) / max(info["rounds"], 1)
        return ids[:n], info

    def _speculative_fast(self, ids: list[int], n: int, p: int, info: dict) -> tuple[list[int], dict]:
        """The round for one sequence with no per-round objects: draft up to g ids from the draft's cache
        (fewer when the draft is unsure: stop_below), verify them + 1 in one target call, accept
        (accept_relaxed: exact when the radius is 0), roll the caches back. Both caches hold the prefix; the
        target's lacks ids[-1], the draft's lacks `pending` (1 or 2 ids)."""
        target, dd = self.target, self.draft.dec
        lo, hi, stop = self.tok.first_id, self.tok.vocab_end, self.cfg.stop_below
        pending = [ids[-1]]
        feed = np.empty((1, self.cfg.gamma + 1), np.int64)
        calls0 = dd.calls
        while len(ids) < n:
            g = min(self.cfg.gamma, n - len(ids) - 1)
            if g == 0:  # one id left: a plain target step
                ids.append(self._step_id(ids[-1]))
                info["target_calls"] += 1
                continue
            lg = dd(np.array([pending], np.int64))[0, -1, lo:hi]  # catch up, then draft
            dd.cache.commit(len(pending))
            c = g  # proposals this round
            for j in range(g):
                best = lg.argmax()
                feed[0, j + 1] = best + lo
                if stop and 1.0 / np.exp(lg - lg[best]).sum() < stop:
                    c = j + 1  # verified, not fed to the draft
                    break
                if j + 1 < g:
                    lg = dd(feed[:, j + 1:j + 2])[0, 0, lo:hi]
                    dd.cache.commit(1)
            feed[0, 0] = ids[-1]
            drafts = feed[0, 1:c + 1]
            t = target.ids(feed[:, :c + 1])[0]  # (c+1,)
            pos = len(ids)  # chunk index of drafts[0]
            k, nxt = self._accept(drafts, t, pos, info)
            target.cache.commit(1 + k)
            dd.cache.rewind_to(dd.cache.lengths - ((c - 1) - min(k, c - 1)))  # keep the fed drafts accepted
            pending = [int(drafts[c - 1]), nxt] if k == c else [nxt]
            ids += drafts[:k].tolist() + [nxt]
            info["rounds"] += 1
            info["drafted"] += c
            info["accepted"] += k
            info["target_calls"] += 1
        info["draft_calls"] = dd.calls - calls0 + 1
        info["tokens_per_round"] = (n - 1) / max(info["rounds"], 1)
        return ids[:n], info

    def _decode_head(self, prefix: np.ndarray, n: int, p: int, reference: bool) -> tuple[list[int], dict]:
        """Speculative decoding with the draft head. The first round is fused into the target's prefill:
        the head drafts from the prefix alone and the target reads prefix + drafts in one call (S = P + c),
        so a chunk costs one target call fewer than prefill-then-verify. Later rounds verify pending + drafts.
        reference=True runs the later rounds through the generic `speculative_round` + `HeadDraft`."""
        target, head = self.target, self.head
        stop = self.cfg.stop_below
        info = {"rounds": 0, "drafted": 0, "accepted": 0, "target_calls": 0, "draft_calls": 0, "max_dev_bins": 0}
        head.start(prefix)
        calls0 = head.calls
        drafter = HeadDraft(head, p, stop) if reference else None
        feed = np.empty((1, self.cfg.gamma + 1), np.int64)
        ids: list[int] = []
        timer = Timer()

        while len(ids) < n:
            g = min(self.cfg.gamma, n - len(ids) - 1)
            if g == 0 and ids:  # one id left: a plain target step
                ids.append(self._step_id(ids[-1]))
                info["target_calls"] += 1
                continue
            if not ids or not reference:  # draft up to g ids from the head
                c, work = g, list(ids)
                if reference and g:
                    prop = drafter.propose([[0] * p + ids], g, self._pick, np.ones(1, bool))
                    c = int(prop.counts[0])
                    feed[0, 1:c + 1] = prop.tokens[0, :c]
                else:
                    for j in range(g):
                        tok, pr = head.next(work)
                        work.append(tok)
                        feed[0, j + 1] = tok
                        if stop and pr < stop:
                            c = j + 1
                            break
                drafts = feed[0, 1:c + 1].copy()
                pos = len(ids)
                if not ids:  # fused first round: prefix + drafts in the prefill
                    x = np.concatenate([prefix, target.embedding[drafts][None]], 1) if c else prefix
                    t = target.ids(None, embeds=x.astype(np.float32))[0, p - 1:]  # (c+1,)
                    k, nxt = self._accept(drafts, t, pos, info)
                    target.cache.commit(p + k)
                else:
                    feed[0, 0] = ids[-1]
                    t = target.ids(feed[:, :c + 1])[0]  # (c+1,)
                    k, nxt = self._accept(drafts, t, pos, info)
                    target.cache.commit(1 + k)
                ids += drafts[:k].tolist() + [nxt]
            else:
                new, k, c = speculative_round(target, drafter, [[0] * p + ids], np.ones(1, bool), g, "relaxed",
                                              SamplingConfig(), None, None, self._pick, timer,
                                              relax=lambda d, lg, at: self._accept(d, lg, at - p, info))
                ids += new[0]
                k, c = int(k[0]), int(c[0])
            info["rounds"] += 1
            info["drafted"] += c
            info["accepted"] += k
            info["target_calls"] += 1
        info["draft_calls"] = head.calls - calls0
        info["tokens_per_round"] = n / max(info["rounds"], 1)
        return ids[:n], info

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
                     C.POSITION_IDS: np.arange(s, dtype=np.int64)[None],
                     C.ATTENTION_BIAS: np.where(np.tril(np.ones((s, s), bool)), 0.0, C.MASKED)
                     .astype(np.float32)[None, None]}
            for past, _ in C.cache_names(self.target.m.num_layers):
                feeds[past] = np.zeros((1, self.target.m.num_kv_heads, s, self.target.m.head_dim),
                                       self.target.m.cache_dtype)  # rows 0..s-1: written by the call
            logits = sess.run(feeds)[C.LOGITS][0, -1]
            ids.append(int(self._pick(logits[None])[0][0]))
        return ids


def load_policy(policy_dir: str | Path, draft: bool | str | Path = False, mode: str = "greedy", radius: int = 5,
                gamma: int | None = None, stop_below: float | None = None, provider: str = "cpu",
                threads: int | None = 1) -> Policy:
    """Load an exported VLA policy folder. draft="head" decodes speculatively with the folder's numpy draft
    head (the fastest here), draft=True with its draft/ decoder engine, a path with that draft engine folder.
    gamma / stop_below default per draft kind (DRAFT_DEFAULTS)."""
    return Policy(policy_dir, draft, PolicyConfig(mode, radius, gamma, stop_below), provider, threads)

"""The policy folder's contract: its encoder graph and `policy.json` (edgespec/policy.py reads it, export/vla.py
writes it).

VLA encoder graph (`encoder.onnx` of a policy folder; its decoders are inputs_embeds engines):

    image            uint8   [1, S, S, 3]      RGB
    state            float32 [1, N]            the policy's state, in policy.json's state_names order
    instruction      int64   [1, L]            word ids, right-padded with 0
      ──▶
    prefix_embeds    float32 [1, P, E]         fed to the decoders as inputs_embeds at positions 0..P-1

A policy folder's `policy.json` is checked by `PolicyManifest` (chunk shape, action ids, instruction words,
what the state and actions mean) and, through its `content_sha256`, against edits after export.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from .contract import EngineError, _is_int
from .files import file_sha256, read_json_object

ENC_IMAGE, ENC_STATE, ENC_INSTRUCTION, ENC_PREFIX = "image", "state", "instruction", "prefix_embeds"
POLICY_FILE = "policy.json"

HEAD_FILE = "draft_head.npz"  # the per-dimension numpy head (draft_head.py): bins policies
FEATURE_HEAD_FILE = "feature_head.npz"  # the feature-level head (text_head.py) over the target's hidden state
STATS_FILE = "action_stats.json"
POLICY_FORMAT = "edgespec-vla"  # policy.json "format" starts with this ("edgespec-vla/1")
ACTION_KINDS = ("cartesian_position", "joint_position", "cartesian_delta")  # what an action row commands
# (cartesian_delta: OpenVLA's end-effector displacement per step + gripper; no bundled embodiment executes it)
CONTENT_HASH = "content_sha256"  # policy.json's own hash field (export writes it)
SEMANTICS = ("embodiment", "state_names", "state_units", "action_kind", "action_names", "action_units")
REEXPORT = "re-export it with `edgespec export-policy MODEL --out DIR --force`"
ENCODER_FILE = "encoder.onnx"


PROMPT_KEYS = ("template", "tokenizer_file", "tokenizer_sha256", "append_id", "image_token_id")
FAST_KEYS = ("file", "sha256", "max_tokens")  # the FastTokenizer file, its hash, the most tokens of a chunk + END
ENC_IMAGE_EMBEDS = "image_embeds"  # a prompt policy's encoder output (1, N, E)


def prompt_ok(p) -> bool:
    """policy.json's "prompt": template (str, "{instruction}" once), tokenizer_file (a name in the folder),
    tokenizer_sha256, append_id (the id appended unless the prompt ends with it, or null), image_token_id (the
    prompt's one id the image rows replace (Llava), or null: they go right after BOS (OpenVLA))."""
    if not isinstance(p, dict) or sorted(p) != sorted(PROMPT_KEYS):
        return False
    t, f = p["template"], p["tokenizer_file"]
    ids_ok = all(p[k] is None or (_is_int(p[k]) and p[k] >= 0) for k in ("append_id", "image_token_id"))
    return (isinstance(t, str) and t.count("{instruction}") == 1 and _file_name(f)
            and _sha256_or_none(p["tokenizer_sha256"]) and ids_ok)


def _file_name(v) -> bool:
    return isinstance(v, str) and bool(v) and not Path(v).is_absolute() and ".." not in Path(v).parts


class PolicyFileError(EngineError):
    """A policy folder whose policy.json is malformed, whose policy.json or action_stats.json was edited after
    export, or that was exported by an older edgespec."""


def _strings(v, n: int, distinct: bool = False) -> bool:
    """v is a list of n strings (non-empty and all different when distinct)."""
    ok = isinstance(v, list) and len(v) == n and all(isinstance(x, str) for x in v)
    return ok and (not distinct or (all(v) and len(set(v)) == n))


def _sha256_or_none(v) -> bool:
    return v is None or (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v))


@dataclass
class PolicyManifest:
    """What policy.json declares: the chunk shape, the action tokens, the instruction vocabulary, and what the
    state and the actions mean (robots/ map state_names and action_names to a robot's joints and messages).
    Fields besides these (task, config, encoder_gate, precision) are kept in Policy.meta, unchecked."""
    format: str  # "edgespec-vla/<version>"
    horizon: int  # H action steps per chunk
    dims: int  # D action dimensions per step
    n_bins: int
    vocab_end: int  # action ids: vocab_end - n_bins .. vocab_end - 1
    image_size: int
    state_dim: int  # 0: the policy reads no state (OpenVLA)
    prefix_len: int  # words: the whole prefix; prompt: the rows before the prompt's text (BOS + image rows)
    embodiment: str  # the robot the policy was trained for, e.g. "three-target-reacher"
    state_names: list  # (state_dim,) what each state entry is, e.g. "joint0.position"
    state_units: list  # (state_dim,) e.g. "rad"
    action_kind: str  # one of ACTION_KINDS
    action_names: list  # (dims,) what each action dimension commands, e.g. "fingertip.x"
    action_units: list  # (dims,) e.g. "m"
    binary_dims: list = field(default_factory=list)  # action dimensions that are open/close (never relaxed)
    # the instruction, one of two ways: a word vocabulary (the bundled policy's encoder reads word ids) ...
    instr_len: int = 0
    words: list | None = None  # words[0] = "<pad>"
    # ... or a text prompt (OpenVLA, Llava): PROMPT_KEYS; the encoder reads the image alone and the runtime builds
    # the prefix with the target's embedding table: [embed(BOS), image rows, embed(the rest)] (OpenVLA), or the
    # prompt's embeddings with its image token replaced by the image rows (Llava)
    prompt: dict | None = None
    # the action tokens: OpenVLA's bins (None), or FAST (fast_tokens.py): FAST_KEYS; every decoder id is then a FAST
    # token (vocab_end = n_bins = the FAST vocabulary) and a chunk ends with its END token
    fast: dict | None = None
    encoder_file: str = "encoder.onnx"
    encoder_sha256: str | None = None
    draft_head_sha256: str | None = None
    feature_head_sha256: str | None = None  # FEATURE_HEAD_FILE's hash: a FAST or prompt policy's feature head
    action_stats_sha256: str | None = None  # action_stats.json's file hash (covered by content_sha256)
    content_sha256: str | None = None  # policy_content_sha256 of this file

    def __post_init__(self):
        problems = self._size_problems() or self._problems()
        if problems:
            raise PolicyFileError("; ".join(problems))

    def _want(self, problems: list, name: str, ok: bool, expected: str) -> None:
        if not ok:
            problems.append(f"{name}: expected {expected}, got {getattr(self, name)!r}")

    def _size_problems(self) -> list[str]:
        problems: list[str] = []
        want = self._want
        want(problems, "format", isinstance(self.format, str) and self.format.startswith(POLICY_FORMAT),
             f"a string starting with {POLICY_FORMAT!r}")
        for name in ("horizon", "dims", "n_bins", "vocab_end", "image_size", "prefix_len"):
            want(problems, name, _is_int(getattr(self, name)) and getattr(self, name) > 0, "an integer > 0")
        for name in ("state_dim", "instr_len"):
            want(problems, name, _is_int(getattr(self, name)) and getattr(self, name) >= 0, "an integer >= 0")
        return problems

    def _problems(self) -> list[str]:
        """The fields that are checked against the sizes (which are numbers by now)."""
        problems: list[str] = []
        want = self._want
        want(problems, "vocab_end", self.vocab_end >= self.n_bins, f"an integer >= n_bins {self.n_bins}")
        if self.prompt is None:
            want(problems, "words", isinstance(self.words, list) and len(self.words) >= 2 and self.words[0] == "<pad>"
                 and _strings(self.words, len(self.words), distinct=True),
                 'distinct strings, the first "<pad>" (or a prompt)')
            want(problems, "instr_len", self.instr_len > 0, "an integer > 0 with words")
        else:
            want(problems, "words", self.words is None, "null with a prompt")
            want(problems, "prompt", prompt_ok(self.prompt), f"an object with {PROMPT_KEYS}, the template holding "
                 "{instruction} once, the tokenizer a file name in the folder")
        want(problems, "embodiment", isinstance(self.embodiment, str) and bool(self.embodiment), "a non-empty string")
        want(problems, "state_names", _strings(self.state_names, self.state_dim, distinct=True),
             f"{self.state_dim} (state_dim) distinct non-empty strings")
        want(problems, "state_units", _strings(self.state_units, self.state_dim),
             f"{self.state_dim} (state_dim) strings")
        want(problems, "action_kind", self.action_kind in ACTION_KINDS, f"one of {ACTION_KINDS}")
        want(problems, "action_names", _strings(self.action_names, self.dims, distinct=True),
             f"{self.dims} (dims) distinct non-empty strings")
        want(problems, "action_units", _strings(self.action_units, self.dims), f"{self.dims} (dims) strings")
        f = self.fast
        want(problems, "fast", f is None or (isinstance(f, dict) and sorted(f) == sorted(FAST_KEYS)
                                            and _file_name(f["file"]) and _sha256_or_none(f["sha256"])
                                            and _is_int(f["max_tokens"]) and f["max_tokens"] > 0
                                            and self.vocab_end == self.n_bins),
             f"null, or an object with {FAST_KEYS} (max_tokens > 0) and vocab_end == n_bins")
        b = self.binary_dims
        want(problems, "binary_dims", isinstance(b, list) and all(_is_int(j) and 0 <= j < self.dims for j in b)
             and len(set(b)) == len(b), f"distinct action dimensions in [0, {self.dims})")
        want(problems, "encoder_file", _file_name(self.encoder_file), "a file name inside the policy folder")
        for name in ("encoder_sha256", "draft_head_sha256", "feature_head_sha256", "action_stats_sha256",
                     "content_sha256"):
            want(problems, name, _sha256_or_none(getattr(self, name)), "null or 64 lowercase hex digits")
        want(problems, "feature_head_sha256", self.feature_head_sha256 is None or f is not None
             or self.prompt is not None, "null unless the policy emits FAST tokens or reads a prompt (a bins policy "
             "with a word vocabulary drafts with draft_head.npz)")
        return problems

    @classmethod
    def from_dict(cls, meta: dict, path: Path) -> "PolicyManifest":
        """Checked fields of policy.json (meta, read from path): one PolicyFileError naming the file and
        every missing or malformed field."""
        fields_ = cls.__dataclass_fields__
        required = [n for n, f in fields_.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in meta]
        if missing:
            old = "" if set(missing).isdisjoint(SEMANTICS) else \
                f" (an export older than policy.json's state/action semantics: {REEXPORT})"
            raise PolicyFileError(f"{path}: missing fields {missing}{old}")
        try:
            return cls(**{n: meta[n] for n in fields_ if n in meta})
        except PolicyFileError as e:
            raise PolicyFileError(f"{path}: {e}") from None


def policy_content_sha256(meta: dict) -> str:
    """sha256 of policy.json's content without its own content_sha256 field, as canonical JSON (sorted keys,
    so indentation and key order do not matter). action_stats.json is covered through the file hash the
    content holds (action_stats_sha256)."""
    body = {k: v for k, v in meta.items() if k != CONTENT_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_policy_json(path: Path) -> dict:
    """policy.json as a dict, or one PolicyFileError saying why it is not one."""
    return read_json_object(path, "policy", PolicyFileError)


def require_content_hash(path: Path, meta: dict) -> None:
    if meta.get(CONTENT_HASH) is None or meta.get("action_stats_sha256") is None:
        raise PolicyFileError(f"{path} has no {CONTENT_HASH} (exported by an older edgespec); {REEXPORT}")


def check_policy_content(policy_dir: Path, meta: dict) -> None:
    """policy.json and action_stats.json are what export wrote: a swapped instruction word or an edited
    action range would silently change what the robot does."""
    path = policy_dir / POLICY_FILE
    require_content_hash(path, meta)
    if policy_content_sha256(meta) != meta[CONTENT_HASH]:
        raise PolicyFileError(f"{path} was edited after export (its content does not match its {CONTENT_HASH}); "
                              f"{REEXPORT}")
    stats = policy_dir / STATS_FILE
    if not stats.is_file():
        raise FileNotFoundError(f"{stats} is missing; {REEXPORT}")
    if file_sha256(stats) != meta["action_stats_sha256"]:
        raise PolicyFileError(f"{stats} was edited after export (it does not match action_stats_sha256 in "
                              f"{path}); {REEXPORT}")



"""Reading a policy folder (export/vla.py writes it) and checking what a policy is asked: policy.json and its
content hash (policy_contract.py), action_stats.json, the draft head, instructions, images and states.
`Policy` (policy.py) loads through these."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import contract as C
from . import policy_contract as PC
from .actions import ActionStats, ActionTokenizer
from .draft_head import DraftHead


def read_folder(policy_dir: Path, check_hashes: bool) -> tuple[dict, PC.PolicyManifest, ActionTokenizer]:
    """-> (policy.json, its PolicyManifest, the action tokenizer over action_stats.json), each checked: one
    error naming the file and the field; with check_hashes, the content hash export wrote too."""
    path = policy_dir / PC.POLICY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{policy_dir} is not a policy folder: no {PC.POLICY_FILE} "
                                f"(export one with `edgespec export-policy`)")
    meta = PC.read_policy_json(path)
    if check_hashes:
        PC.require_content_hash(path, meta)  # an older export: say "re-export" before naming missing fields
    m = PC.PolicyManifest.from_dict(meta, path)
    if check_hashes:
        PC.check_policy_content(policy_dir, meta)
    stats = ActionStats.load(policy_dir / PC.STATS_FILE)
    if stats.dims != m.dims:
        raise ValueError(f"{policy_dir}/{PC.STATS_FILE} has {stats.dims} dimensions but the policy emits "
                         f"{m.dims} per step")
    return meta, m, ActionTokenizer(m.vocab_end, m.n_bins, stats)


def checked_file(path: Path, sha256: str | None, check_hashes: bool, manifest_path: Path) -> Path:
    """path, after checking it against the sha256 policy.json records for it (when it records one)."""
    if check_hashes and sha256 and C.file_sha256(path) != sha256:
        raise C.EngineError(f"{path} does not match the sha256 in {manifest_path}")
    return path


def load_head(policy_dir: Path, m: PC.PolicyManifest, tok: ActionTokenizer, check_hashes: bool,
              ctx_size: int | None = None) -> DraftHead:
    """The folder's numpy draft head, checked against the policy's action ids and chunk shape; a prompt policy's
    head reads the target's hidden state, of ctx_size values."""
    hpath = policy_dir / PC.HEAD_FILE
    if not hpath.is_file() and m.prompt is not None:
        raise FileNotFoundError(f"{hpath}: this policy folder has no draft head (re-export it with `edgespec "
                                f"export-policy ... --draft-head FILE`, a head reading the target's hidden state as "
                                f"export/training/train_openvla.py writes)")
    if not hpath.is_file():
        raise FileNotFoundError(f"{hpath}: this policy folder has no draft head (collect its data with "
                                f"`python -m edgespec.robots.demos on-policy`, then train it with "
                                f"`python -m edgespec.export.training.train_draft_head`)")
    head = DraftHead.load(checked_file(hpath, m.draft_head_sha256, check_hashes, policy_dir / PC.POLICY_FILE))
    if head.n_ids != tok.n_bins or (tok.first_id != 0 and m.prompt is None):
        raise ValueError(f"the draft head proposes {head.n_ids} bins (ids 0..{head.n_ids - 1}); this policy's action "
                         f"ids are {tok.first_id}..{tok.vocab_end - 1}")
    if m.prompt is not None and head.w.ctx_w.shape[0] != ctx_size:
        raise ValueError(f"the draft head reads a context of {head.w.ctx_w.shape[0]} values; this prompt policy's "
                         f"head reads the target's hidden state ({ctx_size})")
    if (head.dims, head.w.horizon) != (m.dims, m.horizon):
        raise ValueError(f"draft head is for {head.w.horizon}x{head.dims} chunks, the policy emits "
                         f"{m.horizon}x{m.dims}")
    return head


def load_feature_head(policy_dir: Path, m: PC.PolicyManifest, tok: ActionTokenizer, check_hashes: bool,
                      vocab_size: int, hidden_size: int):
    """The policy's feature-level draft head (text_head.py), checked against the target's embedding table
    (vocab_size, hidden_size) and the policy's action ids."""
    from .text_head import TextHead
    hpath = policy_dir / PC.FEATURE_HEAD_FILE
    if m.feature_head_sha256 is None or not hpath.is_file():
        what = "FAST policy folder" if m.fast is not None else "policy folder"
        raise FileNotFoundError(f"{hpath}: this {what} has no feature head (train one with `python -m "
                                f"edgespec.export.training.train_feature_head --model MODEL`, then re-export the "
                                f"policy; or draft with its decoder, draft=True)")
    head = TextHead.load(checked_file(hpath, m.feature_head_sha256, check_hashes, policy_dir / PC.POLICY_FILE))
    head.w.check_fits(str(hpath), (vocab_size, hidden_size), (tok.first_id, tok.vocab_end), "this policy's target")
    return head


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


def load_prompt_tokenizer(policy_dir: Path, m: PC.PolicyManifest, check_hashes: bool):
    """The prompt policy's tokenizer (tokenizers' tokenizer.json), checked against its sha256 in policy.json."""
    from tokenizers import Tokenizer
    path = checked_file(policy_dir / m.prompt["tokenizer_file"], m.prompt["tokenizer_sha256"], check_hashes,
                        policy_dir / PC.POLICY_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {PC.REEXPORT}")
    return Tokenizer.from_file(str(path))


def load_fast(policy_dir: Path, m: PC.PolicyManifest, check_hashes: bool):
    """The FAST policy's FastTokenizer, checked against its sha256 and against the policy's chunk and ids."""
    from .fast_tokens import FastTokenizer
    path = policy_dir / m.fast["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {PC.REEXPORT}")
    fast = FastTokenizer.load(checked_file(path, m.fast["sha256"], check_hashes, policy_dir / PC.POLICY_FILE))
    if (fast.horizon, fast.dims, fast.vocab_size) != (m.horizon, m.dims, m.vocab_end):
        raise ValueError(f"{path} encodes {fast.horizon}x{fast.dims} chunks in {fast.vocab_size} ids; the policy emits "
                         f"{m.horizon}x{m.dims} chunks with ids 0..{m.vocab_end - 1}")
    return fast


def prompt_ids(tokenizer, template: str, instruction: str, append_id: int | None) -> np.ndarray:
    """The prompt's ids (L,) as OpenVLA's predict_action builds them: the tokenizer's own special tokens (BOS
    first), then append_id (the empty piece "▁") unless the prompt already ends with it."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
    ids = tokenizer.encode(template.format(instruction=instruction), add_special_tokens=True).ids
    if append_id is not None and (not ids or ids[-1] != append_id):
        ids = ids + [append_id]
    return np.asarray(ids, np.int64)


def check_inputs(image, state, m: PC.PolicyManifest) -> tuple[np.ndarray, np.ndarray]:
    """-> image (1, S, S, 3) uint8, state (1, N) float32: checked as the encoder will see them (a state finite
    in float64 can still overflow to inf in float32). A policy without state (state_dim 0) takes None or an
    empty state."""
    image = np.asarray(image)
    want = (m.image_size, m.image_size, 3)
    if image.shape != want or image.dtype != np.uint8:
        raise ValueError(f"image must be {want} uint8 RGB, got {image.shape} {image.dtype}")
    if m.state_dim == 0 and (state is None or np.asarray(state).size == 0):
        return image[None], np.zeros((1, 0), np.float32)
    state = np.asarray(state)
    if state.shape != (m.state_dim,) or state.dtype.kind not in "biuf":
        raise ValueError(f"state must have shape ({m.state_dim},), numbers ({', '.join(m.state_names)}); "
                         f"got {state.shape} {state.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is reported below, by name
        st = state.astype(np.float32)
    bad = np.nonzero(~np.isfinite(st))[0]
    if len(bad):
        got = ", ".join(f"{m.state_names[j]} = {float(state[j])!r}" for j in bad)
        raise ValueError(f"state must be finite float32 values (|x| < {np.finfo(np.float32).max:.3g}); "
                         f"got NaN, inf or out of range: {got}")
    return image[None], st[None]

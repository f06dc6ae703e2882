"""A vision-language checkpoint -> a prompt policy folder, whatever its layout: the pipeline `export-policy` runs for
OpenVLA checkpoints (export/openvla.py) and Llava-style transformers checkpoints (export/llava.py). Each layout
gives a `VLMSource`: its sizes, tokenizer, prompt, where the image rows go, and torch references of the image rows,
the prefix and the greedy action ids.

Writes, into a staging folder renamed into place only when every gate passed:
  encoder.onnx        image (1, S, S, 3) uint8 -> image_embeds (1, N, E): the preprocessing, vision tower, projector
  target/             the language model as an inputs_embeds decoder engine (export_engine and its gates),
                      next_ids constrained to the action ids vocab_end - n_bins .. vocab_end - 1
  draft/              --draft: a smaller causal LM of the same width and vocabulary reading the same prefix
  tokenizer.json      the checkpoint's tokenizer; policy.json's "prompt" says how the prefix is built
  action_stats.json   the chosen dataset's action statistics: q01, q99, mask
  policy.json         horizon, dims, no state, the prompt, what the actions mean, the source checkpoint
Gates: the encoder's rows vs the torch reference (max |diff| <= ENCODER_TOL x max(1, max |row|)), the decoder gates
of export_engine, and end to end: the staged policy's prefix equals the reference's and its greedy action ids equal
the reference's on GATE_CASES random images and instructions (fp32; a lossy dtype's agreement is recorded), and with
a draft, speculative ids equal plain.
"""
from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .prismatic import VLMFormatError  # noqa: F401 (this module's error, defined where the readers need it)

import numpy as np

from edgespec import contract as C
from edgespec import policy_contract as PC
from edgespec.actions import ActionStats
from edgespec.policy_contract import CONTENT_HASH, ENCODER_FILE, STATS_FILE, policy_content_sha256
from edgespec.policy_folder import prompt_ids

from .onnx_export import export_engine
from .staging import check_out_dir, prepare, publish

ENCODER_TOL = 1e-4
GATE_CASES = 4
TOKENIZER_FILE = "tokenizer.json"
# OpenVLA's action space (its README and the Open X-Embodiment "EEF delta" convention)
OPENVLA_ACTIONS = {"action_kind": "cartesian_delta",
                   "action_names": ["ee.dx", "ee.dy", "ee.dz", "ee.droll", "ee.dpitch", "ee.dyaw", "gripper"],
                   "action_units": ["m", "m", "m", "rad", "rad", "rad", "1"]}
INSTRUCTIONS = ["pick up the red cup", "put the spoon in the bowl", "open the drawer", "move the block to the left",
                "close the top drawer", "push the can onto the towel"]


@dataclass
class VLMSource:
    """What the export needs from a checkpoint. The torch callables take image (1, S, S, 3) uint8 and ids (1, L)
    int64 tensors; the image rows go right after BOS (image_token_id None: OpenVLA) or replace the prompt's one
    image token (Llava)."""
    path: Path
    kind: str  # "openvla" | "llava": policy.json's source.format
    image_size: int
    n_image_rows: int
    width: int  # the language model's hidden size
    vocab_size: int  # the language model's vocabulary (a draft must share it)
    vocab_end: int
    n_bins: int
    norm_stats: dict  # {dataset: {"action": {"q01", "q99", "mask"?}}}
    tokenizer_path: Path
    template: str
    image_token_id: int | None
    append_id: int | None
    image_encoder: object  # torch module: forward(image) -> (1, N, E), what encoder.onnx computes
    language_model: object  # the HF causal LM (torch module)
    reference_prefix: Callable  # (image, ids) -> (1, P, E)
    reference_action_ids: Callable  # (image, ids, n, lo, hi) -> [n ids], whole sequence per step
    info: dict = field(default_factory=dict)  # recorded in policy.json's "source"

    def action_stats(self, unnorm_key: str | None) -> tuple[str, ActionStats]:
        """-> (the dataset key, its statistics); OpenVLA's _check_unnorm_key, refusing by name."""
        keys = list(self.norm_stats)
        if unnorm_key is None:
            if len(keys) != 1:
                raise VLMFormatError(f"{self.path} has action statistics for {len(keys)} datasets {keys}; choose one "
                                     f"with --unnorm-key")
            unnorm_key = keys[0]
        if unnorm_key not in self.norm_stats:
            raise VLMFormatError(f"--unnorm-key {unnorm_key!r} is not in {self.path}'s action statistics; it has "
                                 f"{keys}")
        entry = self.norm_stats[unnorm_key]
        a = entry.get("action") if isinstance(entry, dict) else None
        if not isinstance(a, dict) or "q01" not in a or "q99" not in a:
            raise VLMFormatError(f"statistics {unnorm_key!r} need an 'action' entry with q01 and q99, got "
                                 f"{sorted(a) if isinstance(a, dict) else type(a).__name__}")
        return unnorm_key, ActionStats(a["q01"], a["q99"], a.get("mask", []))

    def prompt(self, tok, instruction: str) -> np.ndarray:
        return prompt_ids(tok, self.template, instruction, self.append_id)


def check_bos(tok, path: Path) -> None:
    enc = tok.encode("x", add_special_tokens=True)
    if not enc.special_tokens_mask or enc.special_tokens_mask[0] != 1:
        raise VLMFormatError(f"{path} adds no BOS token at the start; the image rows go right after BOS, so the "
                             f"tokenizer must add one")


def semantics(dims: int, names, units, kind) -> dict:
    """policy.json's state/action semantics: OpenVLA's 7-dim action space unless given."""
    if names is None and dims == 7:
        names, units, kind = OPENVLA_ACTIONS["action_names"], OPENVLA_ACTIONS["action_units"], \
            kind or OPENVLA_ACTIONS["action_kind"]
    if names is None or units is None:
        raise ValueError(f"the chosen statistics have {dims} action dimensions, not OpenVLA's 7; name them with "
                         f"--action-names and --action-units ({dims} each)")
    if len(names) != dims or len(units) != dims:
        raise ValueError(f"--action-names and --action-units need {dims} entries each, got {len(names)} and "
                         f"{len(units)}")
    return {"embodiment": "vla", "state_names": [], "state_units": [],
            "action_kind": kind or "cartesian_delta", "action_names": list(names), "action_units": list(units)}


def _image(rng, s: int) -> np.ndarray:
    return rng.integers(0, 256, (1, s, s, 3), dtype=np.uint8)


def export_encoder(src: VLMSource, path: Path) -> dict:
    """Trace image -> image_embeds to ONNX and gate it against the torch reference."""
    import onnxruntime as ort
    import torch

    rng = np.random.default_rng(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(src.image_encoder, (torch.from_numpy(_image(rng, src.image_size)),), str(path),
                          dynamo=False, opset_version=17, input_names=[PC.ENC_IMAGE],
                          output_names=[PC.ENC_IMAGE_EMBEDS], do_constant_folding=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, scale = 0.0, 1.0
    with torch.no_grad():
        for _ in range(3):
            img = _image(rng, src.image_size)
            want = src.image_encoder(torch.from_numpy(img)).numpy()
            got = sess.run(None, {PC.ENC_IMAGE: img})[0]
            if got.shape != want.shape:
                raise ValueError(f"encoder gate failed: ORT gives {got.shape}, torch {want.shape}")
            worst, scale = max(worst, float(np.abs(want - got).max())), max(scale, float(np.abs(want).max()))
    tol = ENCODER_TOL * scale
    report = {"gate": "encoder parity vs torch", "cases": 3, "max_abs_diff": worst, "tol": tol, "passed": worst <= tol}
    if not report["passed"]:
        raise ValueError(f"encoder gate failed: ORT vs torch max |diff| {worst:.3g} > {tol:.3g}")
    return report


def calibration(src: VLMSource, tok, n_tokens: int, n_obs: int = 16):
    """Rows for the target's precision gate as the policy uses it: prefix + the reference's greedy actions, scored
    from the prompt's last position. -> ([(x (P + n - 1, E), P - 1)], source)."""
    import torch
    rng = np.random.default_rng(7)
    lo, hi = src.vocab_end - src.n_bins, src.vocab_end
    table = src.language_model.get_input_embeddings().weight
    rows = []
    with torch.no_grad():
        for i in range(n_obs):
            img = torch.from_numpy(_image(rng, src.image_size))
            ids = torch.from_numpy(src.prompt(tok, INSTRUCTIONS[i % len(INSTRUCTIONS)]))[None]
            acts = src.reference_action_ids(img, ids, n_tokens - 1, lo, hi) if n_tokens > 1 else []
            x = torch.cat([src.reference_prefix(img, ids)] + [table[a][None, None] for a in acts], 1)
            rows.append((x[0].numpy().astype(np.float32), x.shape[1] - len(acts) - 1))
    return rows, f"{n_obs} random images and instructions: prompt prefix + the fp32 reference's greedy actions"


def check_draft_head(path: Path, src: VLMSource, horizon: int, dims: int) -> None:
    """A draft head for a prompt policy: bins over the action ids, its context the target's hidden state."""
    from edgespec.draft_head import DraftHeadWeights
    w = DraftHeadWeights.load(path)  # refuses weights that do not fit together
    got = (w.ctx_w.shape[0], w.n_ids, w.horizon, w.dims)
    if got != (src.width, src.n_bins, horizon, dims):
        raise ValueError(f"--draft-head {path} reads {got[0]} values and proposes {got[1]} bins for {got[2]}x{got[3]} "
                         f"chunks; this policy needs the target's hidden state ({src.width}), {src.n_bins} bins, "
                         f"{horizon}x{dims}")


def check_feature_head(path: Path, src: VLMSource) -> None:
    """A feature head (train_feature_head.py) for a prompt policy: the target's embedding table, the action ids."""
    from edgespec.text_head import TextHeadWeights
    TextHeadWeights.load(path).check_fits(  # load refuses weights that do not fit together
        f"--feature-head {path}", (src.vocab_size, src.width), (src.vocab_end - src.n_bins, src.vocab_end),
        "this checkpoint")


def check_draft(src: VLMSource, draft: Path) -> None:
    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"--draft {draft}: no config.json; expected a causal LM checkpoint folder")
    d = json.loads(cfg_path.read_text())
    if (d.get("hidden_size"), d.get("vocab_size")) != (src.width, src.vocab_size):
        raise ValueError(f"--draft {draft} has width {d.get('hidden_size')} and vocabulary {d.get('vocab_size')}; it "
                         f"reads the target's prefix, so it needs width {src.width} and vocabulary {src.vocab_size}")


def export_vlm_policy(src: VLMSource, out_dir: str | Path, unnorm_key: str | None = None, dtype: str = "fp32",
                      draft: str | Path | None = None, action_names=None, action_units=None,
                      action_kind: str | None = None, horizon: int = 1, force: bool = False, progress: bool = True,
                      allow_lossy: bool = False, max_context: int | None = None,
                      draft_head: str | Path | None = None, feature_head: str | Path | None = None) -> dict:
    """src -> a prompt policy folder at out_dir (module docstring). horizon: the action steps the statistics'
    dimensions hold, time-major (OpenVLA: 1 step of len(q01); a chunked fine-tune H steps of len(q01) / H, whose
    statistics must repeat every step). draft_head: a draft_head.npz whose context is the target's final hidden
    state (train_openvla.py writes one); feature_head: a feature_head.npz (train_feature_head.py); with either, the
    target is exported with its hidden-state output."""
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    key, stats = src.action_stats(unnorm_key)
    if horizon < 1 or stats.dims % horizon:
        raise ValueError(f"--horizon {horizon} must divide the statistics' {stats.dims} dimensions")
    dims = stats.dims // horizon
    step = ActionStats(stats.q01[:dims], stats.q99[:dims], stats.mask[:dims])
    if horizon > 1 and not all(np.array_equal(np.tile(getattr(step, k), horizon), getattr(stats, k))
                               for k in ("q01", "q99", "mask")):
        raise ValueError(f"--horizon {horizon}: the statistics of {stats.dims} dimensions do not repeat every "
                         f"{dims}; a chunk's steps must share one normalisation")
    sem = semantics(dims, action_names, action_units, action_kind)
    tok = Tokenizer.from_file(str(src.tokenizer_path))
    if draft is not None:
        check_draft(src, Path(draft))
    if draft_head is not None:
        check_draft_head(Path(draft_head), src, horizon, dims)
    if feature_head is not None:
        check_feature_head(Path(feature_head), src)
    check_out_dir(out_dir, [src.path], force)
    stage = prepare(out_dir, [src.path], force)
    lo, hi = src.vocab_end - src.n_bins, src.vocab_end
    lm = None
    try:
        gate = export_encoder(src, stage / ENCODER_FILE)
        lm_dir = stage / "_language_model"  # the language model as a plain HF folder, for export_engine
        src.language_model.save_pretrained(lm_dir, safe_serialization=True)
        calib = calibration(src, tok, horizon * dims) if dtype != "fp32" else None
        lm = LanguageModelWeights(src.language_model, lm_dir)
        lm.release()  # export_engine reads lm_dir itself: one copy of the weights in memory, not two
        export_engine(lm_dir, stage / "target", dtype=dtype, input_mode="embeds", progress=progress,
                      argmax_ids=(lo, hi), calibration=calib, role="target", allow_lossy=allow_lossy,
                      max_context=max_context, hidden=draft_head is not None or feature_head is not None)
        if draft is not None:
            export_engine(Path(draft), stage / "draft", dtype=dtype, input_mode="embeds", progress=progress,
                          argmax_ids=(lo, hi), calibration=calib, role="draft", max_context=max_context)
        shutil.copy2(src.tokenizer_path, stage / TOKENIZER_FILE)
        step.save(stage / STATS_FILE)
        # prefix_len: the rows before the prompt's text; the runtime adds the prompt's own
        fixed = src.n_image_rows + (1 if src.image_token_id is None else 0)
        policy = {"format": "edgespec-vla/1", "task": f"{src.kind} checkpoint {src.path.name}, statistics {key!r}",
                  "horizon": horizon, "dims": dims, "n_bins": src.n_bins, "vocab_end": src.vocab_end,
                  "image_size": src.image_size, "state_dim": 0, "prefix_len": fixed,
                  "prompt": {"template": src.template, "tokenizer_file": TOKENIZER_FILE,
                             "tokenizer_sha256": C.file_sha256(stage / TOKENIZER_FILE), "append_id": src.append_id,
                             "image_token_id": src.image_token_id},
                  **sem, "binary_dims": [int(j) for j in np.nonzero(~step.mask)[0]],
                  "source": {"format": src.kind, "unnorm_key": key, **src.info},
                  "encoder_file": ENCODER_FILE, "encoder_sha256": C.file_sha256(stage / ENCODER_FILE),
                  "encoder_gate": gate, "precision": dtype,
                  "action_stats_sha256": C.file_sha256(stage / STATS_FILE)}
        if draft_head is not None:
            shutil.copy2(draft_head, stage / PC.HEAD_FILE)
            policy["draft_head_sha256"] = C.file_sha256(stage / PC.HEAD_FILE)
        if feature_head is not None:
            shutil.copy2(feature_head, stage / PC.FEATURE_HEAD_FILE)
            policy["feature_head_sha256"] = C.file_sha256(stage / PC.FEATURE_HEAD_FILE)
        policy[CONTENT_HASH] = policy_content_sha256(policy)
        (stage / PC.POLICY_FILE).write_text(json.dumps(policy, indent=2) + "\n")
        lm.restore()
        policy["end_to_end_gate"] = end_to_end_gate(src, stage, horizon * dims, draft is not None, dtype == "fp32",
                                                    draft_head is not None, feature_head is not None, lm.release)
        policy[CONTENT_HASH] = policy_content_sha256(policy)
        (stage / PC.POLICY_FILE).write_text(json.dumps(policy, indent=2) + "\n")
        lm.restore()  # the caller's src is whole again
        shutil.rmtree(lm_dir)
        publish(stage, out_dir)
    finally:
        if lm is not None and lm.released:
            lm.restore()
        shutil.rmtree(stage, ignore_errors=True)
    return policy


class LanguageModelWeights:
    """Lets a torch module's parameters go (each becomes an empty tensor) and reads them back from the folder
    save_pretrained wrote, by name. Tied parameters are one object and come back as one. At OpenVLA-7B's size the
    fp32 language model is 27 GB, as much again as the exporter's own session of it."""

    def __init__(self, module, folder: Path):
        self.module, self.folder = module, Path(folder)
        self.shapes = {n: (p.shape, p.dtype) for n, p in module.named_parameters()}  # tied ones once
        self.released = False

    def release(self) -> None:
        import gc

        import torch
        for _, p in self.module.named_parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        self.released = True
        gc.collect()

    def restore(self) -> None:
        if not self.released:
            return
        from safetensors.torch import load_file

        from .prismatic import weight_files
        saved = {}
        for f in weight_files(self.folder):
            saved.update(load_file(str(f)))
        for n, p in self.module.named_parameters():
            shape, dtype = self.shapes[n]
            t = saved.pop(n, None)
            if t is None or t.shape != shape:
                raise AssertionError(f"{self.folder}: {n} {shape} is not what save_pretrained wrote "
                                     f"({None if t is None else tuple(t.shape)})")
            p.data = t.to(dtype)
        self.released = False


def end_to_end_gate(src: VLMSource, stage: Path, n: int, with_draft: bool, exact: bool, with_head: bool,
                    with_feature_head: bool = False, release=None) -> dict:
    """On GATE_CASES random observations: the staged policy's prefix (tokenizer, prompt, image rows) equals the
    reference's; with a draft, its speculative ids equal its plain ones; and, for an fp32 export (exact), its greedy
    ids equal the reference's (a lossy one's agreement was judged by the precision gate; here it is recorded).
    Memory: the torch reference runs first, then `release()` (if given) drops its language model, then each staged
    policy is loaded and let go in turn, so the peak is the larger of the reference and one policy, not their sum."""
    import gc

    import torch
    from tokenizers import Tokenizer

    from edgespec.policy import Policy

    tok = Tokenizer.from_file(str(stage / TOKENIZER_FILE))
    rng = np.random.default_rng(11)
    lo, hi = src.vocab_end - src.n_bins, src.vocab_end
    cases = []  # (image (1, S, S, 3), instruction, ids (1, L), the reference's prefix (1, P, E), its n action ids)
    with torch.no_grad():
        for i in range(GATE_CASES):
            img, instr = _image(rng, src.image_size), INSTRUCTIONS[i % len(INSTRUCTIONS)]
            ids = src.prompt(tok, instr)[None]
            t_img, t_ids = torch.from_numpy(img), torch.from_numpy(ids)
            cases.append((img, instr, ids, src.reference_prefix(t_img, t_ids).numpy(),
                          list(src.reference_action_ids(t_img, t_ids, n, lo, hi))))
    if release is not None:
        release()
    worst_prefix, equal, plain = 0.0, 0, []
    pol = Policy(stage, draft=with_draft)
    for i, (img, instr, ids, want_prefix, want) in enumerate(cases):
        if not np.array_equal(pol.instruction_ids(instr), ids):
            raise ValueError(f"end-to-end gate failed on case {i} ({instr!r}): the policy's prompt ids "
                             f"{pol.instruction_ids(instr).tolist()} differ from the reference's {ids.tolist()}")
        prefix = pol.encode(img[0], None, instr)
        if prefix.shape != want_prefix.shape or not np.allclose(prefix, want_prefix, rtol=0,
                                                                atol=ENCODER_TOL * max(1.0, np.abs(want_prefix).max())):
            raise ValueError(f"end-to-end gate failed on case {i} ({instr!r}): the policy's prefix {prefix.shape} "
                             f"differs from the torch reference's {want_prefix.shape}")
        worst_prefix = max(worst_prefix, float(np.abs(prefix - want_prefix).max()))
        got = list(pol.decode_ids(prefix, use_draft=False)[0])
        equal += int(np.sum(np.asarray(got) == np.asarray(want)))
        if exact and got != want:
            raise ValueError(f"end-to-end gate failed on case {i} ({instr!r}): the exported policy decodes {got}, "
                             f"the torch reference {want}")
        plain.append((prefix, got))
    speculative = [("the draft decoder", lambda: pol if with_draft else None),
                   ("the draft head", lambda: Policy(stage, draft="head") if with_head else None),
                   ("the feature head", lambda: Policy(stage, draft="feature-head") if with_feature_head else None)]
    for name, load in speculative:  # one policy at a time
        p = load()
        for i, (prefix, got) in enumerate(plain if p is not None else []):
            spec = list(p.decode_ids(prefix)[0])
            if spec != got:
                raise ValueError(f"end-to-end gate failed on case {i}: speculative decoding with {name} gives "
                                 f"{spec}, plain {got}")
        del p
        pol = None
        gc.collect()
    return {"gate": "prefix and greedy action ids vs the torch reference" + (", speculative == plain" if with_draft
                                                                           or with_head or with_feature_head else ""),
            "cases": GATE_CASES, "ids_equal": equal, "ids": GATE_CASES * n, "ids_enforced": exact, "passed": True,
            "max_abs_prefix_diff": worst_prefix}

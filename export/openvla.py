"""An OpenVLA-layout checkpoint (export/prismatic.py) -> a policy folder the runtime loads with
`edgespec.load_policy`; `edgespec export-policy` dispatches here when the folder's config.json names an OpenVLA
model.

    edgespec export-policy CKPT --out engines/openvla [--unnorm-key bridge_orig] [--draft DRAFT_LM] [--dtype fp16]

Writes, into a staging folder renamed into place only when every gate passed:
  encoder.onnx        image (1, S, S, 3) uint8 -> image_embeds (1, N, E): both backbones' normalisation, the ViTs
                      to their second-to-last block, the projector
  target/             the language model as an inputs_embeds decoder engine (export_engine and its gates),
                      next_ids constrained to the action ids vocab_end - n_bins .. vocab_end - 1
  draft/              --draft: a smaller causal LM of the same width and vocabulary reading the same prefix
  tokenizer.json      the checkpoint's tokenizer; policy.json's "prompt" says how the prompt is built
  action_stats.json   norm_stats[unnorm_key]["action"]: q01, q99, mask
  policy.json         horizon 1, dims = len(q01), no state, the prompt, what the actions mean (OpenVLA's 7: end
                      effector delta xyz, rotation delta, gripper), the source checkpoint and dataset key
Gates: the encoder's rows vs the torch reference (max |diff| <= ENCODER_TOL x max(1, max |row|)), the decoder
gates of export_engine, and end to end: the staged policy's greedy action ids equal the torch reference's
(export/prismatic.py, whole sequence per step) on GATE_CASES random images and instructions.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np

from edgespec import contract as C
from edgespec import policy_contract as PC
from edgespec.actions import ActionStats
from edgespec.policy_contract import CONTENT_HASH, ENCODER_FILE, STATS_FILE, policy_content_sha256
from edgespec.policy_folder import prompt_ids

from .onnx_export import export_engine
from .prismatic import EMPTY_PIECE, OpenVLACheckpoint, OpenVLAFormatError, build_reference, read_checkpoint
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


def _image(rng, s: int) -> np.ndarray:
    return rng.integers(0, 256, (1, s, s, 3), dtype=np.uint8)


def read_tokenizer(ck: OpenVLACheckpoint):
    """-> (the tokenizer, append_id); refuses a tokenizer that adds no BOS (the image rows go after it)."""
    from tokenizers import Tokenizer
    path = ck.path / TOKENIZER_FILE
    if not path.is_file():
        raise OpenVLAFormatError(f"{path} is missing: the prompt is tokenized with the checkpoint's own tokenizer "
                                 f"(tokenizers' tokenizer.json, which OpenVLA's repositories ship)")
    tok = Tokenizer.from_file(str(path))
    enc = tok.encode("x", add_special_tokens=True)
    if not enc.special_tokens_mask or enc.special_tokens_mask[0] != 1:
        raise OpenVLAFormatError(f"{path} adds no BOS token at the start; OpenVLA places the image rows right after "
                                 f"BOS, so its tokenizer must add one")
    append_id = tok.token_to_id(EMPTY_PIECE)
    if append_id is None:
        raise OpenVLAFormatError(f"{path} has no {EMPTY_PIECE!r} piece; OpenVLA appends it after the prompt (id 29871 "
                                 f"in Llama 2's vocabulary)")
    return tok, append_id


def semantics(dims: int, names, units, kind) -> dict:
    """policy.json's state/action semantics: OpenVLA's 7-dim action space unless given."""
    if names is None and dims == 7:
        names, units, kind = OPENVLA_ACTIONS["action_names"], OPENVLA_ACTIONS["action_units"], \
            kind or OPENVLA_ACTIONS["action_kind"]
    if names is None or units is None:
        raise ValueError(f"the chosen statistics have {dims} action dimensions, not OpenVLA's 7; name them with "
                         f"--action-names and --action-units ({dims} each)")
    return {"embodiment": "openvla", "state_names": [], "state_units": [],
            "action_kind": kind or "cartesian_delta", "action_names": list(names), "action_units": list(units)}


def export_encoder(ref, ck: OpenVLACheckpoint, path: Path) -> dict:
    """Trace image -> image_embeds to ONNX and gate it against the torch reference."""
    import onnxruntime as ort
    import torch

    class ImageEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ref = ref

        def forward(self, image):
            return self.ref.image_embeds(image)

    rng = np.random.default_rng(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(ImageEncoder(), (torch.from_numpy(_image(rng, ck.image_size)),), str(path), dynamo=False,
                          opset_version=17, input_names=[PC.ENC_IMAGE], output_names=[PC.ENC_IMAGE_EMBEDS],
                          do_constant_folding=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, scale = 0.0, 1.0
    with torch.no_grad():
        for _ in range(3):
            img = _image(rng, ck.image_size)
            want = ref.image_embeds(torch.from_numpy(img)).numpy()
            got = sess.run(None, {PC.ENC_IMAGE: img})[0]
            worst, scale = max(worst, float(np.abs(want - got).max())), max(scale, float(np.abs(want).max()))
    tol = ENCODER_TOL * scale
    report = {"gate": "encoder parity vs torch", "cases": 3, "max_abs_diff": worst, "tol": tol, "passed": worst <= tol}
    if not report["passed"]:
        raise ValueError(f"encoder gate failed: ORT vs torch max |diff| {worst:.3g} > {tol:.3g}")
    return report


def calibration(ref, ck: OpenVLACheckpoint, tok, append_id: int, template: str, dims: int, n_obs: int = 16):
    """Rows for the target's precision gate as the policy uses it: prefix + the reference's greedy actions, scored
    from the prompt's last position. -> ([(x (P + D - 1, E), P - 1)], source)."""
    import torch
    rng = np.random.default_rng(7)
    lo, hi = ck.vocab_end - ck.n_bins, ck.vocab_end
    table = ref.language_model.get_input_embeddings().weight
    rows = []
    with torch.no_grad():
        for i in range(n_obs):
            img = torch.from_numpy(_image(rng, ck.image_size))
            ids = torch.from_numpy(prompt_ids(tok, template, INSTRUCTIONS[i % len(INSTRUCTIONS)], append_id))[None]
            acts = ref.action_ids(img, ids, dims - 1, lo, hi) if dims > 1 else []
            x = torch.cat([ref.prefix(img, ids)] + [table[a][None, None] for a in acts], 1)
            rows.append((x[0].numpy().astype(np.float32), x.shape[1] - len(acts) - 1))
    return rows, f"{n_obs} random images and instructions: prompt prefix + the fp32 reference's greedy actions"


def export_openvla(ckpt_dir: str | Path, out_dir: str | Path, unnorm_key: str | None = None, dtype: str = "fp32",
                   draft: str | Path | None = None, prompt_template: str | None = None, action_names=None,
                   action_units=None, action_kind: str | None = None, force: bool = False, progress: bool = True,
                   allow_lossy: bool = False, max_context: int | None = None) -> dict:
    import torch

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    ck = read_checkpoint(ckpt_dir, prompt_template)  # refuses a folder that is not OpenVLA's layout, by name
    key, action = ck.action_stats(unnorm_key)
    stats = ActionStats(action["q01"], action["q99"], action.get("mask", []))
    sem = semantics(stats.dims, action_names, action_units, action_kind)
    tok, append_id = read_tokenizer(ck)
    if draft is not None:
        dcfg = json.loads((Path(draft) / "config.json").read_text()) if (Path(draft) / "config.json").is_file() \
            else None
        if dcfg is None:
            raise FileNotFoundError(f"--draft {draft}: no config.json; expected a causal LM checkpoint folder")
        if (dcfg.get("hidden_size"), dcfg.get("vocab_size")) != (ck.llm_dim, ck.text_config["vocab_size"]):
            raise ValueError(f"--draft {draft} has width {dcfg.get('hidden_size')} and vocabulary "
                             f"{dcfg.get('vocab_size')}; it reads the target's prefix, so it needs width {ck.llm_dim} "
                             f"and vocabulary {ck.text_config['vocab_size']}")
    check_out_dir(out_dir, [ckpt_dir], force)
    stage = prepare(out_dir, [ckpt_dir], force)
    lo, hi = ck.vocab_end - ck.n_bins, ck.vocab_end
    try:
        ref = build_reference(ck)
        gate = export_encoder(ref, ck, stage / ENCODER_FILE)
        lm_dir = stage / "_language_model"  # the language model as a plain HF folder, for export_engine
        ref.language_model.save_pretrained(lm_dir, safe_serialization=True)
        calib = calibration(ref, ck, tok, append_id, ck.prompt_template, stats.dims) if dtype != "fp32" else None
        export_engine(lm_dir, stage / "target", dtype=dtype, input_mode="embeds", progress=progress,
                      argmax_ids=(lo, hi), calibration=calib, role="target", allow_lossy=allow_lossy,
                      max_context=max_context)
        shutil.rmtree(lm_dir)
        if draft is not None:
            export_engine(Path(draft), stage / "draft", dtype=dtype, input_mode="embeds", progress=progress,
                          argmax_ids=(lo, hi), calibration=calib, role="draft", max_context=max_context)
        shutil.copy2(ckpt_dir / TOKENIZER_FILE, stage / TOKENIZER_FILE)
        stats.save(stage / STATS_FILE)
        policy = {"format": "edgespec-vla/1", "task": f"OpenVLA checkpoint {ckpt_dir.name}, statistics {key!r}",
                  "horizon": 1, "dims": stats.dims, "n_bins": ck.n_bins, "vocab_end": ck.vocab_end,
                  "image_size": ck.image_size, "state_dim": 0, "prefix_len": 1 + ck.n_image_tokens,
                  "prompt": {"template": ck.prompt_template, "tokenizer_file": TOKENIZER_FILE,
                             "tokenizer_sha256": C.file_sha256(stage / TOKENIZER_FILE), "append_id": append_id},
                  **sem, "binary_dims": [int(j) for j in np.nonzero(~stats.mask)[0]],
                  "source": {"format": "openvla", "vision_backbone_id": ck.config["vision_backbone_id"],
                             "llm_backbone_id": ck.config.get("llm_backbone_id"), "unnorm_key": key,
                             "image_resize_strategy": ck.config.get("image_resize_strategy")},
                  "encoder_file": ENCODER_FILE, "encoder_sha256": C.file_sha256(stage / ENCODER_FILE),
                  "encoder_gate": gate, "precision": dtype,
                  "action_stats_sha256": C.file_sha256(stage / STATS_FILE)}
        policy[CONTENT_HASH] = policy_content_sha256(policy)
        (stage / PC.POLICY_FILE).write_text(json.dumps(policy, indent=2) + "\n")
        policy["end_to_end_gate"] = end_to_end_gate(ref, ck, stage, stats.dims, draft is not None, dtype == "fp32")
        policy[CONTENT_HASH] = policy_content_sha256(policy)
        (stage / PC.POLICY_FILE).write_text(json.dumps(policy, indent=2) + "\n")
        publish(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return policy


def end_to_end_gate(ref, ck: OpenVLACheckpoint, stage: Path, dims: int, with_draft: bool, exact: bool) -> dict:
    """On GATE_CASES random observations: the staged policy's prefix (tokenizer, prompt, image rows after BOS)
    equals the torch reference's; with a draft, its speculative ids equal its plain ones; and, for an fp32
    export (exact), its greedy ids equal the reference's (a lossy one's agreement was judged by the precision
    gate; here it is recorded)."""
    import torch

    from edgespec.policy import Policy

    pol = Policy(stage, draft=with_draft)
    rng = np.random.default_rng(11)
    lo, hi = ck.vocab_end - ck.n_bins, ck.vocab_end
    worst_prefix, equal = 0.0, 0
    for i in range(GATE_CASES):
        img, instr = _image(rng, ck.image_size), INSTRUCTIONS[i % len(INSTRUCTIONS)]
        ids = pol.instruction_ids(instr)
        prefix = pol.encode(img[0], None, instr)
        with torch.no_grad():
            want_prefix = ref.prefix(torch.from_numpy(img), torch.from_numpy(ids)).numpy()
        if prefix.shape != want_prefix.shape or not np.allclose(prefix, want_prefix, rtol=0,
                                                                atol=ENCODER_TOL * max(1.0, np.abs(want_prefix).max())):
            raise ValueError(f"end-to-end gate failed on case {i} ({instr!r}): the policy's prefix {prefix.shape} "
                             f"differs from the torch reference's {want_prefix.shape}")
        worst_prefix = max(worst_prefix, float(np.abs(prefix - want_prefix).max()))
        want = ref.action_ids(torch.from_numpy(img), torch.from_numpy(ids), dims, lo, hi)
        got, _ = pol.decode_ids(prefix, use_draft=False)
        equal += int(np.sum(np.asarray(got) == np.asarray(want)))
        if exact and list(got) != want:
            raise ValueError(f"end-to-end gate failed on case {i} ({instr!r}): the exported policy decodes {list(got)}, "
                             f"the torch reference {want}")
        if with_draft:
            spec, _ = pol.decode_ids(prefix)
            if list(spec) != list(got):
                raise ValueError(f"end-to-end gate failed on case {i}: speculative decoding gives {list(spec)}, plain "
                                 f"{list(got)}")
    return {"gate": "prefix and greedy action ids vs the torch reference" + (", speculative == plain" if with_draft
                                                                           else ""),
            "cases": GATE_CASES, "ids_equal": equal, "ids": GATE_CASES * dims, "ids_enforced": exact, "passed": True,
            "max_abs_prefix_diff": worst_prefix}

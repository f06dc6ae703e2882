"""VLA policy folder (from train_vla.py) -> policy engine folder the runtime loads with `edgespec.load_policy`.

    edgespec export-policy models/vla-reacher --out engines/vla-reacher [--dtype fp32|fp16|int8]

Writes, into a staging folder renamed into place only when every gate passed:
  encoder.onnx          image, state, instruction -> prefix_embeds (contract.py names), fp32
  target/, draft/       inputs_embeds decoder engines (export_engine: parity and verify gates, manifest)
  action_stats.json     q01 / q99 / mask of the action dimensions
  draft_head.npz        the numpy draft head, when the model folder has one (train_draft_head.py)
  feature_head.npz      a FAST policy's feature-level draft head (train_feature_head.py), when the model folder has
                        one: the target engine then also outputs its hidden state, which the head reads
  policy.json           the model folder's policy.json (checked: PolicyManifest) + the encoder, draft head
                        and action_stats.json hashes + the encoder gate report, then content_sha256 over
                        all of it (the runtime refuses a policy.json or action_stats.json edited afterwards)
Encoder gate: ORT vs the torch encoder on random images/states/instructions, max |diff| <= 1e-4.
OUT and --force: export/staging.py (only a folder edgespec wrote is replaced).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np

from edgespec import contract as C
from edgespec import policy_contract as PC
from edgespec.fast_tokens import FastTokenizer
from edgespec.policy_contract import (CONTENT_HASH, ENCODER_FILE, FEATURE_HEAD_FILE, HEAD_FILE, STATS_FILE,
                                      PolicyManifest, policy_content_sha256, read_policy_json)

from .onnx_export import export_engine
from .staging import check_out_dir, prepare, publish

ENCODER_TOL = 1e-4


def load_encoder(model_dir: Path):
    """The torch encoder of a policy model folder, fp32, eval mode."""
    import torch
    from safetensors.torch import load_file

    from .vla_model import VLAConfig, build_encoder

    policy = json.loads((model_dir / PC.POLICY_FILE).read_text())
    cfg = VLAConfig.from_dict(policy["config"])
    enc = build_encoder(cfg)
    state = {k: v.to(torch.float32) for k, v in load_file(str(model_dir / "encoder.safetensors")).items()}
    missing, unexpected = enc.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}/encoder.safetensors does not match the encoder: missing {missing}, "
                         f"unexpected {unexpected}")
    return enc.eval(), policy, cfg


def example_inputs(policy: dict, n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    s, l, words = policy["image_size"], policy["instr_len"], len(policy["words"])
    out = []
    for _ in range(n):
        img = rng.integers(0, 256, (1, s, s, 3), dtype=np.uint8)
        state = rng.normal(0, 1.5, (1, policy["state_dim"])).astype(np.float32)
        k = int(rng.integers(1, l + 1))
        instr = np.zeros((1, l), np.int64)
        instr[0, :k] = rng.integers(1, words, k)
        out.append((img, state, instr))
    return out


def policy_calibration(model_dir: Path, n_obs: int = 64, seed: int = 7) -> tuple[list, str]:
    """Rows for the target decoder's precision gate, as the policy uses it: for n_obs synthetic observations
    (seeds apart from the encoder gate's) the encoder's prefix (P, E) and then the embeddings of the H*D
    action ids the fp32 torch target decodes greedily from it; scored from the prefix's last position, so
    exactly the H*D positions whose argmax becomes an action count. -> ([(x (P+H*D-1, E), P-1)], source)."""
    import torch
    from transformers import AutoModelForCausalLM

    enc, policy, _ = load_encoder(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir / "target", dtype=torch.float32).eval()
    table = target.get_input_embeddings().weight
    lo, hi = int(policy["vocab_end"]) - int(policy["n_bins"]), int(policy["vocab_end"])
    fast = policy.get("fast")
    n = int(fast["max_tokens"]) if fast else int(policy["horizon"]) * int(policy["dims"])
    end = FastTokenizer.load(model_dir / fast["file"]).end_id if fast else None
    rows = []
    with torch.no_grad():
        for img, state, instr in example_inputs(policy, n_obs, seed=seed):
            x = enc(torch.from_numpy(img), torch.from_numpy(state), torch.from_numpy(instr))  # (1, P, E)
            p = x.shape[1]
            for _ in range(n - 1):  # the last action is decoded from the row's last position
                nxt = target(inputs_embeds=x).logits[0, -1, lo:hi].argmax() + lo
                if int(nxt) == end:  # FAST: the chunk ended; END is scored from the row's last position
                    break
                x = torch.cat([x, table[nxt][None, None]], 1)
            rows.append((x[0].numpy().astype(np.float32), p - 1))
    return rows, f"{n_obs} synthetic observations: encoder prefix + the fp32 target's greedy actions"


def export_encoder(model_dir: Path, path: Path) -> dict:
    """Trace the encoder to ONNX and gate it against torch. Returns the gate report."""
    import onnxruntime as ort
    import torch

    enc, policy, _ = load_encoder(model_dir)
    img, state, instr = example_inputs(policy, 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(enc, (torch.from_numpy(img), torch.from_numpy(state), torch.from_numpy(instr)),
                          str(path), dynamo=False, opset_version=17,
                          input_names=[PC.ENC_IMAGE, PC.ENC_STATE, PC.ENC_INSTRUCTION], output_names=[PC.ENC_PREFIX],
                          do_constant_folding=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    with torch.no_grad():
        for img, state, instr in example_inputs(policy, 8, seed=1):
            ref = enc(torch.from_numpy(img), torch.from_numpy(state), torch.from_numpy(instr)).numpy()
            got = sess.run(None, {PC.ENC_IMAGE: img, PC.ENC_STATE: state, PC.ENC_INSTRUCTION: instr})[0]
            worst = max(worst, float(np.abs(ref - got).max()))
    report = {"gate": "encoder parity vs torch", "cases": 8, "max_abs_diff": worst, "tol": ENCODER_TOL,
              "passed": worst <= ENCODER_TOL}
    if not report["passed"]:
        raise ValueError(f"encoder gate failed: ORT vs torch max |diff| {worst:.3g} > {ENCODER_TOL}")
    return report


def check_feature_head(path: Path, meta: dict, target_config: Path) -> None:
    """A feature head (train_feature_head.py) must be a FAST policy's and fit its target: refused by name."""
    from edgespec.text_head import TextHeadWeights
    if not meta.get("fast"):
        raise ValueError(f"{path}: a feature head drafts FAST tokens, and this policy emits bins (its draft head is "
                         f"{HEAD_FILE}, train_draft_head.py); remove the file or export a FAST policy")
    cfg = json.loads(target_config.read_text())
    TextHeadWeights.load(path).check_fits(  # load refuses weights that do not fit together
        str(path), (int(cfg["vocab_size"]), int(cfg["hidden_size"])),
        (int(meta["vocab_end"]) - int(meta["n_bins"]), int(meta["vocab_end"])), f"{target_config}")


def export_policy(model_dir: str | Path, out_dir: str | Path, dtype: str = "fp32", force: bool = False,
                  progress: bool = True, allow_lossy: bool = False) -> dict:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    needed = [PC.POLICY_FILE, STATS_FILE, "encoder.safetensors", "target/config.json"]
    missing = [n for n in needed if not (model_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir} is not a VLA policy folder: missing {missing}")
    meta = read_policy_json(model_dir / PC.POLICY_FILE)
    PolicyManifest.from_dict(meta, model_dir / PC.POLICY_FILE)  # refuse a malformed one before any work
    feature_head = model_dir / FEATURE_HEAD_FILE
    if feature_head.is_file():  # a FAST policy's feature head reads the target's hidden state
        check_feature_head(feature_head, meta, model_dir / "target" / "config.json")
    check_out_dir(out_dir, [model_dir], force)
    stage = prepare(out_dir, [model_dir], force)  # .NAME.partial-PID beside OUT; dead ones there removed
    try:
        gate = export_encoder(model_dir, stage / ENCODER_FILE)
        actions = (int(meta["vocab_end"]) - int(meta["n_bins"]), int(meta["vocab_end"]))  # next_ids picks among these
        calib = policy_calibration(model_dir) if dtype != "fp32" else None
        for name in ("target", "draft"):
            if (model_dir / name / "config.json").is_file():
                export_engine(model_dir / name, stage / name, dtype=dtype, input_mode="embeds", progress=progress,
                              argmax_ids=actions, calibration=calib, role=name, allow_lossy=allow_lossy,  # the gate binds the target
                              hidden=name == "target" and feature_head.is_file())
        shutil.copy2(model_dir / STATS_FILE, stage / STATS_FILE)
        policy = {k: v for k, v in meta.items() if k != CONTENT_HASH}
        if meta.get("fast"):  # FAST tokens: the tokenizer file travels with its hash
            FastTokenizer.load(model_dir / meta["fast"]["file"])  # refuses one that does not load
            shutil.copy2(model_dir / meta["fast"]["file"], stage / meta["fast"]["file"])
            policy["fast"] = {**meta["fast"], "sha256": C.file_sha256(stage / meta["fast"]["file"])}
        policy.update({"encoder_file": ENCODER_FILE, "encoder_sha256": C.file_sha256(stage / ENCODER_FILE),
                       "encoder_gate": gate, "precision": dtype,
                       "action_stats_sha256": C.file_sha256(stage / STATS_FILE)})
        if (model_dir / HEAD_FILE).is_file():  # the numpy draft head (train_draft_head.py): copied as is
            from edgespec.draft_head import DraftHeadWeights
            DraftHeadWeights.load(model_dir / HEAD_FILE)  # refuses weights that do not fit together
            shutil.copy2(model_dir / HEAD_FILE, stage / HEAD_FILE)
            policy["draft_head_sha256"] = C.file_sha256(stage / HEAD_FILE)
        if feature_head.is_file():
            shutil.copy2(feature_head, stage / FEATURE_HEAD_FILE)
            policy["feature_head_sha256"] = C.file_sha256(stage / FEATURE_HEAD_FILE)
        policy[CONTENT_HASH] = policy_content_sha256(policy)  # last: covers every field above
        (stage / PC.POLICY_FILE).write_text(json.dumps(policy, indent=2) + "\n")
        publish(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return policy

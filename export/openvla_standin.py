"""A real-size stand-in of a trained OpenVLA-layout policy: its language model inflated to a real model's shape by
export/standin.py (same function: the residual stream padded with dimensions that stay exactly zero), the vision
backbone kept, the projector's last layer padded with zero rows so the image rows live in the wider stream, and its
draft decoder and hidden-state draft head widened to match. Greedy ids stay the source policy's, acceptance stays
its drafts', while every decoder matrix has the real model's shape and bytes.

    python -m edgespec.export.openvla_standin --source .cache/openvla-reacher/model --preset llama-3.2-1b \
        --out .cache/openvla-reacher/standin-1b

SOURCE is train_openvla.py's output (target/ an OpenVLA-layout checkpoint, draft/ an HF Llama folder,
draft_head.npz). Writes OUT/target (OpenVLA layout, float16 weights), OUT/draft, OUT/draft_head.npz (and
OUT/feature_head.npz when the source has one), standin.json.
The draft keeps one layer at the target's width (it reads the target's prefix): about 1/35 of a 1B target's bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from .standin import PRESETS, Shape, make_standin


def _load_folder(path: Path) -> dict:
    """Every tensor of a safetensors folder (single or sharded), as torch tensors (bfloat16 kept)."""
    from safetensors.torch import load_file

    from .prismatic import weight_files
    out = {}
    for f in weight_files(path):
        out.update(load_file(str(f)))
    return out


def widen_feature_head(src: Path, out: Path, e2: int) -> None:
    """A feature head (text_head.py) for the stand-in: the target's final hidden state is the source's in its first
    E dims and exactly zero in the padded ones, so zero rows (reading them) and zero columns (writing them) leave
    every proposal the source head's."""
    from edgespec.text_head import TextHeadWeights
    w = TextHeadWeights.load(src)
    e = w.w_h.shape[0]

    def rows(a):  # (E, X) -> (E2, X)
        return np.concatenate([a, np.zeros((e2 - e, a.shape[1]), a.dtype)], 0)

    def cols(a):  # (X, E) -> (X, E2)
        return np.concatenate([a, np.zeros((a.shape[0], e2 - e), a.dtype)], 1)
    TextHeadWeights(rows(w.w_h), rows(w.w_e), w.b_in, cols(w.w_out), cols(w.b_out[None])[0], cols(w.embed),
                    cols(w.lm), w.vocab).save(out)


def widen_draft_head(src: Path, out: Path, e: int, e2: int) -> None:
    """A per-dimension draft head (draft_head.py) for the stand-in: it reads P prefix rows of E flattened, ctx_w
    (P*E, H); each row gets zero weights for the padded dims, which are exactly zero in the stand-in's prefix."""
    from edgespec.draft_head import DraftHeadWeights
    hw = DraftHeadWeights.load(src)
    rows, h = hw.ctx_w.shape
    if rows % e:
        raise ValueError(f"{src}: ctx_w: expected rows of whole {e}-wide prefix rows, got {rows}")
    w = hw.ctx_w.reshape(rows // e, e, h)  # (P, E, H)
    hw.ctx_w = np.concatenate([w, np.zeros((w.shape[0], e2 - e, h), w.dtype)], 1).reshape(-1, h)  # (P*E2, H)
    hw.save(out)


def widen_heads(source: Path, out: Path, e: int, e2: int) -> None:
    """SOURCE's draft_head.npz and feature_head.npz, where it has them, widened from E to E2 into OUT."""
    if (source / "draft_head.npz").is_file():
        widen_draft_head(source / "draft_head.npz", out / "draft_head.npz", e, e2)
    if (source / "feature_head.npz").is_file():
        widen_feature_head(source / "feature_head.npz", out / "feature_head.npz", e2)


def target_shape(preset: str, shape=None) -> Shape:
    """The stand-in target's shape: `shape` (a Shape or a dict of its fields) when given, else the preset's."""
    if shape is None and preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return Shape.of(shape) if shape is not None else PRESETS[preset].target


def fresh_out(out: Path) -> None:
    """OUT emptied for a new stand-in: an earlier stand-in (standin.json) is replaced, any other non-empty folder is
    refused rather than deleted."""
    if out.exists():
        if any(out.iterdir()) and not (out / "standin.json").is_file():
            raise ValueError(f"{out}: out: expected an empty folder or an earlier stand-in, got a folder with other "
                             f"files (not overwritten)")
        shutil.rmtree(out)


def make_openvla_standin(source: str | Path, out: str | Path, preset: str = "llama-3.2-1b", seed: int = 0,
                         progress: bool = True, shape: Shape | None = None) -> dict:
    """shape: the target's shape in place of the preset's (tests use small ones)."""
    import torch
    from safetensors.torch import save_file

    from .prismatic import build_reference, read_checkpoint

    t0 = time.perf_counter()
    source, out = Path(source), Path(out)
    shape = target_shape(preset, shape)
    ck = read_checkpoint(source / "target")
    e, e2 = ck.llm_dim, shape.hidden_size
    fresh_out(out)
    (out / "target").mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tmp = Path(tmp)
        ref = build_reference(ck)
        ref.language_model.save_pretrained(tmp / "lm", safe_serialization=True)
        del ref
        rec = make_standin(tmp / "lm", tmp / "lm-big", shape, seed=seed, progress=progress, name=f"{preset} target",
                           genai_builder=False)  # a policy decoder: no GenAI builder reads it
        big = _load_folder(tmp / "lm-big")
        cfg_big = json.loads((tmp / "lm-big" / "config.json").read_text())
        src_w = {k: v for k, v in _load_folder(source / "target").items() if not k.startswith("language_model.")}
        # every projector layer that writes the language model's width gets zero rows for the new dims (GELU(0) = 0),
        # and one that reads it zero columns: the image rows are the source's, then exact zeros
        layers = [("projector.fc2", False), ("projector.fc3", True)] if ck.fused else \
            [("projector.fc1", False), ("projector.fc2", True)]  # (name, reads the language model's width too)
        for name, reads in layers:
            w, b = src_w[name + ".weight"], src_w[name + ".bias"]  # (E, in), (E,)
            w = torch.cat([w, torch.zeros((e2 - e, w.shape[1]), dtype=w.dtype)], 0)
            if reads:
                w = torch.cat([w, torch.zeros((e2, e2 - e), dtype=w.dtype)], 1)
            src_w[name + ".weight"], src_w[name + ".bias"] = w, torch.cat([b, torch.zeros(e2 - e, dtype=b.dtype)])
        tensors = {k: v.contiguous() for k, v in src_w.items()}
        tensors.update({f"language_model.{k}": v.contiguous() for k, v in big.items()})
        save_file(tensors, str(out / "target" / "model.safetensors"), metadata={"format": "pt"})
        del tensors, big
        config = dict(ck.config)
        text = {k: v for k, v in cfg_big.items() if k not in ("architectures", "dtype", "torch_dtype")}
        text["model_type"] = "llama"
        config.update(text_config=text, torch_dtype="float16")
        (out / "target" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
            if (source / "target" / f).is_file():
                shutil.copy2(source / "target" / f, out / "target" / f)
        draft_shape = Shape(e2, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                            e2, 1)  # one layer at the target's width, MLP as wide as the stream
        drec = make_standin(source / "draft", out / "draft", draft_shape, seed=seed + 1, progress=progress,
                            name=f"{preset} draft", genai_builder=False)
    widen_heads(source, out, e, e2)
    record = {"kind": "edgespec-openvla-standin", "preset": preset, "source": str(source), "target": rec,
              "draft": drec, "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "standin.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=Path(".cache/openvla-reacher/model"))
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rec = make_openvla_standin(args.source, args.out, args.preset, args.seed)
    print(f"wrote {args.out}: target {rec['target']['params'] / 1e9:.2f}B parameters, draft "
          f"{rec['draft']['params'] / 1e6:.0f}M, {rec['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

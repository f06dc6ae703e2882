"""A real-size stand-in of a trained edgespec-vla/1 policy model folder (train_vla.py's output, bins or FAST tokens):
its target decoder inflated to a real model's shape by export/standin.py (the residual stream padded with dimensions
that stay exactly zero), every encoder output that lands in the stream padded with zeros to the new width, and its
draft decoder and draft heads widened to match. Greedy ids and acceptance stay the source policy's, while every
decoder matrix has the real model's shape and bytes: the decode costs of a policy of that size.

    python -m edgespec.export.vla_standin --source .cache/vla-fast/model --preset llama-3.2-1b \
        --out .cache/vla-fast/standin-1b
    edgespec export-policy .cache/vla-fast/standin-1b --out engines/vla-reacher-fast-1b --dtype fp16

Writes OUT as a policy model folder (policy.json with the new widths in its config, encoder.safetensors,
target/, draft/, the heads, the tokenizer and statistics copied) and OUT/standin.json. The draft keeps its layers
(one, from train_vla.py) at the target's width, as openvla_standin.py's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from .openvla_standin import fresh_out, target_shape, widen_heads
from .standin import PRESETS, Shape, StandinError, make_standin

COPIED = ("action_stats.json", "train.json", "draft_head.json", "feature_head.json")  # FAST: its file, by name


def widen_encoder(state: dict, img_tokens: int, e: int, e2: int) -> dict:
    """The encoder's tensors (vla_model.build_encoder) for a stream of width e2: each output that lands in the
    prefix gets zeros for the new dims and each input read from it zero columns, so the prefix (P, E2) is the
    source's (P, E) followed by exact zeros. -> a new dict; the source's tensors are not modified."""
    import torch

    def pad(t, axis: int):
        shape = list(t.shape)
        shape[axis] = e2 - e
        return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], axis)

    out = dict(state)
    for name in ("words.weight", "instr_pos", "kind", "film.weight"):  # (W, E), (L, E), (4, E), (64, E) reads E
        out[name] = pad(state[name], 1)
    for name in ("goal_tok", "state"):  # Linear(in, E): weight (E, in), bias (E,)
        out[f"{name}.weight"], out[f"{name}.bias"] = pad(state[f"{name}.weight"], 0), pad(state[f"{name}.bias"], 0)
    w, b = state["img.weight"], state["img.bias"]  # (T*E, 3K), (T*E,): T image tokens of E each
    out["img.weight"] = pad(w.reshape(img_tokens, e, -1), 1).reshape(img_tokens * e2, -1)
    out["img.bias"] = pad(b.reshape(img_tokens, e), 1).reshape(-1)
    return out


def make_vla_standin(source: str | Path, out: str | Path, preset: str = "llama-3.2-1b", seed: int = 0,
                     progress: bool = True, shape: Shape | None = None) -> dict:
    """shape: the target's shape in place of the preset's (tests use small ones)."""
    import torch
    from safetensors.torch import load_file, save_file

    from .vla_model import VLAConfig, build_encoder

    t0 = time.perf_counter()
    source, out = Path(source), Path(out)
    shape = target_shape(preset, shape)
    policy_path = source / "policy.json"
    if not policy_path.is_file():
        raise StandinError(f"{source}: expected a policy model folder (train_vla.py's output, policy.json), "
                           f"got no policy.json")
    policy = json.loads(policy_path.read_text())
    if policy.get("format") != "edgespec-vla/1":
        raise StandinError(f"{policy_path}: format: expected 'edgespec-vla/1' (an OpenVLA-layout checkpoint has "
                           f"openvla_standin.py), got {policy.get('format')!r}")
    cfg = VLAConfig.from_dict(policy["config"])
    e, e2 = cfg.hidden, shape.hidden_size
    if e2 < e:
        raise StandinError(f"shape.hidden_size: expected at least the source's {e}, got {e2}")
    fresh_out(out)
    out.mkdir(parents=True)
    rec = make_standin(source / "target", out / "target", shape, seed=seed, progress=progress,
                       name=f"{preset} target", genai_builder=False)  # a policy decoder: no GenAI builder reads it
    drec = None
    if (source / "draft" / "config.json").is_file():  # its own layers, at the target's width
        layers = int(json.loads((source / "draft" / "config.json").read_text())["num_hidden_layers"])
        draft_shape = Shape(e2, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim, e2, layers)
        drec = make_standin(source / "draft", out / "draft", draft_shape, seed=seed + 1, progress=progress,
                            name=f"{preset} draft", genai_builder=False)
    wide = VLAConfig.from_dict({**policy["config"], "hidden": e2, "heads": shape.num_attention_heads,
                                "target_layers": shape.num_hidden_layers, "target_inter": shape.intermediate_size,
                                "draft_inter": e2})
    state = widen_encoder(load_file(str(source / "encoder.safetensors")), cfg.img_tokens, e, e2)
    enc = build_encoder(wide)
    missing, unexpected = enc.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    if missing or unexpected:  # the widened tensors must be exactly the wide encoder's, name and shape
        raise StandinError(f"{source}/encoder.safetensors: widened to {e2}, expected the encoder's tensors, "
                           f"missing {missing}, unexpected {unexpected}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "encoder.safetensors"))
    for f in COPIED + ((policy["fast"]["file"],) if policy.get("fast") else ()):
        if (source / f).is_file():
            shutil.copy2(source / f, out / f)
    widen_heads(source, out, e, e2)
    (out / "policy.json").write_text(json.dumps({**policy, "config": asdict(wide)}, indent=2) + "\n")
    record = {"kind": "edgespec-vla-standin", "preset": preset, "source": str(source), "target": rec,
              "draft": drec, "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "standin.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, required=True, help="a policy model folder (train_vla.py's output)")
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rec = make_vla_standin(args.source, args.out, args.preset, args.seed)
    print(f"wrote {args.out}: target {rec['target']['params'] / 1e9:.2f}B parameters"
          + (f", draft {rec['draft']['params'] / 1e6:.0f}M" if rec["draft"] else "") + f", {rec['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

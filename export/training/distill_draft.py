"""Distil a draft model on the target's greedy text: fine-tune a draft checkpoint so that its argmax follows the
target's greedy choice on the windows train_attn_head cached (`--windows code`: code up to a `def` line, then the
target's own continuation), and measure its chained acceptance before and after in train_attn_head's protocol.

    python -m edgespec.export.training.distill_draft --draft models/demo-draft --windows .cache/attn-head/code \\
        --out .cache/distilled/demo-draft-code --threads 2

Why: an attention head trained on those windows drafts the text it was trained for; a draft model distilled on the
same windows is the fair rival for it, and the draft every runtime that runs a draft model (llama.cpp's
speculative mode too) can use. The loss is cross-entropy on the target's greedy choice at every position (hard
distillation: what greedy acceptance asks of a draft). Training-split windows train, held-out ones validate. The
output is a checkpoint folder like the source's (its other files copied), plus distill.json beside the weights.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import optimizer_step
from .train_attn_head import chain_acceptance, tokens_per_round
from .train_text_head import load_blocks

SEED = 1234
BLOCK = re.compile(r"^(train|val)-(.+)-(\d{4})\.npz$")


@dataclass
class DistillConfig:
    epochs: int = 3
    batch: int = 16  # windows per step
    lr: float = 3e-4
    chain: int = 6  # validation: proposals per chain

    def __post_init__(self):
        for name, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")


def window_blocks(work: Path, key: str | None = None) -> tuple[list[Path], list[Path], str]:
    """(train blocks, validation blocks, key) of the windows train_attn_head cached under `work`: the one key
    present, or `key` where several are."""
    found: dict[str, dict[str, list[Path]]] = {}
    for p in sorted(Path(work).glob("*.npz")):
        m = BLOCK.match(p.name)
        if m:
            found.setdefault(m.group(2), {"train": [], "val": []})[m.group(1)].append(p)
    keys = sorted(k for k, v in found.items() if v["train"] and v["val"])
    if key is None:
        if len(keys) != 1:
            raise ValueError(f"{work}: expected the windows of one train_attn_head run (train-KEY-NNNN.npz and "
                             f"val-KEY-NNNN.npz), found {len(keys)} keys{': ' + ', '.join(keys) if keys else ''}"
                             + ("; pick one with --key" if keys else ""))
        key = keys[0]
    elif key not in keys:
        raise ValueError(f"{work}: no train and val windows for key {key!r}; found: {', '.join(keys) or 'none'}")
    return found[key]["train"], found[key]["val"], key


def greedy_table(model, ids: np.ndarray, batch: int = 16) -> np.ndarray:
    """The draft's argmax after every position of every window, teacher-forced on the window (N, T)."""
    import torch
    out = []
    with torch.no_grad():
        for b in range(0, len(ids), batch):
            out.append(model(torch.from_numpy(ids[b:b + batch])).logits.argmax(-1).numpy())
    return np.concatenate(out)


def agreement(table: np.ndarray, greedy: np.ndarray) -> float:
    """The share of positions where the draft's argmax is the target's greedy choice."""
    return round(float((table == greedy).mean()), 4)


def acceptance(table: np.ndarray, val: dict, chain: int) -> list[float]:
    return chain_acceptance(val, lambda i, j: (lambda k: int(table[i][j + k + 1])), chain)


def distil(model, data: dict, cfg: DistillConfig, progress: bool) -> dict:
    """Fine-tunes in place: cross-entropy of the draft's logits at position t on the target's greedy choice there."""
    import torch
    from tqdm import tqdm

    ids, greedy = torch.from_numpy(data["ids"]), torch.from_numpy(data["greedy"])
    per_epoch = max(len(ids) // cfg.batch, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.epochs * per_epoch, pct_start=0.1)
    rng = np.random.default_rng(SEED)
    model.train()
    loss = float("nan")
    with tqdm(total=cfg.epochs * per_epoch, desc="distil draft", disable=not progress) as bar:
        for _ in range(cfg.epochs):
            order = rng.permutation(len(ids))
            for b in range(per_epoch):
                sel = torch.from_numpy(order[b * cfg.batch:(b + 1) * cfg.batch])
                logits = model(ids[sel]).logits  # (B, T, V)
                step = torch.nn.functional.cross_entropy(logits.flatten(0, 1), greedy[sel].flatten())
                loss = optimizer_step(step, opt, sched, bar)
    model.eval()
    return {"steps": cfg.epochs * per_epoch, "last_loss": round(loss, 4)}


def save(model, source: Path, out: Path) -> None:
    """The fine-tuned weights in the source's dtype, with the source's other files (tokenizer, templates)."""
    import torch
    dtype = getattr(torch, json.loads((source / "config.json").read_text()).get("dtype") or "float32")
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    for p in source.iterdir():
        if p.is_file() and not (out / p.name).exists() and not p.name.endswith((".safetensors", ".bin")):
            shutil.copy2(p, out / p.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.export.training.distill_draft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=Path("models/demo-draft"), help="the draft checkpoint to distil")
    ap.add_argument("--windows", type=Path, required=True,
                    help="train_attn_head's --work folder: its cached windows with the target's greedy choices")
    ap.add_argument("--key", default=None, help="which windows, where the folder holds several runs'")
    ap.add_argument("--out", type=Path, required=True, help="the distilled checkpoint folder")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quiet", action="store_true")
    for f, v in asdict(DistillConfig()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)
    import torch
    import transformers
    try:
        cfg = DistillConfig(**{f: getattr(args, f) for f in asdict(DistillConfig())})
        if not (args.draft / "config.json").is_file():
            raise ValueError(f"{args.draft}: no config.json (expected a draft checkpoint folder)")
        train_p, val_p, key = window_blocks(args.windows, args.key)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        data, val = load_blocks(train_p), load_blocks(val_p)
        if int(data["ids"].max()) >= model.config.vocab_size:
            raise ValueError(f"{args.windows}: windows hold id {int(data['ids'].max())}, the draft's vocabulary has "
                             f"{model.config.vocab_size} (windows of another target's tokenizer?)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t0 = time.time()
    before = {"train_agreement": agreement(greedy_table(model, data["ids"]), data["greedy"]),
              "acceptance_by_position": acceptance(greedy_table(model, val["ids"]), val, cfg.chain)}
    fit = distil(model, data, cfg, not args.quiet)
    after = {"train_agreement": agreement(greedy_table(model, data["ids"]), data["greedy"]),
             "acceptance_by_position": acceptance(greedy_table(model, val["ids"]), val, cfg.chain)}
    for r in (before, after):
        r["tokens_per_round_by_gamma"] = tokens_per_round(r["acceptance_by_position"])
    save(model, args.draft, args.out)
    meta = {"command": "python -m edgespec.export.training.distill_draft "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "draft": str(args.draft), "windows": str(args.windows), "key": key, "config": asdict(cfg), "fit": fit,
            "train_windows": int(len(data["ids"])), "validation_windows": int(len(val["ids"])),
            "before": before, "after": after, "minutes": round((time.time() - t0) / 60, 1)}
    (args.out / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: meta[k] for k in ("before", "after")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

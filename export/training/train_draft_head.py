"""Distil a draft head for the bundled VLA policy: a tiny MLP that proposes action tokens from the encoder's
prefix and the ids already emitted, trained on the exported target's own greedy chunks, which
robots/demos.py collects (this module never runs the simulator).

    python -m edgespec.robots.demos on-policy --policy engines/vla-reacher --work .cache/vla --episodes 4000
    python -m edgespec.export.training.train_draft_head --policy engines/vla-reacher --out models/vla-reacher \
        --data .cache/vla/draft-head-data-KEY-*.npz      # the files the first command printed

Why a head and not only the 1-layer draft decoder: on a CPU a decoder call costs about the same whatever its
size (mostly per-node overhead), so a transformer draft costs a large share of a target step per token; the
head (edgespec/draft_head.py, numpy) costs a small fraction of one and sees exactly what the draft decoder
sees.

1. Data (robots/demos.py on-policy): the exported target policy (ONNX Runtime, plain greedy decoding: the
   ids speculative decoding must reproduce) acts in fresh episodes (seeds 700000+: not the target's
   training seeds, nor the evaluation seeds 900000+); half execute its first action with Gaussian noise.
   Every step records the prefix (P, E) and the chunk's H*D ids.
2. Head (the runtime's formula, DraftHeadWeights): per chunk, ctx = W_ctx . flatten(prefix); per token
   position t, h = relu(ctx + pos[t] + prev[id(t-1)] + same[id(t-D)] + vel[clip(id(t-D) - id(t-2D))]
   + other_vel[...]), h2 = relu(W_2 h), then either absolute logits over the bins (first step, t < D) or
   logits over a step of -R..R bins from id(t-D) (later steps). Cross-entropy on the target's ids
   (teacher forcing), 90/10 split by episode; reports held-out agreement with the target per position.
3. Writes OUT/draft_head.npz (float32 weights + config) and OUT/draft_head.json (training report).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SEED = 11


# ---------------------------------------------------------------------------------------------------
# data: the target's own greedy chunks on its own state distribution (written by robots/demos.py)
# ---------------------------------------------------------------------------------------------------
DATA_KEYS = ("prefix", "ids", "episode")


def load_data(paths: list[Path], prefix_len: int, n_tokens: int, n_ids: int) -> dict:
    """On-policy blocks (robots/demos.py) -> one dict of prefix (N, P, E) float16, ids (N, H*D), episode (N,)."""
    if not paths:
        raise ValueError("no --data files (write them with `python -m edgespec.robots.demos on-policy`)")
    blocks = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such data file (write it with `python -m edgespec.robots.demos "
                                    f"on-policy`)")
        with np.load(path) as f:
            missing = [k for k in DATA_KEYS if k not in f.files]
            if missing:
                raise ValueError(f"{path} is not on-policy draft head data (robots/demos.py): missing {missing}")
            blocks.append({k: f[k] for k in DATA_KEYS})
    blocks.sort(key=lambda b: int(b["episode"][0]))  # seed order, whatever order the files came in
    data = {k: np.concatenate([b[k] for b in blocks]) for k in DATA_KEYS}
    p, t, lo, hi = data["prefix"].shape[1], data["ids"].shape[1], data["ids"].min(), data["ids"].max()
    if (p, t) != (prefix_len, n_tokens) or lo < 0 or hi >= n_ids:
        raise ValueError(f"the data has {p} prefix rows and {t} ids per chunk in {lo}..{hi}; the policy has "
                         f"{prefix_len} and {n_tokens} in 0..{n_ids - 1}: the data comes from another policy")
    return data


# ---------------------------------------------------------------------------------------------------
# the head, in torch (training); edgespec/draft_head.py computes the same in numpy
# ---------------------------------------------------------------------------------------------------
def build_head(prefix_len: int, embed: int, n_ids: int, horizon: int, dims: int, hidden: int, radius: int):
    import torch
    from torch import nn

    from edgespec.draft_head import head_features

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ctx = nn.Linear(prefix_len * embed, hidden)
            self.pos = nn.Embedding(horizon * dims, hidden)
            self.prev = nn.Embedding(n_ids + 1, hidden)  # + start
            self.same = nn.Embedding(n_ids + 1, hidden)
            self.vel = nn.Embedding(2 * radius + 2, hidden)  # -R..R, + none
            self.other_vel = nn.Embedding(2 * radius + 2, hidden)
            self.fc2 = nn.Linear(hidden, hidden)
            self.abs_out = nn.Linear(hidden, n_ids)
            self.rel_out = nn.Linear(hidden, 2 * radius + 1)

        def forward(self, prefix, ids):
            """prefix (B, P, E), ids (B, T) teacher-forced -> abs logits (B, D, n_ids), rel logits (B, T-D, 2R+1)."""
            f = head_features(ids.numpy(), dims, n_ids, radius)  # dict of (B, T) int arrays
            ctx = self.ctx(prefix.flatten(1))[:, None]  # (B, 1, H)
            x = ctx + self.pos.weight[None] + sum(getattr(self, k)(torch.from_numpy(v)) for k, v in f.items())
            h = torch.relu(self.fc2(torch.relu(x)))
            return self.abs_out(h[:, :dims]), self.rel_out(h[:, dims:])

    return Head()


def targets(ids: np.ndarray, dims: int, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """-> absolute targets (B, D) and step targets (B, T-D) in 0..2R (-100 = outside the head's reach)."""
    step = ids[:, dims:] - ids[:, :-dims]
    rel = np.where(np.abs(step) <= radius, step + radius, -100)
    return ids[:, :dims], rel


def agreement(head, prefix, ids, dims: int, radius: int, n_ids: int) -> np.ndarray:
    """Teacher-forced per-position agreement with the target's ids -> (T,), of the argmax the runtime takes
    (DraftHead.next: among the steps that land on a bin)."""
    import torch
    with torch.no_grad():
        la, lr = head(torch.from_numpy(prefix.astype(np.float32)), torch.from_numpy(ids))
    base = ids[:, :-dims]  # (B, T-D): the id each step starts from
    land = base[:, :, None] + np.arange(-radius, radius + 1)  # (B, T-D, 2R+1)
    rel = np.where((land >= 0) & (land < n_ids), lr.numpy(), -np.inf)
    pred = np.concatenate([la.argmax(-1).numpy(), base + rel.argmax(-1) - radius], 1)
    return (pred == ids).mean(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="engines/vla-reacher", help="exported policy folder the head drafts for")
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help="on-policy data files of that policy (python -m edgespec.robots.demos on-policy)")
    ap.add_argument("--out", default="models/vla-reacher")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--radius", type=int, default=40, help="largest step (bins) the head can propose")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from edgespec.draft_head import DraftHeadWeights

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    policy_dir, out = Path(args.policy), Path(args.out)
    meta = json.loads((policy_dir / "policy.json").read_text())
    dims, horizon, n_ids = int(meta["dims"]), int(meta["horizon"]), int(meta["n_bins"])
    if int(meta["vocab_end"]) != n_ids:
        raise ValueError("the draft head supports the native action id space (ids 0..n_bins-1) only")
    t_start = time.time()
    try:
        data = load_data(args.data, int(meta["prefix_len"]), horizon * dims, n_ids)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    prefix, ids = data["prefix"], data["ids"]
    n, p, e = prefix.shape
    eps = np.unique(data["episode"])
    val_eps = set(np.random.default_rng(SEED).choice(eps, max(1, len(eps) // 10), replace=False).tolist())
    is_val = np.array([x in val_eps for x in data["episode"]])
    tr, va = np.nonzero(~is_val)[0], np.nonzero(is_val)[0]
    print(f"{n} chunks ({len(tr)} train, {len(va)} held out), prefix {p}x{e}", flush=True)
    head = build_head(p, e, n_ids, horizon, dims, args.hidden, args.radius)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * (len(tr) // args.batch)
    rng, step, history = np.random.default_rng(SEED), 0, []
    for epoch in range(args.epochs):
        head.train()
        order = rng.permutation(tr)
        t0 = time.time()
        for i in range(len(tr) // args.batch):
            idx = np.sort(order[i * args.batch:(i + 1) * args.batch])
            lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + np.cos(np.pi * step / steps))
            for g in opt.param_groups:
                g["lr"] = lr
            ta, trl = targets(ids[idx], dims, args.radius)
            la, lr_ = head(torch.from_numpy(prefix[idx].astype(np.float32)), torch.from_numpy(ids[idx]))
            loss = F.cross_entropy(la.reshape(-1, n_ids), torch.from_numpy(ta).reshape(-1)) * dims + \
                F.cross_entropy(lr_.reshape(-1, 2 * args.radius + 1), torch.from_numpy(trl).reshape(-1),
                                ignore_index=-100) * (ids.shape[1] - dims)
            loss = loss / ids.shape[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        head.eval()
        acc = agreement(head, prefix[va], ids[va], dims, args.radius, n_ids)
        history.append({"epoch": epoch + 1, "loss": round(loss.item(), 4), "val_agree": round(float(acc.mean()), 4),
                        "epoch_s": round(time.time() - t0, 1)})
        print(history[-1], "per position", np.round(acc, 2).tolist(), flush=True)
    weights = DraftHeadWeights.from_torch(head, dims=dims, horizon=horizon, radius=args.radius)
    out.mkdir(parents=True, exist_ok=True)
    weights.save(out / "draft_head.npz")
    report = {"chunks": int(n), "train": int(len(tr)), "held_out": int(len(va)), "episodes": int(len(eps)),
              "data": [str(p) for p in args.data],
              "params": int(sum(x.numel() for x in head.parameters())), "history": history,
              "held_out_agreement_per_position": [round(float(a), 4) for a in acc],
              "wall_s": round(time.time() - t_start, 1),
              "command": "python -m edgespec.export.training.train_draft_head " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])}
    (out / "draft_head.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}/draft_head.npz", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

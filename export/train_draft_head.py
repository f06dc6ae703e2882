"""Distil a draft head for the bundled VLA policy: a tiny MLP that proposes action tokens from the encoder's
prefix and the ids already emitted, trained on the exported target's own greedy chunks.

    python -m edgespec.export.train_draft_head --policy engines/vla-reacher --out models/vla-reacher
        # on 2 CPU cores: ~20 min for 4000 on-policy episodes through the runtime (cached in blocks of 500,
        # so an interrupted run resumes), then ~5 min of training

Why a head and not only the 1-layer draft decoder: on this CPU a decoder call costs about the same whatever
its size (0.11 ms for the 1-layer draft, 0.45 ms for the 4-layer target, both mostly per-node overhead), so
a transformer draft costs a quarter of the target per token and 16 draft calls per chunk eat the gain. The
head costs ~0.02 ms a token in numpy (edgespec/draft_head.py) and sees exactly what the draft decoder sees.

1. Data: the exported target policy (ONNX Runtime, plain greedy decoding: the ids speculative decoding must
   reproduce) acts in --episodes fresh episodes (seeds 700000+: not the target's training seeds, nor the
   benches' evaluation seeds 900000+ / 950000+);
   half execute its first action with Gaussian noise. Every step records the prefix (P, E) and the chunk's
   H*D ids. Cached in --work; rerunning reuses it.
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
import os
import sys
import time
from pathlib import Path

import numpy as np

SEED = 11


# ---------------------------------------------------------------------------------------------------
# data: the target's own greedy chunks on its own state distribution
# ---------------------------------------------------------------------------------------------------
def _collect(args) -> dict:
    policy_dir, seeds, noise_std = args
    os.environ.setdefault("MUJOCO_GL", "osmesa")
    from edgespec.policy import load_policy
    from edgespec.robots.reacher import ThreeTargetReacher
    pol = load_policy(policy_dir)
    env = ThreeTargetReacher()
    prefixes, ids, episode, states = [], [], [], []
    try:
        for seed in seeds:
            obs, done = env.reset(seed=int(seed)), False
            rng = np.random.default_rng(int(seed) + 10_000)
            noisy = seed % 2 == 0
            while not done:
                pre = pol.encode(obs["image"], obs["state"], obs["instruction"])  # (1, P, E)
                chunk_ids, _ = pol.decode_ids(pre, use_draft=False)
                prefixes.append(pre[0].astype(np.float16))
                ids.append(chunk_ids)
                episode.append(int(seed))
                states.append(obs["state"].astype(np.float32))
                a = pol.tok.decode_chunk(np.asarray(chunk_ids), pol.horizon, pol.dims)[0]
                if noisy:
                    a = a + rng.normal(0, noise_std, a.shape)
                obs, _, done, _ = env.step(a)
    finally:
        env.close()
    return {"prefix": np.stack(prefixes), "ids": np.asarray(ids, np.int64), "episode": np.asarray(episode),
            "state": np.stack(states)}


BLOCK = 500  # episodes per cached data file


def policy_key(policy_dir: Path) -> str:
    """12 hex digits naming the exported encoder + target, the two things the data depends on: cached
    blocks from another policy (a retrained target) are never reused."""
    import hashlib

    from edgespec.contract import file_sha256
    meta = json.loads((policy_dir / "policy.json").read_text())
    target = json.loads((policy_dir / "target" / "engine.json").read_text())
    enc = meta.get("encoder_sha256") or file_sha256(policy_dir / meta.get("encoder_file", "encoder.onnx"))
    tgt = file_sha256(policy_dir / "target" / target["model_file"])
    return hashlib.sha256(f"{enc}:{tgt}".encode()).hexdigest()[:12]


def collect(policy_dir: Path, work: Path, episodes: int, workers: int = 2, noise_std: float = 0.01) -> dict:
    """Episodes in blocks of BLOCK (seeds 700000 + ...), each cached in `work` under the policy's key: a
    larger --episodes reuses the blocks already there."""
    from multiprocessing import get_context
    if episodes % BLOCK:
        raise ValueError(f"--episodes must be a multiple of {BLOCK}, got {episodes}")
    blocks, t0, key = [], time.time(), policy_key(policy_dir)
    for b in range(episodes // BLOCK):
        path = work / f"draft-head-data-{key}-{700_000 + b * BLOCK}-{BLOCK}.npz"
        if not path.exists():
            seeds = np.arange(700_000 + b * BLOCK, 700_000 + (b + 1) * BLOCK)
            with get_context("spawn").Pool(workers) as pool:
                outs = list(pool.imap(_collect, [(str(policy_dir), p, noise_std)
                                                 for p in np.array_split(seeds, workers * 2)]))
            work.mkdir(parents=True, exist_ok=True)
            np.savez(path, **{k: np.concatenate([o[k] for o in outs]) for k in outs[0]})
        blocks.append(dict(np.load(path)))
        print(f"[data] {b + 1}/{episodes // BLOCK} blocks of {BLOCK} episodes, "
              f"{sum(len(x['ids']) for x in blocks)} chunks, {time.time() - t0:.0f}s", flush=True)
    return {k: np.concatenate([x[k] for x in blocks]) for k in blocks[0]}


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
    ap.add_argument("--policy", default="engines/vla-reacher", help="exported policy folder (its target)")
    ap.add_argument("--out", default="models/vla-reacher")
    ap.add_argument("--work", default=".cache/vla")
    ap.add_argument("--episodes", type=int, default=4000)
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
    policy_dir, out, work = Path(args.policy), Path(args.out), Path(args.work)
    meta = json.loads((policy_dir / "policy.json").read_text())
    dims, horizon, n_ids = int(meta["dims"]), int(meta["horizon"]), int(meta["n_bins"])
    if int(meta["vocab_end"]) != n_ids:
        raise ValueError("the draft head supports the native action id space (ids 0..n_bins-1) only")
    t_start = time.time()
    data = collect(policy_dir, work, args.episodes)
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
    report = {"chunks": int(n), "train": int(len(tr)), "held_out": int(len(va)), "episodes": args.episodes,
              "params": int(sum(x.numel() for x in head.parameters())), "history": history,
              "held_out_agreement_per_position": [round(float(a), 4) for a in acc],
              "wall_s": round(time.time() - t_start, 1),
              "command": "python -m edgespec.export.train_draft_head " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])}
    (out / "draft_head.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}/draft_head.npz", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

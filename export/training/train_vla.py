"""Train the bundled tiny VLA pair on the three-target MuJoCo reacher by behaviour cloning, from the expert
demonstrations robots/demos.py writes (this module never runs the simulator).

    python -m edgespec.robots.demos expert --work .cache/vla --episodes 6000 --val-episodes 100
    python -m edgespec.export.training.train_vla --train .cache/vla/expert-train-6000.npz \
        --val .cache/vla/expert-val-100.npz --out models/vla-reacher      # resumable
    edgespec export-policy models/vla-reacher --out engines/vla-reacher
    python -m edgespec.robots.demos eval --policy engines/vla-reacher --episodes 50   # closed-loop success

1. Data: the scripted expert's episodes (robots/demos.py): half of them execute the expert's action with
   Gaussian noise (DART-style, so the data covers recoveries) while the label is always the clean expert
   chunk from the state actually reached.
2. Model: an encoder (CNN with coordinate channels, FiLM-conditioned on the instruction, spatial-softmax
   keypoints -> image tokens; a goal token from the estimated (x, y) of the named target, trained with an
   auxiliary regression loss; a state token; instruction word tokens) makes P prefix embeddings; a Llama
   target decoder emits the H x D action tokens after them (native id space 0..255, OpenVLA binning);
   a 1-layer draft decoder reads the same (detached) prefix and is trained with CE + KL to the target.
3. Writes OUT/{policy.json, action_stats.json, encoder.safetensors (fp16), target/, draft/ (HF Llama
   folders, fp16), train.json (losses and token accuracy on the validation episodes)}.

Checkpoints go to --work every epoch; rerunning the command resumes.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..vla_model import SEED, Pair, VLAConfig, save, words_to_ids

# ---------------------------------------------------------------------------------------------------
# demonstrations (written by robots/demos.py)
# ---------------------------------------------------------------------------------------------------
DEMO_KEYS = ("image", "state", "instruction", "chunk", "goal", "episode")


def load_demos(path: Path, instr_len: int) -> dict:
    """An expert demonstrations file -> its arrays, with the instructions as word ids instr (N, L) int64."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no demonstrations file (write it with `python -m edgespec.robots.demos "
                                f"expert`, see this module's docstring)")
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    missing = [k for k in DEMO_KEYS if k not in data]
    if missing:
        raise ValueError(f"{path} is not an expert demonstrations file (robots/demos.py): missing {missing}")
    words, inverse = np.unique(data["instruction"], return_inverse=True)
    data["instr"] = np.stack([words_to_ids(str(w), instr_len) for w in words])[inverse.reshape(-1)]
    return data


def to_torch(data: dict, idx: np.ndarray) -> dict:
    import torch
    out = {"image": torch.from_numpy(data["image"][idx]), "state": torch.from_numpy(data["state"][idx]),
           "instr": torch.from_numpy(data["instr"][idx])}
    if "goal" in data:
        out["goal"] = torch.from_numpy(data["goal"][idx])
    return out


IGNORE = -100  # a FAST chunk's positions after its END: no loss


def fast_ids(fast, chunks: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Normalised chunks (N, H, D) -> ids (N, max_tokens), each chunk's FAST tokens + END, padded with END, and
    labels: the same with IGNORE after the END. A chunk longer than max_tokens is an error naming it."""
    ids = np.full((len(chunks), max_tokens), fast.end_id, np.int64)
    labels = np.full((len(chunks), max_tokens), IGNORE, np.int64)
    for i, c in enumerate(chunks):
        t = fast.encode(c) + [fast.end_id]
        if len(t) > max_tokens:
            raise ValueError(f"chunk {i} takes {len(t)} FAST tokens with END; the policy allows {max_tokens}")
        ids[i, :len(t)] = labels[i, :len(t)] = t
    return ids, labels


def losses(pair: Pair, batch, ids, labels=None):
    """labels: ids with IGNORE where no loss is taken (FAST padding); None: ids."""
    import torch.nn.functional as F
    lt, ld, goal = pair.logits(batch, ids)
    v = lt.shape[-1]
    labels = ids if labels is None else labels
    ce_t = F.cross_entropy(lt.reshape(-1, v), labels.reshape(-1), ignore_index=IGNORE)
    ce_d = F.cross_entropy(ld.reshape(-1, v), labels.reshape(-1), ignore_index=IGNORE)
    valid = (labels != IGNORE).float()  # (B, T)
    kl_pos = F.kl_div(F.log_softmax(ld, -1), F.log_softmax(lt.detach(), -1), log_target=True,
                      reduction="none").sum(-1)  # (B, T)
    kl = (kl_pos * valid).sum() / valid.sum().clamp(min=1.0)
    aux = F.mse_loss(goal * 5.0, batch["goal"] * 5.0) if "goal" in batch else goal.sum() * 0.0
    return ce_t, ce_d, kl, aux, lt, ld


def evaluate(pair: Pair, data: dict, ids_all: np.ndarray, labels_all: np.ndarray | None = None) -> dict:
    """Losses and token accuracy (over the positions with a label) on the validation chunks."""
    import torch
    n = len(ids_all)
    labels_all = ids_all if labels_all is None else labels_all
    tot = {"target_ce": 0.0, "draft_ce": 0.0, "target_acc": 0.0, "draft_acc": 0.0, "agree": 0.0, "goal_err_m": 0.0}
    with torch.no_grad():
        for s in range(0, n, 512):
            idx = np.arange(s, min(n, s + 512))
            ids, labels = torch.from_numpy(ids_all[idx]), torch.from_numpy(labels_all[idx])
            ce_t, ce_d, _, aux, lt, ld = losses(pair, to_torch(data, idx), ids, labels)
            w = len(idx) / n
            valid = labels != IGNORE
            tot["goal_err_m"] += aux.sqrt().item() / 5.0 * w
            tot["target_ce"] += ce_t.item() * w
            tot["draft_ce"] += ce_d.item() * w
            tot["target_acc"] += (lt.argmax(-1) == labels)[valid].float().mean().item() * w
            tot["draft_acc"] += (ld.argmax(-1) == labels)[valid].float().mean().item() * w
            tot["agree"] += (lt.argmax(-1) == ld.argmax(-1))[valid].float().mean().item() * w
    return {k: round(v, 4) for k, v in tot.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, default=Path(".cache/vla/expert-train-6000.npz"),
                    help="expert demonstrations to train on (python -m edgespec.robots.demos expert)")
    ap.add_argument("--val", type=Path, default=Path(".cache/vla/expert-val-100.npz"),
                    help="expert demonstrations for the per-epoch validation losses")
    ap.add_argument("--out", default="models/vla-reacher")
    ap.add_argument("--work", default=".cache/vla", help="checkpoints (resume)")
    ap.add_argument("--epochs", type=int, default=VLAConfig.epochs)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--actions", choices=["bins", "fast"], default="bins",
                    help="action tokens: 256 bins per dimension (OpenVLA's), or FAST (DCT + BPE, variable length)")
    ap.add_argument("--fast-scale", type=float, default=VLAConfig.fast_scale,
                    help="FAST: DCT coefficients x scale, rounded (error bound 0.5 sqrt(H) / scale, normalised)")
    ap.add_argument("--fast-vocab", type=int, default=1024, help="FAST: the BPE vocabulary's size (END included)")
    args = ap.parse_args(argv)
    import torch
    from edgespec.actions import ActionStats, ActionTokenizer

    torch.set_num_threads(args.threads)
    try:
        train, val = load_demos(args.train, VLAConfig.instr_len), load_demos(args.val, VLAConfig.instr_len)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    _, horizon, dims = train["chunk"].shape
    cfg = VLAConfig(episodes=len(np.unique(train["episode"])), val_episodes=len(np.unique(val["episode"])),
                    horizon=horizon, dims=dims, image_size=train["image"].shape[1],
                    noise_std=float(train["noise_std"]), epochs=args.epochs, actions=args.actions,
                    fast_scale=args.fast_scale)
    if val["chunk"].shape[1:] != train["chunk"].shape[1:] or val["image"].shape[1:] != train["image"].shape[1:]:
        raise ValueError(f"{args.val} has chunks {val['chunk'].shape[1:]} and images {val['image'].shape[1:]}; "
                         f"{args.train} has {train['chunk'].shape[1:]} and {train['image'].shape[1:]}")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    flat = train["chunk"].reshape(-1, cfg.dims)
    stats = ActionStats(np.quantile(flat, 0.01, axis=0), np.quantile(flat, 0.99, axis=0))
    fast = fit = None
    if cfg.actions == "bins":
        tok = ActionTokenizer.native(cfg.n_bins, stats)
        ids_train = tok.encode(train["chunk"]).reshape(len(train["chunk"]), -1)  # (N, H*D) time-major
        ids_val = tok.encode(val["chunk"]).reshape(len(val["chunk"]), -1)
        labels_train, labels_val = ids_train, ids_val
    else:  # FAST: fitted on the training chunks, normalised by the same statistics
        from edgespec.fast_tokens import FastTokenizer
        norm_train, norm_val = stats.normalize(train["chunk"]), stats.normalize(val["chunk"])
        fast, fit = FastTokenizer.fit(norm_train, scale=cfg.fast_scale, vocab_size=args.fast_vocab)
        cfg.n_bins, cfg.max_tokens = fast.vocab_size, fit.tokens_per_chunk_max + 1
        print(f"FAST: {fit.tokens_per_chunk_mean:.2f} tokens per chunk (max {fit.tokens_per_chunk_max}), max |error| "
              f"{fit.max_abs_error:.4f} normalised (bound {fit.error_bound:.4f}), vocabulary {fast.vocab_size}",
              flush=True)
        ids_train, labels_train = fast_ids(fast, norm_train, cfg.max_tokens)
        ids_val, labels_val = fast_ids(fast, norm_val, cfg.max_tokens)
    print(f"train {len(ids_train)} samples, val {len(ids_val)}; stats q01 {stats.q01} q99 {stats.q99}", flush=True)

    pair = Pair(cfg)
    params = [p for m in pair.modules().values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.05)
    steps_per_epoch = len(ids_train) // cfg.batch
    total = steps_per_epoch * cfg.epochs
    ckpt = work / "ckpt.pt"
    epoch0, history = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        for k, m in pair.modules().items():
            m.load_state_dict(state[k])
        opt.load_state_dict(state["opt"])
        epoch0, history = state["epoch"], state["history"]
        print(f"resumed after epoch {epoch0}", flush=True)
    for epoch in range(epoch0, cfg.epochs):
        for m in pair.modules().values():
            m.train()
        order = np.random.default_rng(SEED + epoch).permutation(len(ids_train))
        t0 = time.time()
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i
            lr = cfg.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * step / total))
            for g in opt.param_groups:
                g["lr"] = lr
            idx = np.sort(order[i * cfg.batch:(i + 1) * cfg.batch])
            ids, labels = torch.from_numpy(ids_train[idx]), torch.from_numpy(labels_train[idx])
            ce_t, ce_d, kl, aux, _, _ = losses(pair, to_torch(train, idx), ids, labels)
            loss = ce_t + 0.5 * ce_d + 0.5 * kl + 10.0 * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if i % 50 == 0:
                print(f"epoch {epoch} step {i}/{steps_per_epoch} ce_t {ce_t.item():.3f} ce_d {ce_d.item():.3f} "
                      f"goal_err {aux.sqrt().item() / 5:.4f} m "
                      f"kl {kl.item():.3f} lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
        for m in pair.modules().values():
            m.eval()
        ev = evaluate(pair, val, ids_val, labels_val)
        ev["epoch"], ev["epoch_s"] = epoch + 1, round(time.time() - t0, 1)
        history.append(ev)
        print("val", ev, flush=True)
        torch.save({**{k: m.state_dict() for k, m in pair.modules().items()}, "opt": opt.state_dict(),
                    "epoch": epoch + 1, "history": history}, ckpt)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in pair.modules().items()}
    report = {"params": n_params, "history": history, "train_samples": int(len(ids_train)),
              "data": {"train": str(args.train), "val": str(args.val)}, "wall_s": round(time.time() - t_start, 1),
              "fast_fit": None if fit is None else {k: (list(v) if isinstance(v, tuple) else v)
                                                    for k, v in asdict(fit).items()},
              "command": "python -m edgespec.export.training.train_vla " + " ".join(argv if argv is not None
                                                                            else sys.argv[1:])}
    save(pair, cfg, stats, out, report, fast)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train an OpenVLA-format policy on the three-target MuJoCo reacher by behaviour cloning, and save it in OpenVLA's
checkpoint layout (export/prismatic.py), so the OpenVLA import runs on a model with real acceptance.

    python -m edgespec.export.training.train_openvla --train .cache/vla/expert-train-6000.npz \
        --val .cache/vla/expert-val-100.npz --out .cache/openvla-reacher/model      # resumable (--work)
    edgespec export-policy .cache/openvla-reacher/model/target --out engines/openvla-reacher --horizon 8 \
        --draft .cache/openvla-reacher/model/draft --action-names fingertip.x,fingertip.y --action-units m,m \
        --action-kind cartesian_position

What OpenVLA does, at the reacher's size: no state input (the arm is seen in the image), the prompt
"In: What action should the robot take to {instruction}?\nOut:" with "▁" appended, the image rows after BOS, actions
as the last 256 ids below vocab_size - 64. The model: one IN1k-style ViT (vit_large_patch16_224's layout: class
token, positions over class + patches) at the reacher's 64 x 64 px, 16 px patches (16 image rows; the config's
image_sizes says 64, where OpenVLA's own classes would build 224), the 2-layer GELU projector, a Llama of the bundled
target's size (4 layers, width 256). A chunk (H=8 steps x D=2 fingertip targets) is 16 action tokens; norm_stats hold
the per-dimension q01/q99 repeated per step (16 values), so OpenVLA's predict_action would decode the same 16 tokens,
and `--horizon 8` exports them as 8 x 2. Training only: an auxiliary linear head regresses the state and the named
target's position from the mean image row (not saved). A 1-layer draft decoder of the same width reads the same
(detached) prefix and the target's embeddings of the action ids, trained with cross-entropy + KL to the target (like
train_vla.py), saved as draft/ with the target's embedding table (what it was trained to read).

Writes OUT/target (the OpenVLA-layout checkpoint: config.json, model.safetensors, preprocessor_config.json,
tokenizer.json), OUT/draft (an HF Llama folder) and OUT/train.json. Checkpoints go to --work; rerunning resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .train_vla import load_demos

SEED = 11
CHUNK_SCALE = (math.pi, math.pi, 10.0, 10.0, 0.2, 0.2)  # the state's scale for the auxiliary target (vla_model's)


HEAD_HIDDEN, HEAD_RADIUS = 384, 40


def train_head(model, prefixes_of, data, acts, prompts, val, acts_val, prompts_val, buckets, first_id: int,
               n_bins: int, horizon: int, dims: int, steps: int):
    """The draft head, distilled from the trained (frozen) target: its context is the target's final hidden state
    at the prompt's last position (1 x E: what the runtime reads from the target's prefill), its labels the target's
    teacher-forced choices over the demonstration chunks. -> (the torch head, a report with held-out agreement)."""
    import torch
    import torch.nn.functional as F

    from .train_draft_head import agreement, build_head, targets

    head = build_head(1, model.language_model.config.hidden_size, n_bins, horizon, dims, HEAD_HIDDEN, HEAD_RADIUS)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3, weight_decay=0.01)
    table = model.language_model.get_input_embeddings()

    def features(d, a_all, pr, idx):  # -> h (B, 1, E), the target's teacher-forced ids (B, T) in 0..n_bins-1
        with torch.no_grad():
            a = torch.from_numpy(a_all[idx])
            prefix, _ = prefixes_of(d, pr, idx)
            p, t = prefix.shape[1], a.shape[1]
            out = model.language_model(inputs_embeds=torch.cat([prefix, table(a[:, :-1])], 1), output_hidden_states=True)
            tf = out.logits[:, p - 1:p - 1 + t, first_id:first_id + n_bins].argmax(-1)
            return out.hidden_states[-1][:, p - 1:p], tf.numpy()

    order = [b for e in range(8) for b in buckets(prompts, 100 + e)]
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 2e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        h, ids = features(data, acts, prompts, order[step % len(order)])
        ta, trl = targets(ids, dims, HEAD_RADIUS)
        la, lr_ = head(h, torch.from_numpy(ids))
        loss = (F.cross_entropy(la.reshape(-1, n_bins), torch.from_numpy(ta).reshape(-1)) * dims +
                F.cross_entropy(lr_.reshape(-1, 2 * HEAD_RADIUS + 1), torch.from_numpy(trl).reshape(-1),
                                ignore_index=-100) * (ids.shape[1] - dims)) / ids.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"head step {step}/{steps} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)
    head.eval()
    accs = []
    for idx in buckets(prompts_val, 0):
        h, ids = features(val, acts_val, prompts_val, idx)
        accs.append(agreement(head, h.numpy(), ids, dims, HEAD_RADIUS, n_bins))
    acc = np.mean(accs, 0)
    print("head held-out agreement per position", np.round(acc, 2).tolist(), flush=True)
    return head, {"steps": steps, "context": "target final hidden state at the prompt's last position",
                  "held_out_agreement": round(float(acc.mean()), 4),
                  "held_out_agreement_per_position": [round(float(x), 4) for x in acc]}


def model_config(stats_q01, stats_q99, horizon: int):
    from ..openvla_ckpt import TinyOpenVLA
    q01, q99 = np.tile(stats_q01, horizon).tolist(), np.tile(stats_q99, horizon).tolist()
    stats = {"reacher": {"action": {"q01": q01, "q99": q99, "mask": [True] * len(q01)},
                         "proprio": {}, "num_transitions": 0, "num_trajectories": 0}}
    return TinyOpenVLA(backbone="in1k-vit-l", vit_dims=(128,), vit_depth=4, image_size=64, hidden=256, layers=4,
                       heads=4, kv_heads=4, inter=512, max_positions=128, norm_stats=stats, seed=SEED)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, default=Path(".cache/vla/expert-train-6000.npz"))
    ap.add_argument("--val", type=Path, default=Path(".cache/vla/expert-val-100.npz"))
    ap.add_argument("--out", type=Path, default=Path(".cache/openvla-reacher/model"))
    ap.add_argument("--work", type=Path, default=Path(".cache/openvla-reacher/work"))
    ap.add_argument("--steps", type=int, default=1875, help="optimiser steps (one epoch of 6000 episodes: 1875)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head-steps", type=int, default=600, help="draft-head distillation steps after training")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgespec.actions import ActionStats, ActionTokenizer
    from edgespec.policy_folder import prompt_ids

    from ..openvla_ckpt import text_config, write_checkpoint
    from ..prismatic import EMPTY_PIECE, PROMPTS, build_reference, read_checkpoint

    torch.set_num_threads(args.threads)
    train, val = load_demos(args.train, 6), load_demos(args.val, 6)
    _, horizon, dims = train["chunk"].shape
    flat = train["chunk"].reshape(-1, dims)
    step_stats = ActionStats(np.quantile(flat, 0.01, axis=0), np.quantile(flat, 0.99, axis=0))
    t = model_config(step_stats.q01, step_stats.q99, horizon)
    args.work.mkdir(parents=True, exist_ok=True)
    init = args.work / "init"
    if not (init / "config.json").is_file():
        write_checkpoint(init, t, dtype="float32")
    ck = read_checkpoint(init)
    model = build_reference(ck).train()
    tok = Tokenizer.from_file(str(init / "tokenizer.json"))
    append = tok.token_to_id(EMPTY_PIECE)
    vocab_end, n_bins = ck.vocab_end, ck.n_bins
    atok = ActionTokenizer(vocab_end, n_bins, ActionStats(np.tile(step_stats.q01, horizon),
                                                          np.tile(step_stats.q99, horizon)))

    def ids_of(data):  # (N, H*D) action ids, time-major; prompt ids per sample (lists, bucketed by length)
        acts = atok.encode(data["chunk"].reshape(len(data["chunk"]), -1))
        prompts = {w: prompt_ids(tok, PROMPTS["llama2"], str(w), append) for w in np.unique(data["instruction"])}
        return acts, [prompts[w] for w in data["instruction"]]

    acts_train, prompts_train = ids_of(train)
    acts_val, prompts_val = ids_of(val)
    dcfg = {k: v for k, v in text_config(t).items() if k not in ("model_type", "architectures", "torch_dtype")}
    dcfg.update(num_hidden_layers=1, intermediate_size=256)
    torch.manual_seed(SEED)
    draft = LlamaForCausalLM(LlamaConfig(**dcfg)).train()
    aux = torch.nn.Linear(t.hidden, 8)  # training only: state (6, scaled) + the named target (2, x5)
    params = list(model.parameters()) + list(draft.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05)
    scale = torch.tensor(CHUNK_SCALE, dtype=torch.float32)

    def prefix_of(data, prompts, idx):  # -> prefix (B, P, E), image rows (B, N, E)
        img = torch.from_numpy(data["image"][idx])
        ids = torch.from_numpy(np.stack([prompts[i] for i in idx]))  # one length per batch (bucketed)
        rows = model.image_embeds(img)  # (B, N, E)
        emb = model.language_model.get_input_embeddings()(ids)
        return torch.cat([emb[:, :1], rows, emb[:, 1:]], 1), rows

    def batch_losses(data, acts, prompts, idx):
        a = torch.from_numpy(acts[idx])  # (B, T)
        table = model.language_model.get_input_embeddings()
        prefix, rows = prefix_of(data, prompts, idx)
        x = torch.cat([prefix, table(a[:, :-1])], 1)
        n = a.shape[1]
        lt = model.language_model(inputs_embeds=x).logits[:, -n:, vocab_end - n_bins:vocab_end]
        xd = torch.cat([prefix.detach(), table(a[:, :-1]).detach()], 1)
        ld = draft(inputs_embeds=xd).logits[:, -n:, vocab_end - n_bins:vocab_end]
        y = a - (vocab_end - n_bins)
        ce_t = F.cross_entropy(lt.reshape(-1, n_bins), y.reshape(-1))
        ce_d = F.cross_entropy(ld.reshape(-1, n_bins), y.reshape(-1))
        kl = F.kl_div(F.log_softmax(ld, -1), F.log_softmax(lt.detach(), -1), log_target=True,
                      reduction="none").sum(-1).mean()
        want = torch.cat([torch.from_numpy(data["state"][idx]) / scale, torch.from_numpy(data["goal"][idx]) * 5], 1)
        aux_loss = F.mse_loss(aux(rows.mean(1)), want)
        acc_t = (lt.argmax(-1) == y).float().mean()
        acc_d = (ld.argmax(-1) == y).float().mean()
        agree = (lt.argmax(-1) == ld.argmax(-1)).float().mean()
        return ce_t, ce_d, kl, aux_loss, acc_t, acc_d, agree

    def buckets(prompts, seed):  # batches of one prompt length each, in a shuffled order
        rng = np.random.default_rng(seed)
        lengths = np.array([len(p) for p in prompts])
        out = []
        for n in np.unique(lengths):
            idx = rng.permutation(np.nonzero(lengths == n)[0])
            out += [np.sort(idx[i:i + args.batch]) for i in range(0, len(idx) - args.batch + 1, args.batch)]
        return [out[i] for i in rng.permutation(len(out))]

    ckpt = args.work / "ckpt.pt"
    step0, history = 0, []
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        draft.load_state_dict(st["draft"])
        aux.load_state_dict(st["aux"])
        opt.load_state_dict(st["opt"])
        step0, history = st["step"], st["history"]
        print(f"resumed at step {step0}", flush=True)
    if step0 >= args.steps and (args.out / "train.json").is_file():  # a finished run: its folder stays as it is
        print(f"{args.out}: already trained ({step0} steps; delete {args.work} to train again)", flush=True)
        return 0
    order = [b for e in range(math.ceil(args.steps * args.batch / len(acts_train)) + 1)
             for b in buckets(prompts_train, SEED + e)]
    t0, t_start = time.time(), time.time()

    def save_ckpt(step):
        torch.save({"model": model.state_dict(), "draft": draft.state_dict(), "aux": aux.state_dict(),
                    "opt": opt.state_dict(), "step": step, "history": history}, ckpt)

    for step in range(step0, args.steps):
        lr = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        ce_t, ce_d, kl, aux_loss, acc_t, _, _ = batch_losses(train, acts_train, prompts_train, order[step])
        loss = ce_t + 0.5 * ce_d + 0.5 * kl + 1.0 * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step}/{args.steps} ce_t {ce_t.item():.3f} ce_d {ce_d.item():.3f} kl {kl.item():.3f} "
                  f"aux {aux_loss.item():.4f} acc {acc_t.item():.3f} lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
        if step % 200 == 199:
            save_ckpt(step + 1)
    model.eval(), draft.eval()
    head, head_report = train_head(model, prefixes_of=lambda data, prompts, idx: prefix_of(data, prompts, idx),
                                   data=train, acts=acts_train, prompts=prompts_train, val=val, acts_val=acts_val,
                                   prompts_val=prompts_val, buckets=buckets, first_id=vocab_end - n_bins,
                                   n_bins=n_bins, horizon=horizon, dims=dims, steps=args.head_steps)
    with torch.no_grad():
        tot = np.zeros(7)
        val_batches = buckets(prompts_val, 0)
        for idx in val_batches:
            tot += np.array([float(v) for v in batch_losses(val, acts_val, prompts_val, idx)])
        ev = dict(zip(("target_ce", "draft_ce", "kl", "aux", "target_acc", "draft_acc", "agree"),
                      np.round(tot / len(val_batches), 4).tolist()))
    history.append({"step": args.steps, **ev})
    print("val", ev, flush=True)
    save_ckpt(args.steps)
    # the OpenVLA-layout checkpoint: the random init's files, the trained weights under the same names
    from safetensors.torch import load_file, save_file
    out = args.out / "target"
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(init, out)
    weights = load_file(str(init / "model.safetensors"))
    trained = model.state_dict()
    weights.update({k: v.detach().to(torch.float32).contiguous() for k, v in trained.items() if k in weights})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():  # the draft read the target's embeddings in training (its prefix is the target's too)
        draft.get_input_embeddings().weight.copy_(model.language_model.get_input_embeddings().weight)
    draft.save_pretrained(args.out / "draft", safe_serialization=True)
    from edgespec.draft_head import DraftHeadWeights
    DraftHeadWeights.from_torch(head, dims=dims, horizon=horizon, radius=HEAD_RADIUS).save(args.out / "draft_head.npz")
    report = {"history": history, "draft_head": head_report, "train_samples": int(len(acts_train)),
              "steps": args.steps, "batch": args.batch,
              "params": {"vision+projector": sum(p.numel() for n, p in model.named_parameters()
                                                 if not n.startswith("language_model")),
                         "language_model": sum(p.numel() for p in model.language_model.parameters()),
                         "draft": sum(p.numel() for p in draft.parameters())},
              "wall_s": round(time.time() - t_start, 1),
              "command": "python -m edgespec.export.training.train_openvla " + " ".join(
                  argv if argv is not None else sys.argv[1:])}
    (args.out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

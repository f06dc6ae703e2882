"""Distil the feature-level text draft head (edgespec/text_head.py) from a target checkpoint.

    python -m edgespec.export.training.train_text_head --target models/demo-target --out models/demo-target/text_head.npz

1. Hidden states: the target (the torch reference, which every exported engine matches within its parity
   gate) reads sequences of the demo training corpus (the Python standard library, the split of
   train_demo.py). Its final hidden states and its greedy choices are cached in blocks under --work, so an
   interrupted run resumes.
2. Vocabulary: the head proposes only the K ids the target chooses most often in that data.
3. Training: the head is unrolled `--unroll` steps from each position, feeding its own guessed hidden
   state and the text's next token, with cross-entropy on the target's greedy choice (restricted to the
   head's vocabulary) plus a regression of the guess onto the target's true next hidden state.
4. Validation: position-wise agreement of the head's chained proposals with the target's greedy choices on
   the held-out split, written with the settings to --out's .json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import optimizer_step

SEED = 1234


@dataclass
class HeadConfig:
    hidden: int = 256  # H
    vocab: int = 2048  # K: ids the head can propose
    seq_len: int = 256
    train_seqs: int = 480
    val_seqs: int = 32
    block: int = 16  # sequences per cached block
    unroll: int = 3
    epochs: int = 3
    batch: int = 256
    lr: float = 2e-3
    feature_weight: float = 0.1  # the hidden-state regression's weight beside the cross-entropy

    def __post_init__(self):
        for name, v in asdict(self).items():
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.unroll >= self.seq_len:
            raise ValueError(f"unroll {self.unroll} must be below seq_len {self.seq_len}")


def corpus_windows(tokenizer_path: Path, cfg: HeadConfig) -> tuple[np.ndarray, np.ndarray]:
    """-> (train, val) windows (N, seq_len) of token ids from the demo corpus, drawn with a fixed seed."""
    from tokenizers import Tokenizer

    from .train_demo import TrainConfig, encode_docs, split_corpus
    train_txt, val_txt = split_corpus(TrainConfig())
    tok = Tokenizer.from_file(str(tokenizer_path))
    rng = np.random.default_rng(SEED)
    out = []
    for texts, n in ((train_txt, cfg.train_seqs), (val_txt, cfg.val_seqs)):
        ids = encode_docs(tok, texts)
        starts = rng.integers(0, len(ids) - cfg.seq_len, n)
        out.append(np.stack([ids[s:s + cfg.seq_len] for s in starts]).astype(np.int64))
    return out[0], out[1]


def hidden_blocks(ref, windows: np.ndarray, work: Path, name: str, cfg: HeadConfig, progress: bool) -> list[Path]:
    """Run the target over the windows in blocks, caching (ids, hidden fp16, greedy ids) per block."""
    import torch
    from tqdm import tqdm

    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in tqdm(range(0, len(windows), cfg.block), desc=f"target hidden states ({name})", disable=not progress):
        path = work / f"{name}-{i // cfg.block:04d}.npz"
        ids = windows[i:i + cfg.block]
        if not path.is_file():
            h = ref.hidden(torch.from_numpy(ids))  # (b, T, E)
            greedy = (h @ ref.w["lm_head.weight"].T).argmax(-1)  # (b, T): the target's choice after each position
            tmp = path.with_suffix(".partial.npz")
            np.savez(tmp, ids=ids, hidden=h.numpy().astype(np.float16), greedy=greedy.numpy())
            tmp.replace(path)
        paths.append(path)
    return paths


def load_blocks(paths: list[Path]) -> dict[str, np.ndarray]:
    parts = [np.load(p) for p in paths]
    return {k: np.concatenate([z[k] for z in parts]) for k in ("ids", "hidden", "greedy")}


def build_head(embed: np.ndarray, lm: np.ndarray, vocab: np.ndarray, cfg: HeadConfig):
    import torch

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            e = embed.shape[1]
            self.w_h = torch.nn.Linear(e, cfg.hidden, bias=False)
            self.w_e = torch.nn.Linear(e, cfg.hidden)
            self.w_out = torch.nn.Linear(cfg.hidden, e)
            self.register_buffer("embed", torch.from_numpy(embed))
            self.register_buffer("lm_f", torch.from_numpy(lm[vocab]))  # (K, E)

        def step(self, h, x):  # h (N, E) hidden state that emitted x (N,) -> guessed next hidden (N, E)
            u = torch.nn.functional.silu(self.w_h(h) + self.w_e(self.embed[x]))
            return self.w_out(u)

    return Head()


def train(data: dict, val: dict, embed: np.ndarray, lm: np.ndarray, cfg: HeadConfig, progress: bool,
          vocab: np.ndarray | None = None, report=None):
    """-> (TextHeadWeights, validation report). vocab: the ids the head may propose (None: the cfg.vocab ids the
    target chose most often); report(weights, val) -> the report (None: validate, text windows)."""
    import torch
    from tqdm import tqdm

    from edgespec.text_head import TextHeadWeights

    torch.manual_seed(SEED)
    if vocab is None:
        counts = np.bincount(data["greedy"].reshape(-1), minlength=embed.shape[0])
        vocab = np.sort(np.argsort(-counts, kind="stable")[:cfg.vocab])
    slot = np.full(embed.shape[0], -100, np.int64)  # id -> index in vocab (-100: ignored by the loss)
    slot[vocab] = np.arange(len(vocab))
    head = build_head(embed, lm, vocab, cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    ids = torch.from_numpy(data["ids"])  # (N, T)
    hid = torch.from_numpy(data["hidden"].astype(np.float32))  # (N, T, E)
    # valid (N, T): position t holds a real hidden state and greedy choice (all of a text window; a FAST chunk's
    # positions up to its END); an invalid position is neither a label nor a regression target
    valid = data.get("valid", np.ones(data["ids"].shape, bool))
    labels = np.where(valid, slot[np.where(valid, data["greedy"], 0)], -100)
    lab = torch.from_numpy(labels)  # (N, T) index of the target's choice after t, or -100
    keep = torch.from_numpy(valid.astype(np.float32))  # (N, T)
    n, t = ids.shape
    u = cfg.unroll
    # the head starts from h_j, fed x_{j+1}: where the first guess has a label
    starts = [(i, j) for i in range(n) for j in range(t - u - 1) if valid[i, j + 1]]
    steps = cfg.epochs * (len(starts) // cfg.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=max(steps, 1), pct_start=0.05)
    rng = np.random.default_rng(SEED)
    bar = tqdm(total=steps, desc="train text head", disable=not progress)
    for _ in range(cfg.epochs):
        order = rng.permutation(len(starts))
        for b in range(len(starts) // cfg.batch):
            pick = np.array([starts[k] for k in order[b * cfg.batch:(b + 1) * cfg.batch]])
            si, sj = torch.from_numpy(pick[:, 0]), torch.from_numpy(pick[:, 1])
            g, loss = hid[si, sj], 0.0
            for k in range(u):  # from h_{j+k} (own guess for k > 0), fed x_{j+k+1}: guess h_{j+k+1}
                g = head.step(g, ids[si, sj + k + 1])
                logits = g @ head.lm_f.T
                y, w = lab[si, sj + k + 1], keep[si, sj + k + 1]  # (b,), (b,)
                ce = torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
                loss = loss + ce / (y != -100).sum().clamp(min=1)
                reg = torch.nn.functional.smooth_l1_loss(g, hid[si, sj + k + 1], reduction="none").mean(-1)
                loss = loss + cfg.feature_weight * (reg * w).sum() / w.sum().clamp(min=1)
            optimizer_step(loss, opt, sched, bar, scale=u)
    bar.close()
    sd = {k: v.detach().numpy() for k, v in head.state_dict().items()}
    w = TextHeadWeights(sd["w_h.weight"].T.copy(), sd["w_e.weight"].T.copy(), sd["w_e.bias"].copy(),
                        sd["w_out.weight"].T.copy(), sd["w_out.bias"].copy(), embed, lm[vocab], vocab)
    return w, (report or validate)(w, val)


def validate(w, val: dict, steps: int = 6) -> dict:
    """Chained proposals of the folded numpy head on held-out text: from each position, step k's proposal
    is tried when steps 0..k-1 were kept and the text itself followed the target's greedy choices (so the
    context is the one greedy decoding would have), and kept when it equals the target's greedy choice:
    acceptance by position, as the runtime counts it."""
    from edgespec.text_head import TextHead

    head = TextHead(w)
    ids, hid, greedy = val["ids"], val["hidden"].astype(np.float32), val["greedy"]
    tried, kept = np.zeros(steps), np.zeros(steps)
    for i in range(len(ids)):
        for j in range(0, ids.shape[1] - steps - 2, 3):
            tok, _ = head.first(hid[i, j], int(ids[i, j + 1]))
            for k in range(steps):
                tried[k] += 1
                if tok != greedy[i, j + k + 1]:
                    break
                kept[k] += 1
                if ids[i, j + k + 2] != greedy[i, j + k + 1]:  # the text leaves the greedy path: stop here
                    break
                tok, _ = head.next(int(ids[i, j + k + 2]))
    coverage = float(np.isin(greedy, w.vocab).mean())
    return {"vocab_coverage_of_target_choices": coverage,
            "acceptance_by_position": [round(float(k / t), 4) if t else None for k, t in zip(kept, tried)],
            "tried_by_position": tried.astype(int).tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.export.training.train_text_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"), help="target checkpoint folder")
    ap.add_argument("--out", type=Path, default=Path("models/demo-target/text_head.npz"))
    ap.add_argument("--work", type=Path, default=Path(".cache/text-head"), help="cached hidden-state blocks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quiet", action="store_true")
    for f, v in asdict(HeadConfig()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)
    import torch

    from ..checkpoint import CheckpointError, load_checkpoint
    from ..reference import ReferenceDecoder
    try:
        cfg = HeadConfig(**{f: getattr(args, f) for f in asdict(HeadConfig())})
        spec, weights = load_checkpoint(args.target)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    ref = ReferenceDecoder(spec, weights)
    train_w, val_w = corpus_windows(args.target / "tokenizer.json", cfg)
    key = f"{spec.vocab_size}-{cfg.seq_len}-{SEED}"
    progress = not args.quiet
    data = load_blocks(hidden_blocks(ref, train_w, args.work, f"train-{key}", cfg, progress))
    val = load_blocks(hidden_blocks(ref, val_w, args.work, f"val-{key}", cfg, progress))
    embed = np.ascontiguousarray(weights["model.embed_tokens.weight"], np.float32)
    lm = np.ascontiguousarray(weights["lm_head.weight"], np.float32)
    w, report = train(data, val, embed, lm, cfg, progress)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    w.save(args.out)
    meta = {"command": "python -m edgespec.export.training.train_text_head " + " ".join(argv if argv is not None else sys.argv[1:]),
            "target": str(args.target), "config": asdict(cfg), "validation": report,
            "train_positions": int(data["ids"].size), "minutes": round((time.time() - t0) / 60, 1)}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

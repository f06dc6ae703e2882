"""Distil an attention feature head (EAGLE-style, one causal attention layer) from a target checkpoint, and measure
its chained greedy acceptance against the draft model's and the MLP text head's in one protocol.

    python -m edgespec.export.training.train_attn_head --target models/demo-target --draft models/demo-draft \\
        --mlp-head models/demo-target/text_head.npz --out .cache/attn-head/attn_head.npz --threads 2
    python -m edgespec.export.training.train_attn_head --windows code --draft models/demo-draft \
        --out .cache/attn-head/code/attn_head.npz --work .cache/attn-head/code --threads 2

The MLP text head (edgespec/text_head.py) guesses the target's next hidden state from the last one alone; this head
reads every earlier position too. At position t its input is the target's final hidden state f_t beside the
embedding of the token x_{t+1} emitted from it, [f_t, e(x_{t+1})] W_in (H wide); one pre-norm decoder layer (causal
self-attention with rotary positions over the positions before, a gated SiLU MLP) and a projection give g_t, the
guess of f_{t+1}, whose argmax through the target's LM head is the proposal for x_{t+2}. Drafting on, the head feeds
its own guess and proposal as the next position's input; earlier positions keep the target's true states.

1. Windows and hidden states. --windows corpus: slices of the demo corpus. --windows code: the last 96 tokens of a
   file up to a `def ...:` line (the real-size bench's prompts have that shape), then the target's greedy
   continuation to 256 tokens, so the head learns the text it will draft on (training split for training, the
   held-out split for validation). The target (its torch reference) reads the windows; train_text_head's cached
   blocks under --work, so an interrupted run resumes.
2. Training: teacher-forced over each window (inputs with uniform noise, as EAGLE) plus a second pass in which each
   position reads the first pass's guess at the position before, as the second drafted step does (keys: the first
   pass's at earlier positions, its own at the diagonal). Loss per pass: smooth L1 on the guessed state plus
   ce_weight x cross-entropy on the target's greedy choice. A checkpoint after every epoch; a rerun resumes.
3. Validation on held-out windows: from every 3rd position, chained greedy proposals, step k tried when steps
   0..k-1 were kept and the text followed the target's greedy choices (train_text_head.validate's rule), for this
   head and, when given, the draft model (teacher-forced on the text: the context a kept chain has) and the MLP
   head. Acceptance by position and the tokens per round it implies at each γ go to --out's .json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import optimizer_step
from .train_text_head import HeadConfig, corpus_windows, hidden_blocks, load_blocks

SEED = 1234
WINDOWS = ("corpus", "code")


@dataclass
class AttnHeadConfig:
    hidden: int = 384  # H
    heads: int = 6  # attention heads (H / heads per head, even: rotary pairs)
    seq_len: int = 256
    train_seqs: int = 1536
    val_seqs: int = 48
    block: int = 16  # sequences per cached block of hidden states
    epochs: int = 8
    batch: int = 16  # windows per step
    lr: float = 2e-3
    noise: float = 0.1  # uniform noise on the input states, a fraction of their std (EAGLE: U(-0.1, 0.1))
    ce_weight: float = 0.1
    chain: int = 6  # validation: proposals per chain
    windows: str = "corpus"  # "corpus": slices of the demo corpus; "code": a file up to a `def` line, then greedy
    code_context: int = 96  # "code" windows: tokens of the file before the target's greedy continuation

    def __post_init__(self):
        if self.windows not in WINDOWS:
            raise ValueError(f"windows must be one of {', '.join(WINDOWS)}, got {self.windows!r}")
        for name, v in asdict(self).items():
            if name not in ("noise", "windows") and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.windows == "code" and self.code_context >= self.seq_len:
            raise ValueError(f"code_context ({self.code_context}) must be shorter than seq_len ({self.seq_len}): "
                             "the rest of a window is the target's continuation")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of an even size")


def code_contexts(tokenizer_path: Path, texts: list[str], n: int, context: int, rng) -> np.ndarray:
    """-> (n, context) token ids: the last `context` tokens of a file up to a `def ...:` line (the shape of the
    real-size bench's prompts, bench/lib/prompts.py), at most 4 lines per file, files and lines drawn from rng."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out = []
    for i in rng.permutation(len(texts)):
        lines = texts[i].splitlines(keepends=True)
        defs = [k for k, ln in enumerate(lines)
                if k >= 8 and ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        for k in rng.permutation(defs)[:4]:
            ids = tok.encode("".join(lines[:k + 1])).ids
            if len(ids) >= context:
                out.append(ids[-context:])
        if len(out) >= n:
            return np.array(out[:n], np.int64)
    raise ValueError(f"only {len(out)} code contexts of {context} tokens in {len(texts)} files, {n} wanted")


def greedy_continue(target: Path, contexts: np.ndarray, length: int, work: Path, name: str, progress: bool,
                    batch: int = 64) -> np.ndarray:
    """-> (N, length) windows: each context (N, C) followed by the target's greedy continuation (transformers'
    generate in fp32, no EOS stop), cached per batch under work so an interrupted run resumes."""
    import torch
    import transformers
    from tqdm import tqdm

    work.mkdir(parents=True, exist_ok=True)
    model, out = None, []
    for b in tqdm(range(0, len(contexts), batch), desc=f"greedy continuations ({name})", disable=not progress):
        path = work / f"{name}-{b // batch:04d}.npy"
        if not path.is_file():
            if model is None:
                model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            x = torch.from_numpy(contexts[b:b + batch])
            with torch.no_grad():
                ids = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=length - x.shape[1],
                                     do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
            if ids.shape != (len(x), length):
                raise RuntimeError(f"{target}: generate gave {ids.shape}, expected {(len(x), length)}")
            np.save(path.with_suffix(".partial.npy"), ids)
            path.with_suffix(".partial.npy").replace(path)
        out.append(np.load(path))
    return np.concatenate(out)


def code_windows(target: Path, cfg: AttnHeadConfig, work: Path, key: str, progress: bool):
    """-> (train, val) "code" windows (N, seq_len): code_context tokens of a training-split (held-out) file up to a
    `def` line, then the target's greedy continuation: what the head drafts on the real-size bench's prompts."""
    from .train_demo import TrainConfig, split_corpus

    train_txt, val_txt = split_corpus(TrainConfig())
    rng = np.random.default_rng(SEED)
    out = []
    for split, texts, n in (("train", train_txt, cfg.train_seqs), ("val", val_txt, cfg.val_seqs)):
        ctx = code_contexts(target / "tokenizer.json", texts, n, cfg.code_context, rng)
        out.append(greedy_continue(target, ctx, cfg.seq_len, work, f"code-{split}-{key}", progress))
    return out[0], out[1]


def build(embed: np.ndarray, lm: np.ndarray, cfg: AttnHeadConfig):
    """The head as a torch module over the target's embedding table and LM head (both frozen buffers)."""
    import torch
    F = torch.nn.functional

    e, h, nh = embed.shape[1], cfg.hidden, cfg.heads
    d = h // nh

    def rope(x, pos):  # x (..., T, d), pos (T,): rotate halves
        inv = 1.0 / (10000 ** (torch.arange(d // 2, dtype=torch.float32) / (d // 2)))
        ang = pos[:, None].float() * inv[None]
        c, s = ang.cos(), ang.sin()
        a, b = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    class AttnHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Linear(2 * e, h)
            self.n1, self.n2, self.n3 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
            self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
            self.o = torch.nn.Linear(h, h, bias=False)
            self.gu = torch.nn.Linear(h, 4 * h, bias=False)
            self.down = torch.nn.Linear(2 * h, h, bias=False)
            self.w_out = torch.nn.Linear(h, e)
            self.register_buffer("embed", torch.from_numpy(embed))
            self.register_buffer("lm", torch.from_numpy(lm))

        def project(self, f, x, pos):  # states (B,T,E), tokens (B,T), positions (T,) -> residual, q, k, v
            r = self.w_in(torch.cat([f, self.embed[x]], -1))
            b, t, _ = r.shape
            q, k, v = self.qkv(self.n1(r)).view(b, t, 3, nh, d).permute(2, 0, 3, 1, 4)  # each (B, nh, T, d)
            return r, rope(q, pos), rope(k, pos), v

        def finish(self, r, a):  # residual (B,T,H), attention output (B,nh,T,d) -> guessed next states (B,T,E)
            b, t, _ = r.shape
            r = r + self.o(a.transpose(1, 2).reshape(b, t, h))
            g, u = self.gu(self.n2(r)).chunk(2, -1)
            r = r + self.down(F.silu(g) * u)
            return self.w_out(self.n3(r))

        def teacher(self, f, x):  # position t reads (f_t, x_{t+1}) -> guesses (B,T,E), keys, values
            pos = torch.arange(f.shape[1])
            r, q, k, v = self.project(f, x, pos)
            return self.finish(r, F.scaled_dot_product_attention(q, k, v, is_causal=True)), k, v

        def second(self, g_prev, x, k1, v1):  # position t reads (g_prev_t, x_{t+1}); keys k1 before t, its own at t
            t = g_prev.shape[1]
            r, q, k, v = self.project(g_prev, x, torch.arange(t))
            s1 = (q @ k1.transpose(-1, -2) / math.sqrt(d)).masked_fill(
                ~torch.ones(t, t, dtype=torch.bool).tril(-1), float("-inf"))
            s2 = (q * k).sum(-1, keepdim=True) / math.sqrt(d)
            p = torch.softmax(torch.cat([s1, s2], -1), -1)
            return self.finish(r, p[..., :t] @ v1 + p[..., t:] * v)

        def step(self, g, x, pos, ks, vs):  # one drafted position: (1,1,E), (1,1), int, cached keys/values lists
            r, q, k, v = self.project(g, x, torch.tensor([pos]))
            ks.append(k), vs.append(v)
            return self.finish(r, F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2)))

    return AttnHead()


def to_weights(head, cfg: AttnHeadConfig):
    """The trained torch head as the runtime's AttnHeadWeights (edgespec/attn_head.py: x @ W, so each Linear's
    weight transposed; the norms' epsilon torch's float32 default, which RMSNorm(eps=None) uses)."""
    from edgespec.attn_head import AttnHeadWeights

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in head.state_dict().items()}
    return AttnHeadWeights(
        w_in=sd["w_in.weight"].T, b_in=sd["w_in.bias"], norm1=sd["n1.weight"], w_qkv=sd["qkv.weight"].T,
        w_o=sd["o.weight"].T, norm2=sd["n2.weight"], w_gu=sd["gu.weight"].T, w_down=sd["down.weight"].T,
        norm3=sd["n3.weight"], w_out=sd["w_out.weight"].T, b_out=sd["w_out.bias"], embed=sd["embed"], lm=sd["lm"],
        heads=cfg.heads, eps=float(np.finfo(np.float32).eps))


def train(head, data: dict, cfg: AttnHeadConfig, work: Path, progress: bool) -> dict:
    """Trains in place, resuming from work/attn-head-train.pt; -> {"epochs_run", "last_loss"}."""
    import torch
    from tqdm import tqdm

    ids = torch.from_numpy(data["ids"])
    hid = torch.from_numpy(data["hidden"].astype(np.float32))
    greedy = torch.from_numpy(data["greedy"])
    n = ids.shape[0]
    per_epoch = n // cfg.batch
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=max(cfg.epochs * per_epoch, 1),
                                                pct_start=0.05)
    ckpt, start, loss = work / "attn-head-train.pt", 0, float("nan")
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] == asdict(cfg):
            head.load_state_dict(state["head"]), opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start = state["epoch"]
    rng = np.random.default_rng(SEED)
    orders = [rng.permutation(n) for _ in range(cfg.epochs)]  # drawn up front: a resumed run sees the same order
    bar = tqdm(total=cfg.epochs * per_epoch, initial=start * per_epoch, desc="train attention head",
               disable=not progress)
    for epoch in range(start, cfg.epochs):
        for b in range(per_epoch):
            sel = torch.from_numpy(orders[epoch][b * cfg.batch:(b + 1) * cfg.batch])
            f, x, y = hid[sel], ids[sel], greedy[sel]
            f_in, x_in, f_next, y_next = f[:, :-2], x[:, 1:-1], f[:, 1:-1], y[:, 1:-1]  # t: (f_t, x_{t+1}) -> t+1
            noisy = f_in + (torch.rand_like(f_in) - 0.5) * (2 * cfg.noise) * f_in.std()
            g1, k1, v1 = head.teacher(noisy, x_in)
            g2 = head.second(torch.cat([f_in[:, :1], g1[:, :-1]], 1), x_in, k1, v1)
            loss = 0.0
            for g in (g1, g2):
                ce = torch.nn.functional.cross_entropy((g @ head.lm.T).flatten(0, 1), y_next.flatten())
                loss = loss + torch.nn.functional.smooth_l1_loss(g, f_next) + cfg.ce_weight * ce
            loss = optimizer_step(loss, opt, sched, bar)
        torch.save({"config": asdict(cfg), "epoch": epoch + 1, "head": head.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict()}, ckpt)
    bar.close()
    return {"epochs_run": cfg.epochs - start, "last_loss": loss}


def chain_acceptance(val: dict, proposer, steps: int) -> list[float]:
    """Acceptance by position of chained greedy proposals on held-out windows. proposer(i, j) -> propose(k), the
    k-th proposal of the chain that starts after window i's position j + 1 (called for k = 0, 1, ... in turn)."""
    ids, greedy = val["ids"], val["greedy"]
    tried, kept = np.zeros(steps), np.zeros(steps)
    for i in range(len(ids)):
        for j in range(0, ids.shape[1] - steps - 2, 3):
            propose = proposer(i, j)
            for k in range(steps):
                tried[k] += 1
                if propose(k) != greedy[i, j + k + 1]:
                    break
                kept[k] += 1
                if ids[i, j + k + 2] != greedy[i, j + k + 1]:  # the text leaves the greedy path: stop here
                    break
    return [round(float(a / b), 4) if b else 0.0 for a, b in zip(kept, tried)]


def tokens_per_round(acceptance: list[float]) -> list[float]:
    """Expected tokens per round at γ = 1..len: 1 + sum over k < γ of the chance that proposals 0..k are kept."""
    return [round(1.0 + float(np.sum(np.cumprod(acceptance[:g]))), 3) for g in range(1, len(acceptance) + 1)]


def head_proposer(head, val: dict):
    import torch

    cache = {}

    def proposer(i, j):
        if cache.get("i") != i:  # one teacher-forced pass per window gives every start's first step and keys
            f = torch.from_numpy(val["hidden"][i:i + 1].astype(np.float32))
            x = torch.from_numpy(val["ids"][i:i + 1])
            with torch.no_grad():
                g, k, v = head.teacher(f[:, :-1], x[:, 1:])
            cache.update(i=i, g=g, k=k, v=v, x=x)
        g1, k1, v1, x = cache["g"], cache["k"], cache["v"], cache["x"]
        state = {"g": g1[:, j:j + 1], "ks": [k1[:, :, :j + 1]], "vs": [v1[:, :, :j + 1]]}

        def propose(k):
            with torch.no_grad():
                if k:
                    state["g"] = head.step(state["g"], x[:, j + k + 1:j + k + 2], j + k, state["ks"], state["vs"])
                return int((state["g"][0, 0] @ head.lm.T).argmax())
        return propose
    return proposer


def target_fingerprint(target: Path) -> str:
    """12 hex digits of the target's config.json and weight files' names, sizes and modification times."""
    import hashlib

    h = hashlib.sha256((target / "config.json").read_bytes())
    for p in sorted(target.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.export.training.train_attn_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"), help="target checkpoint folder")
    ap.add_argument("--draft", type=Path, default=None, help="a draft checkpoint to validate beside the head")
    ap.add_argument("--mlp-head", type=Path, default=None, help="an MLP text head (text_head.npz) to validate beside")
    ap.add_argument("--out", type=Path, default=Path(".cache/attn-head/attn_head.npz"),
                    help="the head (edgespec/attn_head.py's .npz) and its report beside it (.json)")
    ap.add_argument("--work", type=Path, default=Path(".cache/attn-head"), help="cached hidden states, checkpoints")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quiet", action="store_true")
    for f, v in asdict(AttnHeadConfig()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v,
                        **({"choices": WINDOWS, "help": "training and validation windows: slices of the demo corpus, "
                            "or code up to a `def` line then the target's greedy continuation"}
                           if f == "windows" else {}))
    args = ap.parse_args(argv)
    import torch

    from ..checkpoint import CheckpointError, load_checkpoint
    from ..reference import ReferenceDecoder
    try:
        cfg = AttnHeadConfig(**{f: getattr(args, f) for f in asdict(AttnHeadConfig())})
        spec, weights = load_checkpoint(args.target)
        for p in (args.draft, args.mlp_head):
            if p is not None and not p.exists():
                raise FileNotFoundError(f"{p}: no such file or folder")
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t0, progress = time.time(), not args.quiet
    blocks = HeadConfig(seq_len=cfg.seq_len, train_seqs=cfg.train_seqs, val_seqs=cfg.val_seqs, block=cfg.block)
    key = f"{spec.vocab_size}-{cfg.seq_len}-{SEED}-{cfg.train_seqs}-{cfg.val_seqs}"
    if cfg.windows == "code":
        # the continuations and states depend on the target itself: its config and weights' fingerprint in the key
        key = f"code{cfg.code_context}-{target_fingerprint(args.target)}-{key}"
        train_w, val_w = code_windows(args.target, cfg, args.work, key, progress)
    else:
        train_w, val_w = corpus_windows(args.target / "tokenizer.json", blocks)
    ref = ReferenceDecoder(spec, weights)
    data = load_blocks(hidden_blocks(ref, train_w, args.work, f"train-{key}", blocks, progress))
    val = load_blocks(hidden_blocks(ref, val_w, args.work, f"val-{key}", blocks, progress))
    embed = np.ascontiguousarray(weights["model.embed_tokens.weight"], np.float32)
    lm = np.ascontiguousarray(weights["lm_head.weight"], np.float32)
    head = build(embed, lm, cfg)
    fit = train(head, data, cfg, args.work, progress)
    head.eval()
    report = {"attention_head": chain_acceptance(val, head_proposer(head, val), cfg.chain)}
    if args.draft is not None:  # teacher-forced on the text: a kept chain's context is the text itself
        dref = ReferenceDecoder.from_pretrained(args.draft)
        with torch.no_grad():
            table = [dref(torch.from_numpy(val["ids"][i:i + 1]))[0].argmax(-1).numpy() for i in range(len(val["ids"]))]
        report["draft_model"] = chain_acceptance(val, lambda i, j: (lambda k: int(table[i][j + k + 1])), cfg.chain)
    if args.mlp_head is not None:
        from edgespec.text_head import TextHead
        mlp = TextHead.load(args.mlp_head)

        def mlp_proposer(i, j):
            x, f = val["ids"][i], val["hidden"][i].astype(np.float32)
            return lambda k: mlp.first(f[j], int(x[j + 1]))[0] if k == 0 else mlp.next(int(x[j + k + 1]))[0]
        report["mlp_head"] = chain_acceptance(val, mlp_proposer, cfg.chain)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    to_weights(head, cfg).save(args.out)  # what edgespec.load(target, draft=OUT) drafts with
    meta = {"command": "python -m edgespec.export.training.train_attn_head "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "target": str(args.target), "config": asdict(cfg), "fit": fit,
            "parameters": int(sum(p.numel() for p in head.parameters())),
            "validation": {k: {"acceptance_by_position": v, "tokens_per_round_by_gamma": tokens_per_round(v)}
                           for k, v in report.items()},
            "validation_windows": int(len(val["ids"])), "train_positions": int(data["ids"].size),
            "minutes": round((time.time() - t0) / 60, 1)}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["validation"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

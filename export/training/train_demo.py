"""Train the bundled demo pair: a byte-level BPE tokenizer, a ~26M Llama target and a ~2.6M draft
distilled from it, on the Python standard library's own sources (every machine with Python has them).

    python -m edgespec.export.training.train_demo --out models            # resumable

Writes standard Hugging Face folders (config.json, fp16 model.safetensors, tokenizer.json,
tokenizer_config.json) to OUT/demo-target and OUT/demo-draft, plus OUT/demo-train.json with the
validation losses and the settings used. Checkpoints go to --work (default .cache/train) every
--ckpt-every steps; rerunning the same command resumes from the last one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SEED = 1234
EOS_TOKEN = "<|endoftext|>"  # separates documents; also the models' BOS/EOS


@dataclass
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass
class TrainConfig:
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 8
    target: ModelShape = field(default_factory=lambda: ModelShape(512, 1408, 8, 8, 4))
    draft: ModelShape = field(default_factory=lambda: ModelShape(256, 768, 2, 4, 2))
    target_steps: int = 900
    draft_steps: int = 600
    lr: float = 1e-3
    draft_lr: float = 2e-3
    warmup: int = 50
    max_position_embeddings: int = 2048
    ckpt_every: int = 50
    val_every_file: int = 50  # a source file goes to validation when crc32(path) % this == 0

    def __post_init__(self):
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position_embeddings {self.max_position_embeddings}")
        for name in ("target_steps", "draft_steps", "batch_size", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def stdlib_files() -> list[Path]:
    """Every .py file of this interpreter's standard library, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    if not files:
        raise RuntimeError(f"no .py files under the standard library at {root}")
    return sorted(files)


def split_corpus(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for p in stdlib_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = str(p.relative_to(root))
        (val if zlib.crc32(rel.encode()) % cfg.val_every_file == 0 else train).append(text)
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def hf_config(shape: ModelShape, cfg: TrainConfig, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
                       num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                       max_position_embeddings=cfg.max_position_embeddings, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batches(data: np.ndarray, cfg: TrainConfig, rng: np.random.Generator):
    import torch

    n = len(data) - cfg.seq_len - 1
    while True:
        starts = rng.integers(0, n, size=cfg.batch_size)
        x = np.stack([data[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def evaluate(model, data: np.ndarray, cfg: TrainConfig, n_batches: int = 20, teacher=None) -> dict:
    """Mean next-token cross entropy on fixed validation windows (and draft/target top-1 agreement)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    gen = batches(data, cfg, rng)
    losses, agree = [], []
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(n_batches):
            x = next(gen)
            logits = model(input_ids=x[:, :-1]).logits.float()
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())
            if teacher is not None:
                t = teacher(input_ids=x[:, :-1]).logits.float()
                agree.append((t.argmax(-1) == logits.argmax(-1)).float().mean().item())
    model.train()
    out = {"val_loss": float(np.mean(losses))}
    if agree:
        out["top1_agreement_with_target"] = float(np.mean(agree))
    return out


def train_model(name: str, model, data, cfg: TrainConfig, steps: int, peak_lr: float, work: Path, teacher=None):
    """AdamW + cosine; bf16 autocast on the CPU. With a teacher the loss is KL(teacher || model)."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    ckpt = work / f"{name}.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"[{name}] resumed at step {step}", flush=True)
    rng = np.random.default_rng(SEED + step + (7 if teacher is not None else 0))
    gen = batches(data, cfg, rng)
    model.train()
    bar = tqdm(total=steps, initial=step, desc=f"train {name}", mininterval=30, file=sys.stdout)
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, cfg.warmup)
        x = next(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    t = teacher(input_ids=x[:, :-1]).logits.float()
                loss = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t, -1), log_target=True,
                                reduction="none").sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.ckpt_every == 0 or step == steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
    bar.close()
    return model


def save_hf(model, tok, out: Path) -> None:
    """Standard HF folder, fp16 weights: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    import torch
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=None, model_max_length=model.config.max_position_embeddings)
    fast.save_pretrained(out)
    # transformers 5 writes tokenizer_class "TokenizersBackend", which transformers 4.x (optimum-onnx pins
    # < 4.58) cannot load; PreTrainedTokenizerFast is understood by both.
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": None, "unk_token": None, "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--work", type=Path, default=Path(".cache/train"))
    ap.add_argument("--target-steps", type=int, default=TrainConfig.target_steps)
    ap.add_argument("--draft-steps", type=int, default=TrainConfig.draft_steps)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)

    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(target_steps=args.target_steps, draft_steps=args.draft_steps)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    train_txt, val_txt = split_corpus(cfg)
    tok_path = args.work / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(train_txt, cfg.vocab_size)
        tok.save(str(tok_path))
    eos = tok.token_to_id(EOS_TOKEN)
    train_ids, val_ids = encode_docs(tok, train_txt), encode_docs(tok, val_txt)
    print(f"corpus: {len(train_txt)} train files / {len(train_ids):,} tokens, "
          f"{len(val_txt)} val files / {len(val_ids):,} tokens", flush=True)

    torch.manual_seed(SEED)
    target = LlamaForCausalLM(hf_config(cfg.target, cfg, eos))
    torch.manual_seed(SEED + 1)
    draft = LlamaForCausalLM(hf_config(cfg.draft, cfg, eos))
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    print(f"target {n_t/1e6:.2f}M params, draft {n_d/1e6:.2f}M params", flush=True)

    train_model("target", target, train_ids, cfg, cfg.target_steps, cfg.lr, args.work)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    save_hf(target, tok, args.out / "demo-target")
    train_model("draft", draft, train_ids, cfg, cfg.draft_steps, cfg.draft_lr, args.work, teacher=target)
    save_hf(draft, tok, args.out / "demo-draft")

    report = {"command": "python -m edgespec.export.training.train_demo --out " + str(args.out),
              "config": asdict(cfg), "params": {"target": n_t, "draft": n_d},
              "corpus": {"train_files": len(train_txt), "train_tokens": int(len(train_ids)),
                         "val_files": len(val_txt), "val_tokens": int(len(val_ids)),
                         "source": f"Python {sys.version.split()[0]} standard library"},
              "target": evaluate(target, val_ids, cfg),
              "draft": evaluate(draft, val_ids, cfg, teacher=target),
              "wall_s": round(time.time() - t0, 1)}
    (args.out / "demo-train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

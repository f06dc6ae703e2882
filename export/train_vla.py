"""Train the bundled tiny VLA pair on the three-target MuJoCo reacher by behaviour cloning, from the expert
demonstrations robots/demos.py writes (this module never runs the simulator).

    python -m edgespec.robots.demos expert --work .cache/vla --episodes 6000 --val-episodes 100
    python -m edgespec.export.train_vla --train .cache/vla/expert-train-6000.npz \
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
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SEED = 7
WORDS = ["<pad>", "reach", "go", "to", "touch", "the", "red", "green", "blue", "target"]


# what the state and the actions mean (policy.json; robots/ map them to a robot's joints and messages): the
# state is the reacher's joint angles, their velocities, then the fingertip; the actions are fingertip targets
REACHER_SEMANTICS = {
    "embodiment": "three-target-reacher",
    "state_names": ["joint0.position", "joint1.position", "joint0.velocity", "joint1.velocity",
                    "fingertip.x", "fingertip.y"],
    "state_units": ["rad", "rad", "rad/s", "rad/s", "m", "m"],
    "action_kind": "cartesian_position",
    "action_names": ["fingertip.x", "fingertip.y"],
    "action_units": ["m", "m"],
}

RETIRED_CONFIG_KEYS = ("eval_episodes",)  # in the bundled model's policy.json; evaluation is robots/demos.py's


@dataclass
class VLAConfig:
    episodes: int = 6000  # the training demonstrations' episodes (recorded from the file)
    val_episodes: int = 100  # the validation file's episodes (recorded)
    horizon: int = 8
    dims: int = 2
    n_bins: int = 256
    image_size: int = 64
    instr_len: int = 6
    img_tokens: int = 4
    keypoints: int = 32
    hidden: int = 256
    target_layers: int = 4
    target_inter: int = 512
    draft_layers: int = 1
    draft_inter: int = 256
    heads: int = 4
    epochs: int = 1  # a second epoch over the same layouts overfits them
    batch: int = 128
    lr: float = 1.5e-3
    noise_std: float = 0.01  # metres, on the executed action of the demonstrations' noisy episodes (recorded)
    state_dim: int = 6  # joint angles, joint velocities, fingertip (x, y)
    state_scale: tuple = (math.pi, math.pi, 10.0, 10.0, 0.2, 0.2)

    def __post_init__(self):
        for k in ("episodes", "horizon", "dims", "epochs", "batch", "hidden", "target_layers", "draft_layers"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if self.state_dim < 6:
            raise ValueError(f"state_dim must be >= 6 (joint angles, velocities, then the fingertip x, y the goal "
                             f"token is relative to), got {self.state_dim}")
        self.state_scale = tuple(float(x) for x in self.state_scale)
        if len(self.state_scale) != self.state_dim or min(self.state_scale) <= 0:
            raise ValueError(f"state_scale needs {self.state_dim} positive values, got {self.state_scale}")

    @classmethod
    def from_dict(cls, d: dict) -> "VLAConfig":
        """A config as policy.json's "config" holds it; keys of settings since retired are dropped."""
        return cls(**{k: v for k, v in d.items() if k not in RETIRED_CONFIG_KEYS})

    @property
    def prefix_len(self) -> int:
        return self.img_tokens + 2 + self.instr_len  # image tokens, goal token, state token, words

    @property
    def action_len(self) -> int:
        return self.horizon * self.dims


def words_to_ids(instruction: str, length: int) -> np.ndarray:
    """The instruction's word ids, right-padded with <pad>: the runtime's rule, so training and acting agree."""
    from edgespec.policy import instruction_ids
    return instruction_ids(instruction, WORDS, length)


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


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------
def build_encoder(cfg: VLAConfig):
    import torch
    import torch.nn as nn

    class Encoder(nn.Module):
        """image (B,S,S,3) uint8, state (B,N) f32, instr (B,L) int64 -> prefix (B, P, E) f32."""

        def __init__(self):
            super().__init__()
            e, k = cfg.hidden, cfg.keypoints
            self.words = nn.Embedding(len(WORDS), e)
            self.instr_pos = nn.Parameter(torch.zeros(cfg.instr_len, e))
            self.conv1 = nn.Conv2d(5, 32, 5, stride=2, padding=2)   # S/2
            self.conv2 = nn.Conv2d(32, 32, 3, stride=2, padding=1)  # S/4
            self.conv3 = nn.Conv2d(32, k, 3, padding=1)
            self.film = nn.Linear(e, 2 * 32)
            self.img = nn.Linear(3 * k, cfg.img_tokens * e)
            self.goal_head = nn.Sequential(nn.Linear(3 * k, 128), nn.ReLU(), nn.Linear(128, 2))
            self.goal_tok = nn.Linear(4, e)
            self.state = nn.Linear(4 + cfg.state_dim, e)
            self.register_buffer("state_scale", torch.tensor(cfg.state_scale, dtype=torch.float32),
                                 persistent=False)
            self.kind = nn.Parameter(torch.zeros(4, e))
            s = cfg.image_size
            yy, xx = torch.meshgrid(torch.linspace(-1, 1, s), torch.linspace(-1, 1, s), indexing="ij")
            self.register_buffer("coords", torch.stack([xx, yy])[None], persistent=False)  # (1,2,S,S)
            s4 = s // 4
            yy, xx = torch.meshgrid(torch.linspace(-1, 1, s4), torch.linspace(-1, 1, s4), indexing="ij")
            self.register_buffer("grid", torch.stack([xx.reshape(-1), yy.reshape(-1)], 1), persistent=False)

        def forward(self, image, state, instr):
            return self.forward_aux(image, state, instr)[0]

        def forward_aux(self, image, state, instr):
            """-> prefix (B, P, E) and the named target's estimated (x, y) (B, 2), m (auxiliary loss)."""
            b = image.shape[0]
            x = image.permute(0, 3, 1, 2).float() / 127.5 - 1.0
            x = torch.cat([x, self.coords.expand(b, -1, -1, -1)], 1)
            w = self.words(instr)  # (B, L, E)
            real = (instr > 0).float()[..., None]
            pooled = (w * real).sum(1) / real.sum(1).clamp(min=1.0)
            gamma, beta = self.film(pooled).chunk(2, -1)
            h = torch.relu(self.conv1(x))
            h = torch.relu(self.conv2(h) * (1 + gamma[:, :, None, None]) + beta[:, :, None, None])
            h = self.conv3(h)  # (B, K, S/4, S/4)
            attn = torch.softmax(h.flatten(2), -1)  # spatial softmax
            kp = attn @ self.grid  # (B, K, 2) expected x, y
            feat = torch.cat([kp.flatten(1), torch.relu(h).mean((2, 3))], 1)  # (B, 3K)
            img = self.img(feat).view(b, cfg.img_tokens, -1) + self.kind[0]
            goal = self.goal_head(feat) * 0.2  # (B, 2) the named target, m
            gt = self.goal_tok(torch.cat([goal, goal - state[:, 4:6]], 1) * 5.0)[:, None] + self.kind[3]
            q = state[:, :2]  # joint angles
            sf = torch.cat([torch.cos(q), torch.sin(q), state / self.state_scale], 1)
            st = (self.state(sf) + self.kind[1])[:, None]
            ins = w + self.instr_pos + self.kind[2]
            return torch.cat([img, gt, st, ins], 1), goal

    return Encoder()


def llama_config(cfg: VLAConfig, layers: int, inter: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=cfg.n_bins, hidden_size=cfg.hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                       max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


class Pair:
    def __init__(self, cfg: VLAConfig):
        import torch
        from transformers import LlamaForCausalLM
        torch.manual_seed(SEED)
        self.cfg = cfg
        self.encoder = build_encoder(cfg)
        self.target = LlamaForCausalLM(llama_config(cfg, cfg.target_layers, cfg.target_inter))
        self.draft = LlamaForCausalLM(llama_config(cfg, cfg.draft_layers, cfg.draft_inter))

    def modules(self):
        return {"encoder": self.encoder, "target": self.target, "draft": self.draft}

    def logits(self, batch, ids):
        """-> target and draft logits (B, T, V) predicting the T action ids after the prefix."""
        import torch
        prefix, goal = self.encoder.forward_aux(batch["image"], batch["state"], batch["instr"])  # (B, P, E)
        t = ids.shape[1]
        out = {}
        for name, model, pre in (("target", self.target, prefix), ("draft", self.draft, prefix.detach())):
            emb = model.get_input_embeddings()(ids[:, :-1])
            x = torch.cat([pre, emb], 1)
            out[name] = model(inputs_embeds=x).logits[:, -t:]
        return out["target"], out["draft"], goal


def to_torch(data: dict, idx: np.ndarray) -> dict:
    import torch
    out = {"image": torch.from_numpy(data["image"][idx]), "state": torch.from_numpy(data["state"][idx]),
           "instr": torch.from_numpy(data["instr"][idx])}
    if "goal" in data:
        out["goal"] = torch.from_numpy(data["goal"][idx])
    return out


def losses(pair: Pair, batch, ids):
    import torch.nn.functional as F
    lt, ld, goal = pair.logits(batch, ids)
    v = lt.shape[-1]
    ce_t = F.cross_entropy(lt.reshape(-1, v), ids.reshape(-1))
    ce_d = F.cross_entropy(ld.reshape(-1, v), ids.reshape(-1))
    kl = F.kl_div(F.log_softmax(ld, -1), F.log_softmax(lt.detach(), -1), log_target=True, reduction="batchmean")
    kl = kl / ids.shape[1]
    aux = F.mse_loss(goal * 5.0, batch["goal"] * 5.0) if "goal" in batch else goal.sum() * 0.0
    return ce_t, ce_d, kl, aux, lt, ld


def evaluate(pair: Pair, data: dict, ids_all: np.ndarray) -> dict:
    import torch
    n = len(ids_all)
    tot = {"target_ce": 0.0, "draft_ce": 0.0, "target_acc": 0.0, "draft_acc": 0.0, "agree": 0.0, "goal_err_m": 0.0}
    with torch.no_grad():
        for s in range(0, n, 512):
            idx = np.arange(s, min(n, s + 512))
            ids = torch.from_numpy(ids_all[idx])
            ce_t, ce_d, _, aux, lt, ld = losses(pair, to_torch(data, idx), ids)
            w = len(idx) / n
            tot["goal_err_m"] += aux.sqrt().item() / 5.0 * w
            tot["target_ce"] += ce_t.item() * w
            tot["draft_ce"] += ce_d.item() * w
            tot["target_acc"] += (lt.argmax(-1) == ids).float().mean().item() * w
            tot["draft_acc"] += (ld.argmax(-1) == ids).float().mean().item() * w
            tot["agree"] += (lt.argmax(-1) == ld.argmax(-1)).float().mean().item() * w
    return {k: round(v, 4) for k, v in tot.items()}


def save(pair: Pair, cfg: VLAConfig, stats, out: Path, report: dict) -> None:
    import torch
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    stats.save(out / "action_stats.json")
    enc = {k: v.detach().to(torch.float16).contiguous() for k, v in pair.encoder.state_dict().items()}
    save_file(enc, str(out / "encoder.safetensors"))
    for name in ("target", "draft"):
        m = getattr(pair, name).to(torch.float16)
        m.save_pretrained(out / name, safe_serialization=True)
        getattr(pair, name).to(torch.float32)
    policy = {"format": "edgespec-vla/1", "task": "three-target reacher (MuJoCo Reacher-v5, 64x64 RGB)",
              "horizon": cfg.horizon, "dims": cfg.dims, "n_bins": cfg.n_bins, "vocab_end": cfg.n_bins,
              "image_size": cfg.image_size, "state_dim": cfg.state_dim, "instr_len": cfg.instr_len, "words": WORDS,
              "prefix_len": cfg.prefix_len, "binary_dims": [], **REACHER_SEMANTICS, "config": asdict(cfg)}
    (out / "policy.json").write_text(json.dumps(policy, indent=2) + "\n")
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")


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
                    noise_std=float(train["noise_std"]), epochs=args.epochs)
    if val["chunk"].shape[1:] != train["chunk"].shape[1:] or val["image"].shape[1:] != train["image"].shape[1:]:
        raise ValueError(f"{args.val} has chunks {val['chunk'].shape[1:]} and images {val['image'].shape[1:]}; "
                         f"{args.train} has {train['chunk'].shape[1:]} and {train['image'].shape[1:]}")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    flat = train["chunk"].reshape(-1, cfg.dims)
    stats = ActionStats(np.quantile(flat, 0.01, axis=0), np.quantile(flat, 0.99, axis=0))
    tok = ActionTokenizer.native(cfg.n_bins, stats)
    ids_train = tok.encode(train["chunk"]).reshape(len(train["chunk"]), -1)  # (N, H*D) time-major
    ids_val = tok.encode(val["chunk"]).reshape(len(val["chunk"]), -1)
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
            ids = torch.from_numpy(ids_train[idx])
            ce_t, ce_d, kl, aux, _, _ = losses(pair, to_torch(train, idx), ids)
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
        ev = evaluate(pair, val, ids_val)
        ev["epoch"], ev["epoch_s"] = epoch + 1, round(time.time() - t0, 1)
        history.append(ev)
        print("val", ev, flush=True)
        torch.save({**{k: m.state_dict() for k, m in pair.modules().items()}, "opt": opt.state_dict(),
                    "epoch": epoch + 1, "history": history}, ckpt)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in pair.modules().items()}
    report = {"params": n_params, "history": history, "train_samples": int(len(ids_train)),
              "data": {"train": str(args.train), "val": str(args.val)}, "wall_s": round(time.time() - t_start, 1),
              "command": "python -m edgespec.export.train_vla " + " ".join(argv if argv is not None
                                                                            else sys.argv[1:])}
    save(pair, cfg, stats, out, report)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

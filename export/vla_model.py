"""The bundled VLA pair's model: its configuration, the instruction words, the encoder and the two Llama
decoders, and the model folder they are saved as (policy.json, action_stats.json, encoder.safetensors,
target/, draft/). export/vla.py exports that folder; training/train_vla.py trains the pair.
"""
from __future__ import annotations

import json
import math
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
    actions: str = "bins"  # "bins": n_bins per dimension (OpenVLA's); "fast": FAST tokens (fast_tokens.py)
    fast_scale: float = 100.0  # FAST: DCT coefficients x scale, rounded
    max_tokens: int = 0  # FAST: the longest training chunk's tokens + END (set from the data); bins: H*D

    def __post_init__(self):
        for k in ("episodes", "horizon", "dims", "epochs", "batch", "hidden", "target_layers", "draft_layers"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if self.state_dim < 6:
            raise ValueError(f"state_dim must be >= 6 (joint angles, velocities, then the fingertip x, y the goal "
                             f"token is relative to), got {self.state_dim}")
        if self.actions not in ("bins", "fast"):
            raise ValueError(f"actions must be 'bins' or 'fast', got {self.actions!r}")
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
        return self.max_tokens if self.actions == "fast" else self.horizon * self.dims


def words_to_ids(instruction: str, length: int) -> np.ndarray:
    """The instruction's word ids, right-padded with <pad>: the runtime's rule, so training and acting agree."""
    from edgespec.policy_folder import instruction_ids
    return instruction_ids(instruction, WORDS, length)


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


FAST_FILE = "fast_tokenizer.json"


def save(pair: Pair, cfg: VLAConfig, stats, out: Path, report: dict, fast=None) -> None:
    """fast: the FastTokenizer of a FAST policy (saved beside; policy.json's "fast" names it)."""
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
    if fast is not None:
        from edgespec.files import file_sha256
        fast.save(out / FAST_FILE)
        policy["fast"] = {"file": FAST_FILE, "sha256": file_sha256(out / FAST_FILE), "max_tokens": cfg.max_tokens}
    (out / "policy.json").write_text(json.dumps(policy, indent=2) + "\n")
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")

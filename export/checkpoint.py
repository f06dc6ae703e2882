"""Read a Hugging Face checkpoint folder (config.json + *.safetensors) into a `ModelSpec` and a weight dict.

Only the Llama, Qwen2 and Mistral decoder families are supported; anything else is refused with an
error that names the supported ones. Weight problems (missing file, corrupt file, missing tensor,
wrong shape) raise `CheckpointError` naming the file and the tensor.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = {  # model_type -> what differs from plain Llama
    "llama": {"qkv_bias": False},
    "mistral": {"qkv_bias": False},
    "qwen2": {"qkv_bias": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: says which file and which tensor, and why."""


@dataclass
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1*ln(factor)+1

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(f"rope type {self.rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
        if self.factor <= 0:
            raise CheckpointError(f"rope scaling factor must be > 0, got {self.factor}")

    def inv_freq_and_scale(self, head_dim: int) -> tuple[np.ndarray, float]:
        """(inv_freq [head_dim/2] float64, attention scaling applied to cos/sin), as transformers computes them."""
        base = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
        if self.rope_type in ("default", "dynamic"):
            # dynamic NTK equals default up to original_max_position_embeddings; export refuses longer contexts
            return base, 1.0
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings or 8192
            low_wl, high_wl = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / base
            inv = np.where(wavelen > low_wl, base / self.factor, base)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * inv / self.factor + smooth * inv
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            return np.where(medium, smoothed, inv), 1.0
        # yarn
        old = self.original_max_position_embeddings
        att = self.attention_factor if self.attention_factor is not None else (
            0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0)

        def corr_dim(n_rot):
            return (head_dim * math.log(old / (n_rot * 2 * math.pi))) / (2 * math.log(self.theta))

        low = max(math.floor(corr_dim(self.beta_fast)), 0)
        high = min(math.ceil(corr_dim(self.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv = (base / self.factor) * (1 - extrap) + base * extrap
        return inv, att


@dataclass
class ModelSpec:
    """Everything the reference model and the exporter need to know about a decoder checkpoint."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: RopeSpec = field(default_factory=RopeSpec)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act != "silu":
            raise CheckpointError(f"hidden_act {self.hidden_act!r} is not supported; expected 'silu'")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_config(cls, cfg: dict, source: str = "config.json") -> "ModelSpec":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{source}: unsupported architecture model_type={mt!r} "
                                  f"(architectures={cfg.get('architectures')}); supported: "
                                  f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            rtype = rp.get("rope_type", rp.get("type", "default"))
            rope = RopeSpec(theta=theta, rope_type=rtype, factor=float(rp.get("factor", 1.0)),
                            original_max_position_embeddings=rp.get("original_max_position_embeddings"),
                            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
                            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
                            beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
                            attention_factor=rp.get("attention_factor"))
            if rope.rope_type == "yarn" and rope.original_max_position_embeddings is None:
                rope.original_max_position_embeddings = int(cfg["max_position_embeddings"])
            sliding = cfg.get("sliding_window")
            if mt == "qwen2" and not cfg.get("use_sliding_window", False):
                sliding = None
            return cls(model_type=mt, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                       intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                       num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or hidden // heads),
                       rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", mt == "qwen2")),
                       qkv_bias=SUPPORTED_ARCHITECTURES[mt]["qkv_bias"], rope=rope,
                       sliding_window=int(sliding) if sliding else None,
                       bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
                       hidden_act=cfg.get("hidden_act", "silu"))
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required field {e.args[0]!r}") from None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, for every weight the decoder needs."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                        p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                        p + "mlp.up_proj.weight": (self.intermediate_size, h),
                        p + "mlp.down_proj.weight": (h, self.intermediate_size)})
            if self.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
        return out


def read_config(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder {ckpt_dir}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def weight_files(ckpt_dir: Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [ckpt_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt_dir}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    return files


def load_weights(ckpt_dir: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """All decoder weights as float32 numpy arrays, checked against the config's shapes."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for f in weight_files(ckpt_dir):
        try:
            part = _load_any_dtype(f, load_file)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
        for k, v in part.items():
            tensors[k] = v
            origin[k] = f.name
    out = {}
    for name, shape in spec.expected_shapes().items():
        if name not in tensors:
            raise CheckpointError(f"{ckpt_dir}: tensor {name!r} is missing from the weight files "
                                  f"({', '.join(sorted(set(origin.values())))})")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)} but config.json "
                                  f"implies {shape}: the config is inconsistent with the weights")
        out[name] = t.astype(np.float32)
    if spec.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _load_any_dtype(path: Path, load_file) -> dict[str, np.ndarray]:
    """safetensors.numpy cannot hold bf16; read those through torch when it is there."""
    try:
        return load_file(str(path))
    except (TypeError, ValueError) as e:
        if "bf16" not in str(e).lower() and "bfloat16" not in str(e).lower():
            raise
        from safetensors.torch import load_file as load_torch
        return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}


def hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_checkpoint(ckpt_dir: Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a folder; expected a Hugging Face checkpoint folder")
    spec = ModelSpec.from_config(read_config(ckpt_dir), source=str(ckpt_dir / "config.json"))
    return spec, load_weights(ckpt_dir, spec)

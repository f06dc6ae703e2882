"""Read a Hugging Face checkpoint folder (config.json + *.safetensors) into a `ModelSpec` and a weight dict.

Families (config.json `model_type`) and what each adds to a plain Llama decoder:

    llama        Llama 2 / 3 (rope scaling: linear, dynamic, llama3, yarn); attention_bias on q, k, v, o
    mistral      a sliding window on every layer
    qwen2        q/k/v biases; a window on layers >= max_window_layers when use_sliding_window
    qwen3        q/k RMSNorm over each head (before rotary); attention_bias on q, k, v, o
    gemma3_text  GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), `1 + w` norms, a norm after attention
                 and around the MLP, q/k norms, query_pre_attn_scalar, interleaved sliding-window and global
                 layers with their own rotary bases
    phi3         fused qkv_proj and gate_up_proj, partial rotary, longrope; Phi-3 and Phi-4-mini
    smollm3      layers without rotary (no_rope_layers)

Everything downstream (reference.py, graph.py, native.py) reads one canonical form:
the weights under Llama's names (fused Phi-3 matrices split, Gemma's `1 + w` norms stored as their
multipliers), and per layer a `LayerSpec` (its window and its rotary, or none). Anything else is refused
with one line naming the file and the field, and the list of what is supported. Weight problems (missing
file, corrupt file, missing tensor, wrong shape, a missing shard) raise `CheckpointError` naming the file
and the tensor.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# what transformers' config class of each family assumes for a field config.json leaves out (a saved config holds
# only what differs from them); tests/test_checkpoint_errors.py compares them with the classes themselves
FAMILY_DEFAULTS = {
    "llama": {"bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768, "max_window_layers": 28},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
             "bos_token_id": 1, "eos_token_id": 32000},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1},
    "smollm3": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 2_000_000.0,
                "bos_token_id": 128000, "eos_token_id": 128001},
}
REFUSED = {  # model_type -> why it is refused (a family close to a supported one)
    "gemma3": "the multimodal Gemma 3 (image + text); export its text model (model_type gemma3_text)",
    "gemma2": "Gemma 2's attention and final logit soft-capping are not implemented",
    "gemma": "Gemma 1 is not implemented (Gemma 3's text model, gemma3_text, is)",
    "llama4": "Llama 4 is a mixture of experts with chunked attention",
    "qwen3_moe": "a mixture of experts", "qwen2_moe": "a mixture of experts", "mixtral": "a mixture of experts",
}


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
    attention_factor: float | None = None  # yarn: None = 0.1*ln(factor)+1; longrope: None = from the factor
    short_factor: list[float] | None = None  # longrope: per frequency, up to original_max_position_embeddings
    long_factor: list[float] | None = None  # longrope: beyond it (export refuses those contexts)

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(f"rope type {self.rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
        if self.factor <= 0:
            raise CheckpointError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and (self.short_factor is None or self.original_max_position_embeddings is None):
            raise CheckpointError("longrope needs short_factor and original_max_position_embeddings, got "
                                  f"{self.short_factor!r} and {self.original_max_position_embeddings!r}")

    def inv_freq_and_scale(self, dim: int) -> tuple[np.ndarray, float]:
        """(inv_freq [dim/2] float64, attention scaling applied to cos/sin) for `dim` rotary dims, as
        transformers computes them."""
        base = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
        if self.rope_type in ("default", "dynamic"):
            # dynamic NTK equals default up to original_max_position_embeddings; export refuses longer contexts
            return base, 1.0
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "longrope":
            # short factors up to original_max_position_embeddings (export refuses longer contexts)
            ext = np.asarray(self.short_factor, np.float32).astype(np.float64)
            if ext.shape != base.shape:
                raise CheckpointError(f"longrope short_factor has {ext.size} values; {dim} rotary dims need {base.size}")
            # transformers: 1 / (ext * theta ** (arange / dim)) in float32
            shape = (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
            inv = 1.0 / (ext.astype(np.float32) * np.float32(self.theta) ** shape)
            att = self.attention_factor
            if att is None:
                att = 1.0 if self.factor <= 1 else math.sqrt(
                    1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
            return inv.astype(np.float64), float(att)
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
            return (dim * math.log(old / (n_rot * 2 * math.pi))) / (2 * math.log(self.theta))

        low = max(math.floor(corr_dim(self.beta_fast)), 0)
        high = min(math.ceil(corr_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv = (base / self.factor) * (1 - extrap) + base * extrap
        return inv, att

    @property
    def context_limit(self) -> int | None:
        """The longest context this rotary is static up to (dynamic NTK and longrope change beyond it)."""
        if self.rope_type in ("dynamic", "longrope"):
            return self.original_max_position_embeddings
        return None


@dataclass
class LayerSpec:
    """What differs between the layers of one model: the attention window and the rotary embedding."""
    window: int | None = None  # sliding window: query i sees keys j with i - j < window; None = every key
    rope: RopeSpec | None = field(default_factory=RopeSpec)  # None: this layer has no rotary (SmolLM3)


@dataclass
class ModelSpec:
    """Everything the reference model and the exporter need to know about a decoder checkpoint.

    Per layer, with x the residual stream (B, T, E) and norm(x, w) = w * x / sqrt(mean(x²) + eps):

        h = norm(x, ln1);  q, k, v = h Wq + bq, h Wk + bk, h Wv + bv   (biases: qkv_bias)
        q, k = norm(q, q_norm), norm(k, k_norm) per head               (qk_norm)
        q, k = rotary(q, k) on the first rotary_dim dims of each head  (the layer's rope; none: skipped)
        a = softmax(q kᵀ · attn_scale, causal and the layer's window) v Wo + bo   (bo: o_bias)
        x = x + a                          (sandwich_norm: x + norm(a, ln_post_attn))
        h = norm(x, ln2);  m = act(h Wg) * (h Wu) Wd
        x = x + m                          (sandwich_norm: x + norm(m, ln_post_mlp))

    with the embedding multiplied by embed_scale and, after the last layer, norm(x, final) Wlm.
    """
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
    rope: RopeSpec = field(default_factory=RopeSpec)  # the layers' rotary unless `layers` says otherwise
    sliding_window: int | None = None  # every layer's window unless `layers` says otherwise
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    o_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    norm_plus_one: bool = False  # checkpoint norms store w - 1 (Gemma); loading turns them into w
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    rotary_dim: int | None = None  # None: head_dim (partial rotary: fewer)
    fused_projections: bool = False  # checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    layers: list[LayerSpec] = field(default_factory=list)  # empty: num_layers of (sliding_window, rope)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS.values():
            raise CheckpointError(f"hidden_act {self.hidden_act!r} is not supported; expected one of "
                                  f"{sorted(SUPPORTED_ACTIVATIONS)}")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"the rotary dims (head_dim x partial_rotary_factor) must be even and in "
                                  f"1..head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.attn_scale is None:
            self.attn_scale = self.head_dim ** -0.5
        if not self.layers:
            self.layers = [LayerSpec(self.sliding_window, self.rope) for _ in range(self.num_layers)]
        if len(self.layers) != self.num_layers:
            raise CheckpointError(f"{len(self.layers)} layer specs for num_hidden_layers {self.num_layers}")
        for i, layer in enumerate(self.layers):
            if layer.window is not None and not (isinstance(layer.window, int) and layer.window > 0):
                raise CheckpointError(f"layer {i}: sliding_window must be an integer > 0, got {layer.window!r}")
        windows = {layer.window for layer in self.layers}
        self.sliding_window = windows.pop() if len(windows) == 1 else None  # uniform, or None when mixed

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]

    @property
    def has_window(self) -> bool:
        return any(w is not None for w in self.windows)

    def ropes(self) -> list[RopeSpec]:
        """The distinct rotary embeddings of the layers, in first-use order (layers share them by index)."""
        out: list[RopeSpec] = []
        for layer in self.layers:
            if layer.rope is not None and layer.rope not in out:
                out.append(layer.rope)
        return out

    def rope_index(self, i: int) -> int | None:
        """Layer i's rotary as an index into ropes(), or None when the layer has none."""
        rope = self.layers[i].rope
        return None if rope is None else self.ropes().index(rope)

    def context_limit(self) -> int:
        """The longest context the export may build: the position limit, or less where a rotary changes."""
        limit = self.max_position_embeddings
        for rope in self.ropes():
            if rope.context_limit:
                limit = min(limit, rope.context_limit)
        return limit

    @classmethod
    def from_config(cls, cfg: dict, source: str = "config.json") -> "ModelSpec":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_ARCHITECTURES:
            why = f" ({REFUSED[mt]})" if mt in REFUSED else ""
            raise CheckpointError(f"{source}: unsupported architecture model_type={mt!r}{why} "
                                  f"(architectures={cfg.get('architectures')}); supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            return _from_config(cls, mt, cfg, source)
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required field {e.args[0]!r} (model_type {mt!r} needs it)") from None

    # -- weights -------------------------------------------------------------------------------
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensor names (as this family stores them) -> shape, for every weight needed."""
        h, q, kv, d, inter = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                              self.head_dim, self.intermediate_size)
        out = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
            if self.fused_projections:
                out.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "self_attn.o_proj.weight": (h, q),
                            p + "mlp.gate_up_proj.weight": (2 * inter, h)})
            else:
                out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)})
            out[p + "mlp.down_proj.weight"] = (h, inter)
            if self.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
            if self.o_bias:
                out[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
            if self.sandwich_norm:
                out.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
        return out

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical tensor name -> shape, as load_weights returns them (Llama's names; for sandwich norms:
        post_attention_layernorm is the norm on the attention output, pre_feedforward_layernorm the MLP's
        input norm, post_feedforward_layernorm the norm on its output)."""
        h, q, kv, inter = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                           self.intermediate_size)
        out = {k: v for k, v in self.checkpoint_shapes().items() if "qkv_proj" not in k and "gate_up_proj" not in k}
        out["lm_head.weight"] = (self.vocab_size, h)
        if self.fused_projections:
            for i in range(self.num_layers):
                p = f"model.layers.{i}."
                out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                            p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (inter, h),
                            p + "mlp.up_proj.weight": (inter, h)})
        return out

    def mlp_norm(self, i: int) -> str:
        """Layer i's norm before the MLP (canonical name)."""
        p = f"model.layers.{i}."
        return p + ("pre_feedforward_layernorm.weight" if self.sandwich_norm else "post_attention_layernorm.weight")


def _count(cfg: dict, name: str, source: str, minimum: int = 1, required: bool = False) -> int | None:
    """cfg[name] as an integer >= minimum (None when absent and not required); 3.0 is 3, 3.5 or "3" is refused."""
    v = cfg.get(name)
    if v is None:
        if required:
            raise KeyError(name)
        return None
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) or v < minimum:
        raise CheckpointError(f"{source}: field {name!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _number(d: dict, name: str, default, source: str, where: str = "") -> float | None:
    """d[name] (or default when absent or null) as a float > 0; names the field when it is not one."""
    v = d.get(name)
    if v is None:
        v = default
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if isinstance(v, bool) or not np.isfinite(f) or f <= 0:
        raise CheckpointError(f"{source}: field {where}{name!r} must be a positive number, got {v!r}")
    return f


def _rope_from(params: dict, cfg: dict, source: str, theta_default: float) -> RopeSpec:
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype in ("su", "yarn") and cfg.get("model_type") == "phi3":
        rtype = "longrope"  # transformers' Phi-3 reads its old names so
    theta = _number(params, "rope_theta", _number(cfg, "rope_theta", theta_default, source), source, "rope ")
    orig = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    factor = _number(params, "factor", None, source, "rope ")
    if rtype == "longrope" and factor is None and orig:  # Phi-3: the ratio of the two position limits
        factor = float(cfg["max_position_embeddings"]) / float(orig)
    if rtype == "yarn" and orig is None:
        orig = int(cfg["max_position_embeddings"])
    try:
        return RopeSpec(theta=theta, rope_type=rtype, factor=float(factor if factor is not None else 1.0),
                        original_max_position_embeddings=int(orig) if orig else None,
                        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                        attention_factor=params.get("attention_factor"),
                        short_factor=params.get("short_factor"), long_factor=params.get("long_factor"))
    except CheckpointError as e:
        raise CheckpointError(f"{source}: rope_parameters: {e}") from None


def _from_config(cls, mt: str, cfg: dict, source: str) -> ModelSpec:
    cfg = {**FAMILY_DEFAULTS[mt], **cfg}  # an explicit null stays null, as in transformers
    hidden = _count(cfg, "hidden_size", source, required=True)
    heads = _count(cfg, "num_attention_heads", source, required=True)
    n_layers = _count(cfg, "num_hidden_layers", source, required=True)
    head_dim = _count(cfg, "head_dim", source)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                  f"and there is no head_dim")
        head_dim = hidden // heads
    for name in ("rope_parameters", "rope_scaling"):
        if cfg.get(name) is not None and not isinstance(cfg[name], dict):
            raise CheckpointError(f"{source}: field {name!r} must be an object (rope_type, factor, ...) or null, "
                                  f"got {cfg[name]!r}")
    gemma, phi, qwen = mt == "gemma3_text", mt == "phi3", mt in ("qwen2", "qwen3")

    act_name = cfg.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act_name not in SUPPORTED_ACTIVATIONS:
        field_name = "hidden_activation" if gemma else "hidden_act"
        raise CheckpointError(f"{source}: {field_name} {act_name!r} is not supported; expected one of "
                              f"{sorted(SUPPORTED_ACTIVATIONS)}")
    for name in ("mlp_bias", "use_bidirectional_attention"):
        if cfg.get(name):
            raise CheckpointError(f"{source}: {name}=true is not supported for {mt} (expected false or absent)")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(name) is not None:
            raise CheckpointError(f"{source}: {name}={cfg[name]} is not supported (expected null: soft-capping "
                                  f"is not implemented)")

    # rotary: one spec, or Gemma's two (sliding layers, global layers)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if gemma:
        if "full_attention" in params or "sliding_attention" in params:
            full = _rope_from(params.get("full_attention") or {}, cfg, source, 1_000_000.0)
            local = _rope_from(params.get("sliding_attention") or {}, cfg, source, 10_000.0)
        else:  # the Hub's format: rope_theta + rope_local_base_freq + rope_scaling for the global layers
            full = _rope_from(params, cfg, source, 1_000_000.0)
            local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
    else:
        full = local = _rope_from(params, cfg, source, 10_000.0)
    prf = _number(params, "partial_rotary_factor", _number(cfg, "partial_rotary_factor", 1.0, source), source)
    if prf > 1:
        raise CheckpointError(f"{source}: field 'partial_rotary_factor' must be in (0, 1], got {prf!r}")
    rotary_dim = int(head_dim * prf)

    # which layers slide, and which have a rotary at all
    window = _count(cfg, "sliding_window", source)
    if mt in ("qwen2", "qwen3", "smollm3") and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == n_layers and all(t in LAYER_TYPES for t in types)):
            raise CheckpointError(f"{source}: layer_types must list one of {LAYER_TYPES} per layer "
                                  f"({n_layers}), got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif gemma:
        pattern = _count(cfg, "sliding_window_pattern", source) or 6
        sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    elif qwen:
        first = _count(cfg, "max_window_layers", source, minimum=0)
        sliding = [i >= first for i in range(n_layers)]
    else:  # mistral, phi3, llama (no window field), smollm3 (see below)
        sliding = [True] * n_layers
    use_rope = [True] * n_layers
    if mt == "smollm3":
        nope = cfg.get("no_rope_layers")
        if nope is None:
            interval = _count(cfg, "no_rope_layer_interval", source) or 4
            nope = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if not (isinstance(nope, list) and len(nope) == n_layers):
            raise CheckpointError(f"{source}: no_rope_layers must hold one 0/1 per layer ({n_layers}), got {nope!r}")
        use_rope = [bool(x) for x in nope]
        if types is None:
            sliding = [not r for r in use_rope]
    if window is not None and not (isinstance(window, int) and window > 0):
        raise CheckpointError(f"{source}: sliding_window must be null or an integer > 0, got {window!r}")
    layers = [LayerSpec(window if (window and s) else None, ((local if s else full) if r else None))
              for s, r in zip(sliding, use_rope)]
    if gemma:  # the rotary follows the layer type even where the window is off
        layers = [LayerSpec(window if s else None, local if s else full) for s in sliding]

    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    return cls(model_type=mt, vocab_size=_count(cfg, "vocab_size", source, required=True), hidden_size=hidden,
               intermediate_size=_count(cfg, "intermediate_size", source, required=True), num_layers=n_layers,
               num_heads=heads, num_kv_heads=_count(cfg, "num_key_value_heads", source) or heads, head_dim=head_dim,
               rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6, source),
               max_position_embeddings=_count(cfg, "max_position_embeddings", source) or 2048,
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", mt in ("gemma3_text", "smollm3"))),
               qkv_bias=(mt == "qwen2") or (attention_bias and mt != "phi3"),
               o_bias=attention_bias and mt not in ("qwen2", "phi3"),
               rope=full, bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
               hidden_act=SUPPORTED_ACTIVATIONS[act_name], qk_norm=mt in ("qwen3", "gemma3_text"),
               sandwich_norm=gemma, norm_plus_one=gemma,
               embed_scale=float(np.float32(hidden ** 0.5)) if gemma else 1.0,
               attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
               rotary_dim=rotary_dim, fused_projections=phi, layers=layers)


def _json_object(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_config(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder {ckpt_dir}")
    cfg = _json_object(path)
    eos = generation_eos(ckpt_dir)
    if eos is not None:  # what transformers' generate() stops at
        cfg = {**cfg, "eos_token_id": eos}
    return cfg


def _eos_list(v, path: Path) -> list[int]:
    ids = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {v!r}")
    return list(ids)


def generation_eos(ckpt_dir: Path) -> list[int] | None:
    """generation_config.json's eos_token_id as a list (None without the file or the field). transformers' generate()
    stops at these, not at config.json's, where the file has them; instruct checkpoints list their end-of-turn token
    there (Qwen2.5's <|im_end|> beside <|endoftext|>), so read_config takes them in place of config.json's."""
    path = Path(ckpt_dir) / "generation_config.json"
    if not path.is_file():
        return None
    gen = _json_object(path)
    return None if gen.get("eos_token_id") is None else _eos_list(gen["eos_token_id"], path)


def weight_files(ckpt_dir: Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' of tensor -> file ({e!r})") from None
        files = [ckpt_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt_dir}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    return files


def load_weights(ckpt_dir: Path, spec: ModelSpec, dtype=np.float32) -> dict[str, np.ndarray]:
    """All decoder weights as numpy arrays under their canonical names (ModelSpec.expected_shapes), checked
    against the config's shapes: float32 (dtype), or with dtype None as stored (float16 and float32 stay; bf16,
    which numpy cannot hold, becomes float32), so that a large checkpoint is not widened all at once. Tensors
    the decoder does not use are read and dropped file by file."""
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for f in weight_files(ckpt_dir):
        try:
            part = read_safetensors(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
        wanted = spec.checkpoint_shapes()
        for k, v in part.items():
            if k in wanted or k not in tensors:
                tensors[k] = v if k in wanted else np.empty(0)  # an unused tensor: its name only
            origin[k] = f.name
    out = {}
    for name, shape in spec.checkpoint_shapes().items():
        if name not in tensors:
            raise CheckpointError(f"{ckpt_dir}: tensor {name!r} is missing from the weight files "
                                  f"({', '.join(sorted(set(origin.values())))})")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{origin[name]}: tensor {name!r} has shape {tuple(t.shape)} but config.json "
                                  f"implies {shape}: the config is inconsistent with the weights")
        out[name] = t.astype(np.float32) if dtype is not None or t.dtype not in (np.float16, np.float32) else t
    del tensors
    return canonical(spec, out)


def canonical(spec: ModelSpec, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors -> the canonical form: fused projections split, `1 + w` norms as multipliers,
    the tied LM head named."""
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if spec.fused_projections:
            qkv = w.pop(p + "self_attn.qkv_proj.weight")
            w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = (
                qkv[:q], qkv[q:q + kv], qkv[q + kv:])
            gu = w.pop(p + "mlp.gate_up_proj.weight")
            w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = gu[:inter], gu[inter:]
    if spec.norm_plus_one:  # Gemma stores w - 1; its norm multiplies by (1 + w) in float32
        for name in [k for k in w if k.endswith("norm.weight")]:
            w[name] = (np.float32(1.0) + w[name].astype(np.float32)).astype(np.float32)
    if spec.tie_word_embeddings:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return w


SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsFile:
    """A .safetensors file: its header, and its tensors read one at a time, each straight into its own array (no
    memory map, whose pages would stay in the process's RSS beside what is made from them, and no whole-file
    buffer); BF16 becomes float32 (numpy has no bfloat16: its bits are the top half of a float32's). ValueError
    for a file that is not safetensors, or an entry that does not fit it.

        with SafetensorsFile(path) as f:
            for name in f.keys(): f.shape(name), f.read(name)   # (shape,) tuple; np.ndarray
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._f = open(self.path, "rb")
        try:
            self._entries = self._header()
        except BaseException:
            self._f.close()
            raise

    def _header(self) -> dict:
        f, size = self._f, self.size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if not 2 <= n <= min(size - 8, 100 << 20):
            raise ValueError(f"header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
                shape = tuple(int(d) for d in shape)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"tensor {name!r}: unsupported or malformed entry {info!r}") from None
            if int(np.prod(shape)) * np.dtype(dtype).itemsize != end - begin or 8 + n + end > size:
                raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not hold {list(shape)} {info['dtype']}")
            entries[name] = (dtype, shape, 8 + n + begin, info["dtype"] == "BF16")
        return entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple:
        return self._entries[name][1]

    def read(self, name: str) -> np.ndarray:
        dtype, shape, offset, bf16 = self._entries[name]
        arr = np.empty(shape, dtype)
        self._f.seek(offset)
        if self._f.readinto(memoryview(arr.reshape(-1)).cast("B")) != arr.nbytes:
            raise ValueError(f"tensor {name!r}: file ends inside its data")
        return (arr.astype(np.uint32) << 16).view(np.float32) if bf16 else arr

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A .safetensors file's tensors (SafetensorsFile: each read into its own array; BF16 as float32), so
    reading a shard costs what it holds. ValueError for a file that is not safetensors."""
    with SafetensorsFile(path) as f:
        return {name: f.read(name) for name in f.keys()}


def hash_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_checkpoint(ckpt_dir: Path, dtype=np.float32) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """(spec, weights): weights as load_weights gives them (float32, or with dtype None as stored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a folder; expected a Hugging Face checkpoint folder")
    spec = ModelSpec.from_config(read_config(ckpt_dir), source=str(ckpt_dir / "config.json"))
    return spec, load_weights(ckpt_dir, spec, dtype)

"""The slow, obvious reference: an eager torch decoder for Llama, Qwen2 and Mistral checkpoints.

No cache, no fusion: `forward(input_ids)` recomputes everything with a plain causal mask. Every engine is
checked against it, and it is checked against transformers' own forward (tests/test_reference.py).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import ModelSpec, load_checkpoint


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (B, T, E) -> normalised in fp32, as HF does
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def rope_cos_sin(spec: ModelSpec, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids (B, T) -> cos, sin (B, T, head_dim), HF's rotate-half layout."""
    inv, scale = spec.rope.inv_freq_and_scale(spec.head_dim)
    inv = torch.tensor(inv, dtype=torch.float32)
    freqs = position_ids.to(torch.float32)[..., None] * inv  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (B, T, D)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class ReferenceDecoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray]):
        super().__init__()
        self.spec = spec
        self.w = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in weights.items()}

    @classmethod
    def from_pretrained(cls, ckpt_dir) -> "ReferenceDecoder":
        return cls(*load_checkpoint(ckpt_dir))

    def causal_mask(self, t: int) -> torch.Tensor:
        """(T, T) additive mask: 0 where key j <= query i (and inside the sliding window), -inf elsewhere."""
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        ok = j <= i
        if self.spec.sliding_window is not None:
            ok &= (i - j) < self.spec.sliding_window
        return torch.where(ok, 0.0, float("-inf"))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) or inputs_embeds (B, T, E) -> logits (B, T, V)."""
        return F.linear(self.hidden(input_ids, inputs_embeds), self.w["lm_head.weight"])

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """-> the final hidden state (B, T, E), after the last norm: the LM head's input."""
        s, w = self.spec, self.w
        x = w["model.embed_tokens.weight"][input_ids] if inputs_embeds is None else inputs_embeds.float()
        b, t, _ = x.shape
        cos, sin = rope_cos_sin(s, torch.arange(t)[None].expand(b, t))
        mask = self.causal_mask(t)
        g = s.num_heads // s.num_kv_heads
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
            q = F.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(b, t, s.num_heads, s.head_dim).transpose(1, 2)  # (B, H, T, D)
            k = k.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, T, D)
            att = (q @ k.transpose(-1, -2)) / s.head_dim ** 0.5 + mask
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim)
            x = x + F.linear(o, w[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            gate = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"]))
            x = x + F.linear(gate * F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
        return rms_norm(x, w["model.norm.weight"], s.rms_norm_eps)

"""The slow, obvious reference: an eager torch decoder for every family checkpoint.py reads.

No cache, no fusion: `forward(input_ids)` recomputes everything with plain masks, one layer at a time, as
ModelSpec's docstring writes it. Every engine is checked against it, and it is checked against transformers'
own forward for each family (tests/test_reference.py, tests/test_families.py).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import ModelSpec, RopeSpec, load_checkpoint


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (..., E) -> normalised in fp32, as HF does; w is the multiplier (Gemma's 1 + w already added)
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def rope_cos_sin(rope: RopeSpec, dim: int, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids (B, T) -> cos, sin (B, T, dim) for `dim` rotary dims, HF's rotate-half layout."""
    inv, scale = rope.inv_freq_and_scale(dim)
    inv = torch.tensor(inv, dtype=torch.float32)
    freqs = position_ids.to(torch.float32)[..., None] * inv  # (B, T, dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (B, T, R) with R <= D rotary dims: the first R dims rotate, the rest pass
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    half = r // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos[:, None] + rot * sin[:, None], rest], dim=-1)


def act(spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if spec.hidden_act == "silu" else F.gelu(x, approximate="tanh")


class _Widened(dict):
    """name -> float32 torch tensor, widened from the stored array when read: a float16 checkpoint is held once,
    as float16, and each weight exists in float32 only while its layer computes."""

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__(weights)

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(super().__getitem__(name), dtype=np.float32))

    def get(self, name: str, default=None):
        return self[name] if name in self else default


class ReferenceDecoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray]):
        super().__init__()
        self.spec = spec
        self.w = _Widened(weights)

    @classmethod
    def from_pretrained(cls, ckpt_dir) -> "ReferenceDecoder":
        return cls(*load_checkpoint(ckpt_dir))

    @staticmethod
    def causal_mask(t: int, window: int | None) -> torch.Tensor:
        """(T, T) additive mask: 0 where key j <= query i (and i - j < window), -inf elsewhere."""
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        ok = j <= i
        if window is not None:
            ok &= (i - j) < window
        return torch.where(ok, 0.0, float("-inf"))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) or inputs_embeds (B, T, E) -> logits (B, T, V)."""
        return F.linear(self.hidden(input_ids, inputs_embeds), self.w["lm_head.weight"])

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """-> the final hidden state (B, T, E), after the last norm: the LM head's input. inputs_embeds are
        taken as they are (the embedding scale, where a family has one, belongs to the ids path)."""
        s, w = self.spec, self.w
        if inputs_embeds is None:
            table = dict.__getitem__(w, "model.embed_tokens.weight")  # (V, E) as stored: one row per token widened
            rows = torch.from_numpy(np.ascontiguousarray(table[input_ids.numpy()], dtype=np.float32))
            x = rows * torch.tensor(s.embed_scale, dtype=torch.float32)
        else:
            x = inputs_embeds.float()
        b, t, _ = x.shape
        pos = torch.arange(t)[None].expand(b, t)
        g = s.num_heads // s.num_kv_heads
        for i, layer in enumerate(s.layers):
            p = f"model.layers.{i}."
            mask = self.causal_mask(t, layer.window)
            h = rms_norm(x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
            q = F.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(b, t, s.num_heads, s.head_dim).transpose(1, 2)  # (B, H, T, D)
            k = k.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            if s.qk_norm:  # over each head's D dims, before the rotary
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], s.rms_norm_eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], s.rms_norm_eps)
            if layer.rope is not None:
                cos, sin = rope_cos_sin(layer.rope, s.rotary_dim, pos)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, T, D)
            att = (q @ k.transpose(-1, -2)) * s.attn_scale + mask
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim)
            o = F.linear(o, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
            if s.sandwich_norm:
                o = rms_norm(o, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            x = x + o
            h = rms_norm(x, w[s.mlp_norm(i)], s.rms_norm_eps)
            m = F.linear(act(s, F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
            if s.sandwich_norm:
                m = rms_norm(m, w[p + "post_feedforward_layernorm.weight"], s.rms_norm_eps)
            x = x + m
        return rms_norm(x, w["model.norm.weight"], s.rms_norm_eps)

"""The torch module that is exported to ONNX: the reference decoder reshaped to the engine contract.

Differences from `reference.ReferenceDecoder`, all for speed on the device:
- q/k/v and gate/up projections are fused into one MatMul each;
- grouped-query attention folds the query group into the row axis, so K/V are never repeated;
- attention over the cache is split: scores against `past` and against the S new keys are computed
  separately and only the (S x P) score matrices are concatenated, so the P cached rows are never copied;
- only the S new K/V rows are returned (`present`); the runtime writes them into its own buffer.

One layer's attention, shapes per batch row (g = H / Hkv query heads per KV head):

    h ─┬─ Wqkv ─▶ q (H,S,D) ─rope─▶ q' (Hkv, g·S, D) ──┬──▶ q'·pastKᵀ (Hkv, g·S, P) ─┐
       │          k (Hkv,S,D) ─rope─▶ present.key ──────┴──▶ q'·kᵀ     (Hkv, g·S, S) ─┴─ concat + bias ─ softmax
       │          v (Hkv,S,D) ──────▶ present.value                                        │
       │                                           o = p[:, :, :P]·pastV + p[:, :, P:]·v ◀─┘
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoint import ModelSpec


class ContractDecoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], input_mode: str = "ids"):
        super().__init__()
        self.spec, self.input_mode = spec, input_mode
        t = lambda a: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)),
                                         requires_grad=False)
        self.embed = t(weights["model.embed_tokens.weight"])  # (V, E)
        self.lm_head = t(weights["lm_head.weight"])  # (V, E)
        self.norm = t(weights["model.norm.weight"])
        inv, scale = spec.rope.inv_freq_and_scale(spec.head_dim)
        self.register_buffer("inv_freq", torch.tensor(inv, dtype=torch.float32))
        self.rope_scale = float(scale)
        self.layers = torch.nn.ModuleList()
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            layer = torch.nn.Module()
            layer.ln1 = t(weights[p + "input_layernorm.weight"])
            layer.ln2 = t(weights[p + "post_attention_layernorm.weight"])
            layer.wqkv = t(np.concatenate([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0))
            layer.bqkv = (t(np.concatenate([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], 0))
                          if spec.qkv_bias else None)
            layer.wo = t(weights[p + "self_attn.o_proj.weight"])
            layer.wgu = t(np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]], 0))
            layer.wd = t(weights[p + "mlp.down_proj.weight"])
            self.layers.append(layer)

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps))

    def forward(self, first, position_ids, attention_bias, *past):
        """first: input_ids (B, S) int64 or inputs_embeds (B, S, E); position_ids (B, S);
        attention_bias (B, 1, S, P+S); past: key_0, value_0, key_1, ... each (B, Hkv, P, D).
        Returns logits (B, S, V), then present key_0, value_0, ... each (B, Hkv, S, D)."""
        s = self.spec
        x = F.embedding(first, self.embed) if self.input_mode == "ids" else first
        b, n = x.shape[0], x.shape[1]
        hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
        g = hq // hk
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (B, S, D/2)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, S, D)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        bias = attention_bias.unsqueeze(1)  # (B, 1, 1, S, T)
        presents = []
        for i, L in enumerate(self.layers):
            pk, pv = past[2 * i], past[2 * i + 1]  # (B, Hkv, P, D)
            h = self._norm(x, L.ln1)
            qkv = F.linear(h, L.wqkv, L.bqkv)  # (B, S, (H + 2 Hkv) D)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q = self._rope(q.view(b, n, hq, d).transpose(1, 2), cos, sin)  # (B, H, S, D)
            k = self._rope(k.view(b, n, hk, d).transpose(1, 2), cos, sin)  # (B, Hkv, S, D)
            v = v.view(b, n, hk, d).transpose(1, 2)  # (B, Hkv, S, D)
            presents += [k, v]
            q = (q * (d ** -0.5)).reshape(b, hk, g * n, d)  # (B, Hkv, g*S, D)
            sp = torch.matmul(q, pk.transpose(-1, -2))  # (B, Hkv, g*S, P)
            sn = torch.matmul(q, k.transpose(-1, -2))  # (B, Hkv, g*S, S)
            sc = torch.cat([sp, sn], dim=-1).view(b, hk, g, n, -1) + bias
            pr = sc.softmax(-1).view(b, hk, g * n, -1)  # (B, Hkv, g*S, P+S)
            npast = pk.shape[2]
            o = torch.matmul(pr[..., :npast], pv) + torch.matmul(pr[..., npast:], v)  # (B, Hkv, g*S, D)
            o = o.view(b, hq, n, d).transpose(1, 2).reshape(b, n, hq * d)
            x = x + F.linear(o, L.wo)
            h = self._norm(x, L.ln2)
            gate, up = F.linear(h, L.wgu).split([s.intermediate_size, s.intermediate_size], dim=-1)
            x = x + F.linear(F.silu(gate) * up, L.wd)
        logits = F.linear(self._norm(x, self.norm), self.lm_head)
        return (logits, *presents)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

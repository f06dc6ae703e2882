"""The torch module that is exported to ONNX: the reference decoder reshaped to the engine contract.

Differences from `reference.ReferenceDecoder`, all for speed on the device:
- q/k/v and gate/up projections are fused into one MatMul each;
- grouped-query attention folds the query group into the row axis, so K/V are never repeated;
- the cache is updated in place: each layer's S new K/V rows are scattered (ONNX ScatterND) into the
  bound buffer at their positions and attention reads that buffer, so nothing is concatenated or copied
  (the runtime binds `present` to `past`'s own memory; ONNX Runtime then skips ScatterND's input copy);
- masked rows are removed with a select on the scores, so whatever a stale row's key holds (NaN, inf,
  huge values) its weight is exactly 0. A stale row's value must be finite (0 x NaN = NaN): a call whose
  values are not finite has non-finite logits (each query reads its own row), and the runtime zeroes the
  rows of such a call (Decoder.run), so the cache only ever holds finite values;
- `next_ids` (the argmax over argmax_ids, or NONFINITE_ID where a row's logits hold NaN or inf) comes
  out beside the logits, so greedy decoding on a device copies S ids back, not S x V logits.

One layer's attention, shapes per batch row (g = H / Hkv query heads per KV head, P bound cache rows):

    h ─┬─ Wqkv ─▶ q (H,S,D) ─rope─▶ q' (Hkv, g·S, D) ─────────────────┐
       │          k (Hkv,S,D) ─rope─▶ ScatterND(past.key, rows) = K ───┴─▶ q'·Kᵀ (Hkv, g·S, P) ─ where(ok) ─ softmax ─ p
       │          v (Hkv,S,D) ──────▶ ScatterND(past.value, rows) = V ──────────────▶ o = p·V (Hkv, g·S, D)
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgespec.contract import MASKED, NONFINITE_ID

from .checkpoint import ModelSpec


class ScatterRows(torch.autograd.Function):
    """cache (B, Hkv, P, D) with rows idx (B, Hkv, S, 3) = (b, h, row) set to new (B, Hkv, S, D): ONNX ScatterND."""

    @staticmethod
    def forward(ctx, cache, idx, new):
        out = cache.clone()
        out[idx[..., 0], idx[..., 1], idx[..., 2]] = new
        return out

    @staticmethod
    def symbolic(g, cache, idx, new):
        return g.op("ScatterND", cache, idx, new)


class ContractDecoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, np.ndarray], input_mode: str = "ids",
                 argmax_ids: tuple[int, int] | None = None, hidden: bool = False):
        super().__init__()
        self.spec, self.input_mode, self.hidden = spec, input_mode, hidden  # hidden: also output the final state
        self.argmax_lo, self.argmax_hi = argmax_ids or (0, spec.vocab_size)
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
        """first: input_ids (B, S) int64 or inputs_embeds (B, S, E); position_ids (B, S) = the rows written;
        attention_bias (B, 1, S, P); past: key_0, value_0, key_1, ... each (B, Hkv, P, D).
        Returns logits (B, S, V), next_ids (B, S), the final hidden state (B, S, E) when built with hidden=True,
        then present key_0, value_0, ... each (B, Hkv, P, D)."""
        s = self.spec
        x = F.embedding(first, self.embed) if self.input_mode == "ids" else first
        b, n = x.shape[0], x.shape[1]
        hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
        g = hq // hk
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (B, S, D/2)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, S, D)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        ok = (attention_bias > MASKED / 2).unsqueeze(1)  # (B, 1, 1, S, P): query s may read row p
        rows = position_ids.unsqueeze(1).expand(b, hk, n)  # (B, Hkv, S)
        idx = torch.stack([torch.arange(b).view(b, 1, 1).expand(b, hk, n),
                           torch.arange(hk).view(1, hk, 1).expand(b, hk, n), rows], dim=-1)  # (B, Hkv, S, 3)
        presents = []
        for i, L in enumerate(self.layers):
            pk, pv = past[2 * i], past[2 * i + 1]  # (B, Hkv, P, D)
            h = self._norm(x, L.ln1)
            qkv = F.linear(h, L.wqkv, L.bqkv)  # (B, S, (H + 2 Hkv) D)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q = self._rope(q.view(b, n, hq, d).transpose(1, 2), cos, sin)  # (B, H, S, D)
            k = self._rope(k.view(b, n, hk, d).transpose(1, 2), cos, sin)  # (B, Hkv, S, D)
            v = v.view(b, n, hk, d).transpose(1, 2)  # (B, Hkv, S, D)
            kc = ScatterRows.apply(pk, idx, k.to(pk.dtype))  # (B, Hkv, P, D): the cache with the new rows
            vc = ScatterRows.apply(pv, idx, v.to(pv.dtype))
            presents += [kc, vc]
            q = (q * (d ** -0.5)).reshape(b, hk, g * n, d)  # (B, Hkv, g*S, D)
            sc = torch.matmul(q, kc.transpose(-1, -2))  # (B, Hkv, g*S, P)
            sc = torch.where(ok, sc.view(b, hk, g, n, -1), MASKED)  # select: what a stale row holds never counts
            pr = sc.softmax(-1).view(b, hk, g * n, -1)  # (B, Hkv, g*S, P)
            o = torch.matmul(pr, vc)  # (B, Hkv, g*S, D); masked rows weigh exactly 0 and hold finite values
            o = o.view(b, hq, n, d).transpose(1, 2).reshape(b, n, hq * d)
            x = x + F.linear(o, L.wo)
            h = self._norm(x, L.ln2)
            gate, up = F.linear(h, L.wgu).split([s.intermediate_size, s.intermediate_size], dim=-1)
            x = x + F.linear(F.silu(gate) * up, L.wd)
        final = self._norm(x, self.norm)  # (B, S, E)
        logits = F.linear(final, self.lm_head)
        next_ids = logits[..., self.argmax_lo:self.argmax_hi].argmax(-1) + self.argmax_lo  # (B, S)
        finite = torch.isfinite(logits.sum(-1))  # (B, S): one reduction, then a check per row
        next_ids = torch.where(finite, next_ids, NONFINITE_ID)  # the argmax of a NaN row is no id
        return (logits, next_ids, *((final,) if self.hidden else ()), *presents)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

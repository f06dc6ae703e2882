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
- a layer with a sliding window ANDs the window (position - row < window) into the visibility of the
  runtime's attention_bias itself, from position_ids: so one attention_bias serves global and windowed layers
  alike (Gemma 3 interleaves them) and the runtime builds only the causal mask;
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
        self.ropes = []  # per distinct rotary: (inv_freq (R/2,), attention scaling)
        for j, rope in enumerate(spec.ropes()):
            inv, scale = rope.inv_freq_and_scale(spec.rotary_dim)
            self.register_buffer(f"inv_freq{j}", torch.tensor(inv, dtype=torch.float32))
            self.ropes.append(float(scale))
        self.layers = torch.nn.ModuleList()
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            w = lambda n: weights[p + n]  # noqa: E731
            layer = torch.nn.Module()
            layer.ln1 = t(w("input_layernorm.weight"))
            layer.ln2 = t(weights[spec.mlp_norm(i)])
            layer.wqkv = t(np.concatenate([w(f"self_attn.{n}_proj.weight") for n in "qkv"], 0))
            layer.bqkv = t(np.concatenate([w(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)) if spec.qkv_bias else None
            layer.qn = t(w("self_attn.q_norm.weight")) if spec.qk_norm else None
            layer.kn = t(w("self_attn.k_norm.weight")) if spec.qk_norm else None
            layer.wo = t(w("self_attn.o_proj.weight"))
            layer.bo = t(w("self_attn.o_proj.bias")) if spec.o_bias else None
            layer.post_attn = t(w("post_attention_layernorm.weight")) if spec.sandwich_norm else None
            layer.post_mlp = t(w("post_feedforward_layernorm.weight")) if spec.sandwich_norm else None
            layer.wgu = t(np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], 0))
            layer.wd = t(w("mlp.down_proj.weight"))
            self.layers.append(layer)

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps))

    def _act(self, x):
        return F.silu(x) if self.spec.hidden_act == "silu" else F.gelu(x, approximate="tanh")

    def forward(self, first, position_ids, attention_bias, *past):
        """first: input_ids (B, S) int64 or inputs_embeds (B, S, E); position_ids (B, S) = the rows written;
        attention_bias (B, 1, S, P); past: key_0, value_0, key_1, ... each (B, Hkv, P, D).
        Returns logits (B, S, V), next_ids (B, S), the final hidden state (B, S, E) when built with hidden=True,
        then present key_0, value_0, ... each (B, Hkv, P, D)."""
        s = self.spec
        if self.input_mode == "ids":
            x = F.embedding(first, self.embed)
            if s.embed_scale != 1.0:
                x = x * s.embed_scale
        else:
            x = first
        b, n = x.shape[0], x.shape[1]
        hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
        g = hq // hk
        rot = []  # per distinct rotary: cos, sin (B, 1, S, R)
        for j, scale in enumerate(self.ropes):
            freqs = position_ids.to(torch.float32).unsqueeze(-1) * getattr(self, f"inv_freq{j}")  # (B, S, R/2)
            emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, S, R)
            rot.append((emb.cos() * scale, emb.sin() * scale))
        ok = (attention_bias > MASKED / 2).unsqueeze(1)  # (B, 1, 1, S, P): query s may read row p
        oks = {}  # window -> ok with the window ANDed in
        if s.has_window:
            keys = torch.arange(attention_bias.shape[-1])  # (P,): row r holds position r
            dist = position_ids.unsqueeze(-1) - keys  # (B, S, P)
            for win in {w for w in s.windows if w is not None}:
                oks[win] = ok & (dist < win).view(b, 1, 1, n, -1)
        rows = position_ids.unsqueeze(1).expand(b, hk, n)  # (B, Hkv, S)
        idx = torch.stack([torch.arange(b).view(b, 1, 1).expand(b, hk, n),
                           torch.arange(hk).view(1, hk, 1).expand(b, hk, n), rows], dim=-1)  # (B, Hkv, S, 3)
        presents = []
        for i, L in enumerate(self.layers):
            pk, pv = past[2 * i], past[2 * i + 1]  # (B, Hkv, P, D)
            h = self._norm(x, L.ln1)
            qkv = F.linear(h, L.wqkv, L.bqkv)  # (B, S, (H + 2 Hkv) D)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q = q.view(b, n, hq, d).transpose(1, 2)  # (B, H, S, D)
            k = k.view(b, n, hk, d).transpose(1, 2)  # (B, Hkv, S, D)
            v = v.view(b, n, hk, d).transpose(1, 2)  # (B, Hkv, S, D)
            if L.qn is not None:  # per head, before the rotary
                q, k = self._norm(q, L.qn), self._norm(k, L.kn)
            j = s.rope_index(i)
            if j is not None:
                q, k = self._rope(q, *rot[j]), self._rope(k, *rot[j])
            kc = ScatterRows.apply(pk, idx, k.to(pk.dtype))  # (B, Hkv, P, D): the cache with the new rows
            vc = ScatterRows.apply(pv, idx, v.to(pv.dtype))
            presents += [kc, vc]
            q = (q * s.attn_scale).reshape(b, hk, g * n, d)  # (B, Hkv, g*S, D)
            sc = torch.matmul(q, kc.transpose(-1, -2))  # (B, Hkv, g*S, P)
            win = s.layers[i].window
            sc = torch.where(oks[win] if win else ok, sc.view(b, hk, g, n, -1), MASKED)  # stale rows never count
            pr = sc.softmax(-1).view(b, hk, g * n, -1)  # (B, Hkv, g*S, P)
            o = torch.matmul(pr, vc)  # (B, Hkv, g*S, D); masked rows weigh exactly 0 and hold finite values
            o = o.view(b, hq, n, d).transpose(1, 2).reshape(b, n, hq * d)
            o = F.linear(o, L.wo, L.bo)
            x = x + (self._norm(o, L.post_attn) if L.post_attn is not None else o)
            h = self._norm(x, L.ln2)
            gate, up = F.linear(h, L.wgu).split([s.intermediate_size, s.intermediate_size], dim=-1)
            m = F.linear(self._act(gate) * up, L.wd)
            x = x + (self._norm(m, L.post_mlp) if L.post_mlp is not None else m)
        final = self._norm(x, self.norm)  # (B, S, E)
        logits = F.linear(final, self.lm_head)
        next_ids = logits[..., self.argmax_lo:self.argmax_hi].argmax(-1) + self.argmax_lo  # (B, S)
        finite = torch.isfinite(logits.sum(-1))  # (B, S): one reduction, then a check per row
        next_ids = torch.where(finite, next_ids, NONFINITE_ID)  # the argmax of a NaN row is no id
        return (logits, next_ids, *((final,) if self.hidden else ()), *presents)

    @staticmethod
    def _rope(x, cos, sin):
        """x (B, H, S, D); cos, sin (B, 1, S, R): the first R dims rotate (rotate-half), the rest pass."""
        r = cos.shape[-1]
        if r == x.shape[-1]:
            half = r // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
        xr, rest = x[..., :r], x[..., r:]
        half = r // 2
        return torch.cat([xr * cos + torch.cat([-xr[..., half:], xr[..., :half]], dim=-1) * sin, rest], dim=-1)

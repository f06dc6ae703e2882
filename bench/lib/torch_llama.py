"""What a GPU user would pick instead of cuda-native, for the device check: a Llama checkpoint decoded by PyTorch
in float16 with a static KV cache, eagerly or one CUDA graph per step (gpt-fast's way: fixed buffers, the
position a tensor, the whole cache attended under a mask). In bench/ only: the runtime never imports torch.

    m = TorchLlama(ckpt_dir, "cuda", max_context=1024)
    ids = m.greedy(prompt_ids, n=128, graphs=True)     # plain greedy decoding; m.last_s: its decode seconds

Llama-shaped checkpoints only (the stand-ins are): RMSNorm, rotate-half rotary with inv_freq = theta^(-2i/D),
SwiGLU, GQA through SDPA's enable_gqa, tied or separate lm_head.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(ckpt / f)))
    return out


class TorchLlama:
    def __init__(self, ckpt_dir, device: str = "cuda", max_context: int = 1024, dtype=torch.float16):
        ckpt = Path(ckpt_dir)
        cfg = json.loads((ckpt / "config.json").read_text())
        if cfg.get("model_type") != "llama":
            raise ValueError(f"{ckpt}: TorchLlama decodes llama checkpoints, got model_type {cfg.get('model_type')!r}")
        self.E, self.H = cfg["hidden_size"], cfg["num_attention_heads"]
        self.Hkv = cfg.get("num_key_value_heads", self.H)
        self.D = cfg.get("head_dim") or self.E // self.H
        self.L, self.eps = cfg["num_hidden_layers"], float(cfg.get("rms_norm_eps", 1e-6))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"{ckpt}: TorchLlama computes the default rotary only, got {rope}")
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.device, self.dtype, self.max_context = device, dtype, max_context
        w = {k: v.to(device=device, dtype=dtype) for k, v in _weights(ckpt).items()}
        p = "model.layers.{}."
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(self.L):
            g = lambda n: w[p.format(i) + n]  # noqa: E731
            self.layers.append((g("input_layernorm.weight"),
                                torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                           g("self_attn.v_proj.weight")]),
                                g("self_attn.o_proj.weight"), g("post_attention_layernorm.weight"),
                                torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]),
                                g("mlp.down_proj.weight")))
        w.clear()
        self.weight_bytes = sum(t.numel() * t.element_size() for lay in self.layers for t in lay) + \
            self.head.numel() * self.head.element_size() + self.norm.numel() * self.norm.element_size()
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.D, 2, device=device, dtype=torch.float32) / self.D)
        self.k = torch.zeros(self.L, self.Hkv, max_context, self.D, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self._graph = None
        self.last_s = 0.0

    def _norm(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * w

    def _rope(self, x, cos, sin):  # x (heads, S, D)
        half = self.D // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids (S,) at positions pos (S,) -> logits (S, V) float32; writes the cache rows pos."""
        s = ids.shape[0]
        x = self.embed[ids]  # (S, E)
        f = pos.float()[:, None] * self.inv_freq[None]  # (S, D/2)
        cos, sin = f.cos().to(self.dtype), f.sin().to(self.dtype)
        mask = torch.arange(self.max_context, device=self.device)[None, :] <= pos[:, None]  # (S, max)
        nq, nk = self.H * self.D, self.Hkv * self.D
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            qkv = self._norm(x, ln1) @ wqkv.T
            q = qkv[:, :nq].view(s, self.H, self.D).transpose(0, 1)
            k = qkv[:, nq:nq + nk].view(s, self.Hkv, self.D).transpose(0, 1)
            v = qkv[:, nq + nk:].view(s, self.Hkv, self.D).transpose(0, 1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.k[i].index_copy_(1, pos, k)
            self.v[i].index_copy_(1, pos, v)
            a = F.scaled_dot_product_attention(q[None], self.k[i][None], self.v[i][None], attn_mask=mask[None, None],
                                               enable_gqa=True)[0]
            x = x + a.transpose(0, 1).reshape(s, nq) @ wo.T
            gu = self._norm(x, ln2) @ wgu.T
            g, u = gu.chunk(2, -1)
            x = x + (F.silu(g) * u) @ wd.T
        return (self._norm(x, self.norm) @ self.head.T).float()

    def _capture(self):
        self._tok = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocations, kernel selection)
                self.forward(self._tok, self._pos)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._out = self.forward(self._tok, self._pos).argmax(-1)

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int, graphs: bool = False) -> list[int]:
        """Plain greedy decoding of n tokens after `prompt`; self.last_s: the n steps' seconds (prefill apart)."""
        if len(prompt) + n > self.max_context:
            raise ValueError(f"{len(prompt)} + {n} tokens exceed the cache's {self.max_context}")
        dev = self.device
        if graphs and self._graph is None:
            self._capture()
        ids = torch.tensor(prompt, dtype=torch.long, device=dev)
        tok = self.forward(ids, torch.arange(len(prompt), device=dev))[-1].argmax()
        out = [int(tok)]
        sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for i in range(n - 1):
            p = len(prompt) + i
            if graphs:
                self._tok.fill_(out[-1])
                self._pos.fill_(p)
                self._graph.replay()
                tok = self._out
            else:
                tok = self.forward(tok.view(1), torch.tensor([p], device=dev))[-1].argmax()
            out.append(int(tok))  # the id comes back every step, as a decode loop needs it
        sync()
        self.last_s = time.perf_counter() - t0
        return out

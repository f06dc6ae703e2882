"""Real-size stand-in checkpoints: a small trained Llama checkpoint inflated to a real model's shape, same function.

    python -m edgespec.export.standin --list                              # presets, parameter counts, bytes
    python -m edgespec.export.standin --preset llama-3.2-1b               # -> .cache/standins/llama-3.2-1b/{target,draft}
    python -m edgespec.export.standin --preset qwen2.5-0.5b --role draft --out .cache/standins/q
    python -m edgespec.export.standin --source models/demo-target --out .cache/standins/x \\
        --shape hidden_size=640,num_attention_heads=12,num_key_value_heads=6,head_dim=128,intermediate_size=1600,num_hidden_layers=10

No real weights can be downloaded here, so benchmarks at real size run on checkpoints made from the bundled demo
pair: every matrix has a real model's shape (so it costs what a real model costs to read and multiply), and the
checkpoint computes exactly the demo's function (so speculative decoding accepts what the demo pair accepts and
greedy output is the demo's). The construction (docs/standins.md has the algebra):

  residual   the source's E dims are dims [0, E) of E'; dims [E, E') stay exactly zero: the embedding is zero
             there, and every matrix that writes the residual (o_proj, down_proj) has zero rows there
  RMSNorm    mean(x^2) over E' is (E/E') of the mean over E, so rms_norm_eps' = eps*E/E' and every norm weight
             is scaled by sqrt(E/E'): w' x / sqrt(mean' + eps') = w x / sqrt(mean + eps)
  heads      source KV head k -> new KV head k; source q head h (group h // g) -> new q head
             (h // g) * g' + h % g, so it stays in the group its own KV head serves (GQA: q head -> h' // g');
             the other q heads and KV heads are dead: o_proj columns of dead q heads are zero
  head_dim   D -> D' = r*D (r integer; RoPE types default, linear, llama3 only): old dim d < D/2 -> r*d, old dim
             d >= D/2 -> r*(d - D/2) + D'/2, which keeps each rotate-half pair at its frequency
             (theta^(-2(ri)/(rD)) = theta^(-2i/D)) for q and k; q rows of the other dims of real heads are
             zero (k may hold anything there); v needs no map: its D dims are the first D of D', the other v rows
             of real KV heads are zero (so o_proj may hold anything in those columns); q is scaled by sqrt(D'/D)
             so that q.k/sqrt(D') = q.k/sqrt(D)
  MLP        source channels are channels [0, I) of I'; down_proj columns [I, I') are zero
  layers     source layer i -> new layer i*L'//L; the others are dead: o_proj and down_proj all zero, so the
             layer adds nothing to the residual

  vocabulary (optional, vocab_size=V' > V) ids [V, V') are padding, as real checkpoints pad theirs (Qwen2.5's
             151936 rows hold 151665 tokens): their embedding and LM-head rows copy the row of one "sink" id, the
             source's least likely token on a calibration text, so a padded id's logit equals the sink's and never
             wins a greedy choice (ties go to the lower, real id). For greedy benchmarks only: the copies together
             take real probability (for the demo at 128256 ids, 3% on average, up to 20% at a flat position; the
             tokenizer has no token for a padded id, and edgespec's text shows it as <|id:N|>). standin.json
             records the sink's margin and that probability

Everything else (the "dead" weights: columns that multiply zeros, heads and channels whose outputs go nowhere,
whole dead layers but their two output projections) is seeded Gaussian noise with the std of the source tensor
it stands beside, so every matrix looks and costs like a real one. Output: float16 safetensors in HF's sharded
layout (model-0000k-of-0000N.safetensors + model.safetensors.index.json), written tensor by tensor (peak memory is
the source plus one tensor), a LlamaConfig config.json, the source's tokenizer files, and standin.json (the
recipe). By default the vocabulary stays the source's (4096 for the demo pair); a preset with vocab="real" pads it
to the real model's and takes a draft narrow enough to stay 10-30x smaller with that vocabulary.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_DRAFT = REPO / "models" / "demo-draft"
DEFAULT_OUT = REPO / ".cache" / "standins"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                "chat_template.jinja")
# RoPE types whose inv_freq is an elementwise function of theta^(-2i/D): a larger head_dim maps exactly. Not
# "dynamic" (its rescaled base depends on D beyond the original context) nor "yarn" (its ramp is in index units).
EXACT_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_SHARD_BYTES = 1 << 30
FORMAT_VERSION = 2  # 2: v keeps its dims first (int4 blocks of o_proj stay the source's)


class StandinError(ValueError):
    """Bad input for a stand-in: one line naming the field, what was expected and what was got."""


@dataclass(frozen=True)
class Shape:
    """The dimensions a stand-in is inflated to (HF LlamaConfig names)."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, x) -> "Shape":
        if isinstance(x, Shape):
            return x
        x = dict(x)
        names = [f.name for f in fields(cls)]
        extra = sorted(set(x) - set(names))
        if extra:
            raise StandinError(f"shape: unknown field {extra[0]!r}; expected the fields {', '.join(names)}")
        missing = [n for n in names if n not in x]
        if missing:
            raise StandinError(f"shape.{missing[0]}: expected a positive integer, got nothing")
        out = {}
        for n in names:
            v = x[n]
            if isinstance(v, str) and v.strip().isdigit():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise StandinError(f"shape.{n}: expected a positive integer, got {x[n]!r}")
            out[n] = v
        return cls(**out)

    def brief(self) -> str:
        return (f"hidden {self.hidden_size}, {self.num_attention_heads} heads / {self.num_key_value_heads} KV, "
                f"head_dim {self.head_dim}, MLP {self.intermediate_size}, {self.num_hidden_layers} layers")


def param_count(shape: Shape, vocab_size: int, tied: bool = True, qkv_bias: bool = False) -> int:
    """Parameters of a Llama-style decoder of `shape` (embedding counted once when tied)."""
    e, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = e * q + 2 * e * kv + q * e + 3 * e * shape.intermediate_size + 2 * e + (q + 2 * kv if qkv_bias else 0)
    return vocab_size * e * (1 if tied else 2) + shape.num_hidden_layers * layer + e


@dataclass(frozen=True)
class RealModel:
    name: str
    shape: Shape
    vocab_size: int
    tied: bool
    qkv_bias: bool = False

    @property
    def params(self) -> int:
        return param_count(self.shape, self.vocab_size, self.tied, self.qkv_bias)


@dataclass(frozen=True)
class Preset:
    target: Shape
    draft: Shape
    real: RealModel
    differs: str  # how the target's shape differs from the real model's (beyond the vocabulary)
    # the draft with the real vocabulary: its embedding is V x E, so a draft as wide as `draft` would be only 5-8x
    # smaller than the target; this one is 12-13x (None: `draft` already is)
    real_vocab_draft: Shape | None = None

    def shape(self, role: str, vocab: str = "source") -> Shape:
        """The target's or draft's shape for vocab "source" (the demo's 4096) or "real"."""
        if role not in ("target", "draft"):
            raise StandinError(f"role: expected 'target' or 'draft', got {role!r}")
        if vocab not in VOCABS:
            raise StandinError(f"vocab: expected one of {', '.join(VOCABS)}, got {vocab!r}")
        if role == "draft" and vocab == "real" and self.real_vocab_draft is not None:
            return self.real_vocab_draft
        return getattr(self, role)


VOCABS = ("source", "real")


PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset(
        target=Shape(896, 16, 4, 64, 4864, 24),
        draft=Shape(512, 8, 2, 64, 1536, 6),
        real=RealModel("Qwen/Qwen2.5-0.5B", Shape(896, 14, 2, 64, 4864, 24), 151936, tied=True, qkv_bias=True),
        differs="16 q heads / 4 KV heads instead of 14 / 2: the source's 4 KV heads need 4, and transformers' "
                "LlamaConfig needs hidden_size % num_attention_heads == 0 (896 = 16*56; 12 heads would have kept the "
                "projections' size exactly but 896/12 is not whole); q width 1024 instead of 896, so each layer has "
                "0.46M (3%) more parameters; KV cache 2x the real one; no q/k/v biases; rope_theta 10000 (the "
                "source's) instead of 1e6",
        real_vocab_draft=Shape(256, 4, 2, 64, 768, 4)),
    "llama-3.2-1b": Preset(
        target=Shape(2048, 32, 8, 64, 8192, 16),
        draft=Shape(768, 12, 4, 64, 2048, 8),
        real=RealModel("meta-llama/Llama-3.2-1B", Shape(2048, 32, 8, 64, 8192, 16), 128256, tied=True),
        differs="the real shape; rope is the source's (default, theta 10000) instead of llama3 scaling at 500000",
        real_vocab_draft=Shape(512, 8, 4, 64, 2048, 8)),
    "llama-3.2-3b": Preset(
        target=Shape(3072, 24, 8, 128, 8192, 28),
        draft=Shape(1024, 8, 4, 128, 2816, 12),
        real=RealModel("meta-llama/Llama-3.2-3B", Shape(3072, 24, 8, 128, 8192, 28), 128256, tied=True),
        differs="the real shape (head_dim 128 from the source's 64, exact); rope is the source's (default, theta "
                "10000) instead of llama3 scaling at 500000"),
}


# ---------------------------------------------------------------------------------------------------- the source

@dataclass(frozen=True)
class Source:
    path: Path
    config: dict
    shape: Shape
    vocab_size: int
    tied: bool
    eps: float
    rope_type: str


def read_source(source_dir) -> Source:
    """The source checkpoint's config, checked to be a plain Llama (the only family a LlamaConfig can carry)."""
    source_dir = Path(source_dir)
    path = source_dir / "config.json"
    if not path.is_file():
        raise StandinError(f"{source_dir}: source: expected a Hugging Face checkpoint folder with config.json, "
                           f"got {'a folder without one' if source_dir.is_dir() else 'no such folder'}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StandinError(f"{path}: expected valid JSON, got a parse error ({e})") from None
    mt = cfg.get("model_type")
    if mt != "llama":
        raise StandinError(f"{path}: model_type: expected 'llama' (a LlamaForCausalLM checkpoint), got {mt!r}")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"), ("pretraining_tp", 1)):
        got = cfg.get(key, want)
        if got != want:
            raise StandinError(f"{path}: {key}: expected {want!r} (a plain Llama), got {got!r}")
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(prf) != 1.0:
        raise StandinError(f"{path}: partial_rotary_factor: expected 1.0, got {prf!r}")
    try:
        heads = int(cfg["num_attention_heads"])
        shape = Shape(hidden_size=int(cfg["hidden_size"]), num_attention_heads=heads,
                      num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                      head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                      intermediate_size=int(cfg["intermediate_size"]),
                      num_hidden_layers=int(cfg["num_hidden_layers"]))
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise StandinError(f"{path}: {e.args[0]}: expected a value, got nothing") from None
    return Source(source_dir, cfg, shape, vocab, bool(cfg.get("tie_word_embeddings", False)),
                  float(cfg.get("rms_norm_eps", 1e-6)), str(rp.get("rope_type", rp.get("type", "default"))))


def check_shape(src: Source, shape: Shape, genai_builder: bool = True) -> None:
    """Refuse a shape the source cannot be inflated to exactly (StandinError naming the field)."""
    s = src.shape
    for f in fields(Shape):
        got, want = getattr(shape, f.name), getattr(s, f.name)
        if got < want:
            raise StandinError(f"shape.{f.name}: expected >= {want} (the source's), got {got}")
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise StandinError(f"shape.num_attention_heads: expected a multiple of num_key_value_heads "
                           f"({shape.num_key_value_heads}), got {shape.num_attention_heads}")
    g = s.num_attention_heads // s.num_key_value_heads
    g2 = shape.num_attention_heads // shape.num_key_value_heads
    if g2 < g:
        raise StandinError(f"shape.num_attention_heads: expected >= {g} query heads per KV head (the source's "
                           f"{s.num_attention_heads}/{s.num_key_value_heads}, so each source GQA group fits in one "
                           f"new group), got {shape.num_attention_heads}/{shape.num_key_value_heads} = {g2}")
    if shape.hidden_size % shape.num_attention_heads:
        raise StandinError(f"shape.hidden_size: expected a multiple of num_attention_heads ({shape.num_attention_heads}"
                           f"; transformers' LlamaConfig refuses anything else), got {shape.hidden_size}")
    if shape.head_dim % s.head_dim:
        raise StandinError(f"shape.head_dim: expected a multiple of the source's {s.head_dim} (RoPE frequencies "
                           f"map exactly only then), got {shape.head_dim}")
    if shape.head_dim != s.head_dim and src.rope_type not in EXACT_ROPE_TYPES:
        raise StandinError(f"shape.head_dim: expected {s.head_dim} (the source's) with rope_type "
                           f"{src.rope_type!r} (only {', '.join(EXACT_ROPE_TYPES)} keep every frequency when head_dim "
                           f"grows), got {shape.head_dim}")
    # ONNX Runtime GenAI 0.18's builder walks model.modules() and takes any nn.Linear with out_features ==
    # vocab_size for the LM head: no projection may be as wide as the vocabulary (genai_builder=False: a
    # stand-in that never meets that builder, such as a policy's decoder, may have one)
    widths = (("intermediate_size", shape.intermediate_size), ("hidden_size", shape.hidden_size),
              ("num_attention_heads*head_dim", shape.num_attention_heads * shape.head_dim),
              ("num_key_value_heads*head_dim", shape.num_key_value_heads * shape.head_dim))
    for name, width in widths if genai_builder else ():
        if width == src.vocab_size:
            raise StandinError(f"shape.{name}: expected a width other than vocab_size {src.vocab_size} (ONNX Runtime "
                               f"GenAI's builder takes any linear layer of vocabulary width for the LM head), "
                               f"got {width}")


# ------------------------------------------------------------------------------------------------- the placement

def layer_positions(n_src: int, n_new: int) -> list[int]:
    """Source layer i -> new layer i*L'//L (spread out, first layer real)."""
    return [i * n_new // n_src for i in range(n_src)]


def head_dim_map(d: int, d2: int) -> np.ndarray:
    """Old head dim -> new head dim keeping each rotate-half pair (i, i+D/2) at frequency theta^(-2i/D)."""
    r, idx = d2 // d, np.arange(d)
    return np.where(idx < d // 2, r * idx, r * (idx - d // 2) + d2 // 2)


def q_head_map(s: Shape, shape: Shape) -> np.ndarray:
    """Source q head h -> new q head, in the group of new KV head h // g (= the source's KV head index)."""
    g, g2 = s.num_attention_heads // s.num_key_value_heads, shape.num_attention_heads // shape.num_key_value_heads
    h = np.arange(s.num_attention_heads)
    return (h // g) * g2 + h % g


# ---------------------------------------------------------------------------------------------- the vocabulary

# The calibration text the sink is chosen on: Python and English, what the demo pair was trained on and is
# benchmarked with. A source without tokenizer.json is calibrated on seeded random ids instead.
CALIBRATION_TEXT = '''import json
from pathlib import Path


def load_config(path: str) -> dict:
    \"\"\"Read a JSON config file and return its settings, with defaults for missing keys.\"\"\"
    with open(Path(path), encoding="utf-8") as f:
        data = json.load(f)
    for key, value in {"threads": 2, "verbose": False}.items():
        data.setdefault(key, value)
    return data


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1
        return self.counts[word]
'''


def _calibration_ids(src: Source, n_random: int = 256) -> np.ndarray:
    """(B, T) token ids: the calibration text through the source's tokenizer, else seeded random ids."""
    limit = int(src.config.get("max_position_embeddings") or 2048)
    tok = src.path / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer
        ids = Tokenizer.from_file(str(tok)).encode(CALIBRATION_TEXT, add_special_tokens=False).ids[:limit]
        if len(ids) >= 8:
            return np.asarray([ids], np.int64)
    rng = np.random.default_rng(1234)
    return rng.integers(0, src.vocab_size, (4, min(n_random, limit)), dtype=np.int64)


def pick_sink(src: Source, n_pad: int) -> dict:
    """The id whose row the padded vocabulary copies: the source's token that stays furthest below the winner at
    every position of the calibration text (its worst margin the largest), so a padded id never wins a greedy
    choice there. -> {"sink", "calibration_tokens", "margin_min" (min over positions of max logit - the sink's),
    "padded_probability_max" (the most probability the n_pad copies take at one position)}."""
    import torch
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    ids = _calibration_ids(src)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)).logits.reshape(-1, src.vocab_size).double()  # (B*T, V)
    del model
    top = logits.max(-1, keepdim=True).values
    margin = (top - logits).min(0).values  # (V,): each token's closest approach to the winner
    sink = int(margin.argmax())
    lse = torch.logsumexp(logits, -1)
    pad = logits[:, sink] + math.log(n_pad)  # log of the padding's unnormalised mass
    prob = torch.exp(pad - torch.logaddexp(lse, pad))
    return {"sink": sink, "calibration_tokens": int(ids.size), "margin_min": round(float(margin[sink]), 4),
            "padded_probability_max": float(f"{float(prob.max()):.3g}")}


class _Inflater:
    """Makes each new tensor on demand (float16), from the source weights and a seed."""

    def __init__(self, src: Source, weights: dict[str, np.ndarray], shape: Shape, seed: int,
                 vocab_size: int | None = None, sink: int | None = None):
        self.src, self.w, self.shape, self.seed = src, weights, shape, seed
        self.v, self.v2, self.sink = src.vocab_size, vocab_size or src.vocab_size, sink
        if self.v2 > self.v and sink is None:
            raise AssertionError("a padded vocabulary needs its sink id")
        s = src.shape
        self.e, self.e2 = s.hidden_size, shape.hidden_size
        self.i, self.i2 = s.intermediate_size, shape.intermediate_size
        d, d2 = s.head_dim, shape.head_dim
        self.d2 = d2
        self.norm_scale = math.sqrt(self.e / self.e2)
        self.q_scale = math.sqrt(d2 / d)
        dmap = head_dim_map(d, d2)
        qh = q_head_map(s, shape)
        kvh, vmap = np.arange(s.num_key_value_heads), np.arange(d)  # v needs no RoPE map: its dims stay first
        self.q_rows = (qh[:, None] * d2 + dmap[None, :]).reshape(-1)  # source q row -> new q row
        self.k_rows = (kvh[:, None] * d2 + dmap[None, :]).reshape(-1)
        self.v_rows = (kvh[:, None] * d2 + vmap[None, :]).reshape(-1)
        self.o_cols = (qh[:, None] * d2 + vmap[None, :]).reshape(-1)  # o_proj reads q head h' x v dim
        real_q = (qh[:, None] * d2 + np.arange(d2)[None, :]).reshape(-1)
        self.q_zero_rows = np.setdiff1d(real_q, self.q_rows)  # the other RoPE pairs of real heads
        real_kv = (kvh[:, None] * d2 + np.arange(d2)[None, :]).reshape(-1)
        self.v_zero_rows = np.setdiff1d(real_kv, self.v_rows)  # the other dims of real KV heads
        self.o_zero_cols = np.setdiff1d(np.arange(shape.num_attention_heads * d2), real_q)  # dead q heads
        pos = layer_positions(s.num_hidden_layers, shape.num_hidden_layers)
        self.donor = []  # new layer -> (source layer, real?)
        for p in range(shape.num_hidden_layers):
            real = [i for i, q in enumerate(pos) if q <= p]
            self.donor.append((real[-1], pos[real[-1]] == p))

    # -- helpers
    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    @staticmethod
    def _sigma(t: np.ndarray) -> float:
        s = float(np.std(t, dtype=np.float64))
        return s if s > 0 else 0.02

    def _noise(self, name: str, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        out = self._rng(name).standard_normal(shape, dtype=np.float32)
        out *= np.float32(self._sigma(like))
        return out.astype(np.float16)

    @staticmethod
    def _f16(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Source values (float32 holding float16) times `scale`, rounded once to float16."""
        return (x.astype(np.float64) * scale).astype(np.float16) if scale != 1.0 else x.astype(np.float16)

    # -- tensors
    def plan(self) -> list[tuple[str, tuple[int, ...], object]]:
        """[(name, shape, make)] in HF's order; make() -> the float16 array."""
        sh, e2 = self.shape, self.e2
        q2, kv2 = sh.num_attention_heads * sh.head_dim, sh.num_key_value_heads * sh.head_dim
        out = [("model.embed_tokens.weight", (self.v2, e2), self.embed)]
        for p in range(sh.num_hidden_layers):
            pre = f"model.layers.{p}."
            for part, shp in (("self_attn.q_proj", (q2, e2)), ("self_attn.k_proj", (kv2, e2)),
                              ("self_attn.v_proj", (kv2, e2)), ("self_attn.o_proj", (e2, q2)),
                              ("mlp.gate_proj", (sh.intermediate_size, e2)), ("mlp.up_proj", (sh.intermediate_size, e2)),
                              ("mlp.down_proj", (e2, sh.intermediate_size)),
                              ("input_layernorm", (e2,)), ("post_attention_layernorm", (e2,))):
                out.append((pre + part + ".weight", shp, lambda p=p, part=part: self.layer_tensor(p, part)))
        out.append(("model.norm.weight", (e2,), lambda: self.norm("model.norm.weight", self.w["model.norm.weight"])))
        if not self.src.tied:
            out.append(("lm_head.weight", (self.v2, e2), self.lm_head))
        return out

    def _pad_vocab(self, rows: np.ndarray) -> np.ndarray:
        """(V, E') -> (V', E'): the padded ids' rows are copies of the sink's."""
        if self.v2 == self.v:
            return rows
        return np.concatenate([rows, np.broadcast_to(rows[self.sink], (self.v2 - self.v, rows.shape[1]))], 0)

    def embed(self) -> np.ndarray:
        src = self.w["model.embed_tokens.weight"]
        out = np.zeros((src.shape[0], self.e2), np.float16)  # padded columns exactly zero
        out[:, :self.e] = self._f16(src)
        return self._pad_vocab(out)

    def lm_head(self) -> np.ndarray:
        src = self.w["lm_head.weight"]
        out = self._noise("lm_head.weight", (src.shape[0], self.e2), src)  # padded columns read zeros
        out[:, :self.e] = self._f16(src)
        return self._pad_vocab(out)

    def norm(self, name: str, src: np.ndarray, real: bool = True) -> np.ndarray:
        vals = self._f16(src, self.norm_scale)
        out = self._rng(name).choice(vals, size=self.e2)  # dead entries: drawn from the real ones
        if real:
            out[:self.e] = vals
        return out

    def layer_tensor(self, p: int, part: str) -> np.ndarray:
        s_layer, real = self.donor[p]
        name = f"model.layers.{p}.{part}.weight"
        src = self.w[f"model.layers.{s_layer}.{part}.weight"]
        if part.endswith("layernorm"):
            return self.norm(name, src, real)
        sh = self.shape
        shp = {"self_attn.q_proj": (sh.num_attention_heads * sh.head_dim, self.e2),
               "self_attn.k_proj": (sh.num_key_value_heads * sh.head_dim, self.e2),
               "self_attn.v_proj": (sh.num_key_value_heads * sh.head_dim, self.e2),
               "self_attn.o_proj": (self.e2, sh.num_attention_heads * sh.head_dim),
               "mlp.gate_proj": (self.i2, self.e2), "mlp.up_proj": (self.i2, self.e2),
               "mlp.down_proj": (self.e2, self.i2)}[part]
        if part in ("self_attn.o_proj", "mlp.down_proj") and not real:
            return np.zeros(shp, np.float16)  # a dead layer writes nothing to the residual
        scale = self.q_scale if part == "self_attn.q_proj" else 1.0
        out = self._noise(name, shp, src)
        if scale != 1.0:
            out = (out.astype(np.float32) * np.float32(scale)).astype(np.float16)
        if not real:
            return out
        cols = np.arange(self.e)
        if part == "self_attn.q_proj":
            out[np.ix_(self.q_rows, cols)] = self._f16(src, scale)
            out[self.q_zero_rows] = 0
        elif part == "self_attn.k_proj":
            out[np.ix_(self.k_rows, cols)] = self._f16(src)
        elif part == "self_attn.v_proj":
            out[np.ix_(self.v_rows, cols)] = self._f16(src)
            out[self.v_zero_rows] = 0
        elif part == "self_attn.o_proj":
            out[np.ix_(cols, self.o_cols)] = self._f16(src)
            out[self.e:] = 0
            out[:, self.o_zero_cols] = 0
        elif part in ("mlp.gate_proj", "mlp.up_proj"):
            out[:self.i, :self.e] = self._f16(src)
        else:  # down_proj
            out[:self.e, :self.i] = self._f16(src)
            out[self.e:] = 0
            out[:, self.i:] = 0
        return out


# ---------------------------------------------------------------------------------------------------- the writer

def _shards(plan, shard_bytes: int) -> list[list]:
    shards, cur, size = [], [], 0
    for item in plan:
        nbytes = 2 * math.prod(item[1])
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


def _write_shard(path: Path, items, bar) -> None:
    """One safetensors file, written tensor by tensor (header first: every shape is known in advance)."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shp, _ in items:
        n = 2 * math.prod(shp)
        header[name] = {"dtype": "F16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shp, make in items:
            arr = np.ascontiguousarray(make(), dtype="<f2")
            if arr.shape != tuple(shp):
                raise AssertionError(f"{name}: made {arr.shape}, planned {shp}")
            f.write(memoryview(arr).cast("B"))
            bar.update(arr.nbytes)
            del arr


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _recipe(src: Source, shape: Shape, seed: int, vocab_size: int) -> dict:
    files = sorted(src.path.glob("*.safetensors"))
    out = {"format": FORMAT_VERSION, "source_weights_sha256": _sha256_files(files),
           "source_shape": asdict(src.shape), "shape": asdict(shape), "seed": seed}
    if vocab_size != src.vocab_size:  # absent when unpadded: earlier stand-ins keep their recipe
        out["vocab_size"] = vocab_size
    return out


def check_vocab(src: Source, vocab_size) -> int:
    """The stand-in's vocabulary size: the source's when None, else at least the source's."""
    if vocab_size is None:
        return src.vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < src.vocab_size:
        raise StandinError(f"vocab_size: expected an integer >= {src.vocab_size} (the source's; padded ids are added "
                           f"after the source's), got {vocab_size!r}")
    return vocab_size


def make_standin(source_dir, out_dir, shape, seed: int = 0, *, vocab_size: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True, force: bool = False,
                 name: str | None = None, genai_builder: bool = True) -> dict:
    """Inflate the Llama checkpoint `source_dir` to `shape` (a Shape or a dict of its fields) into `out_dir`,
    its vocabulary padded to `vocab_size` when given (see the module's docstring). genai_builder=False drops the
    check that keeps every projection narrower or wider than the vocabulary (check_shape), for stand-ins that
    ONNX Runtime GenAI's builder never reads.

    Returns standin.json's record (recipe, parameter count, bytes, files, wall seconds). When `out_dir` already
    holds a stand-in of the same recipe, returns its record without remaking it (force=True remakes it); any other
    non-empty `out_dir` is refused.
    """
    t0 = time.perf_counter()
    src = read_source(source_dir)
    shape = Shape.of(shape)
    check_shape(src, shape, genai_builder)
    vocab_size = check_vocab(src, vocab_size)
    for name_, width in (("intermediate_size", shape.intermediate_size), ("hidden_size", shape.hidden_size)):
        if vocab_size != src.vocab_size and width == vocab_size:
            raise StandinError(f"shape.{name_}: expected a width other than vocab_size {vocab_size} (ONNX Runtime "
                               f"GenAI's builder takes any linear layer of vocabulary width for the LM head), "
                               f"got {width}")
    out_dir = Path(out_dir)
    recipe = _recipe(src, shape, seed, vocab_size)
    record_path = out_dir / "standin.json"
    if out_dir.exists():
        old = json.loads(record_path.read_text()) if record_path.is_file() else None
        if old is None and any(out_dir.iterdir()):
            raise StandinError(f"{out_dir}: out: expected an empty folder or an earlier stand-in, got a folder "
                               f"with other files (not overwritten)")
        if old is not None and old.get("recipe") == recipe and not force:
            return dict(old, reused=True)
    vocab = None
    if vocab_size > src.vocab_size:
        vocab = {"source": src.vocab_size, "size": vocab_size, **pick_sink(src, vocab_size - src.vocab_size)}
    _, weights = load_checkpoint(src.path)
    inflater = _Inflater(src, weights, shape, seed, vocab_size, vocab and vocab["sink"])
    plan = inflater.plan()
    shards = _shards(plan, shard_bytes)
    total = sum(2 * math.prod(shp) for _, shp, _ in plan)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    from tqdm import tqdm
    weight_map, files = {}, []
    with tqdm(total=total, unit="B", unit_scale=True, desc=name or out_dir.name, disable=not progress,
              file=sys.stderr) as bar:
        for k, items in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(tmp / fname, items, bar)
            files.append(fname)
            weight_map.update({n: fname for n, _, _ in items})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    cfg = dict(src.config)
    cfg.update(asdict(shape))
    cfg.update(architectures=["LlamaForCausalLM"], rms_norm_eps=src.eps * src.shape.hidden_size / shape.hidden_size,
               dtype="float16", vocab_size=vocab_size)
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in COPIED_FILES:
        if (src.path / f).is_file():
            shutil.copy2(src.path / f, tmp / f)
    record = {"kind": "edgespec-standin", "name": name, "source": _shown(src.path), "recipe": recipe,
              "params": param_count(shape, vocab_size, src.tied), "bytes": total, "files": files,
              "rms_norm_eps": cfg["rms_norm_eps"], "norm_weight_scale": inflater.norm_scale,
              "q_scale": inflater.q_scale,
              "real_layers": layer_positions(src.shape.num_hidden_layers, shape.num_hidden_layers),
              "real_q_heads": q_head_map(src.shape, shape).tolist(),
              "vocab_size": vocab_size, **({"padded_vocab": vocab} if vocab else {}),
              "wall_s": round(time.perf_counter() - t0, 2)}
    (tmp / "standin.json").write_text(json.dumps(record, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # an earlier stand-in (checked above)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out_dir)
    return record


# ------------------------------------------------------------------------------------------------------- the CLI

def _shown(path: Path) -> str:
    """A path as a record keeps it: relative to the repository when inside it (no machine's absolute path)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def default_out(preset: str, vocab: str = "source") -> Path:
    """Where a preset's pair goes by default: .cache/standins/PRESET, or PRESET-real-vocab."""
    return DEFAULT_OUT / (preset if vocab == "source" else f"{preset}-{vocab}-vocab")


def _parse_shape(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise StandinError(f"--shape: expected FIELD=INT pairs separated by commas, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def preset_vocab_size(preset: Preset, vocab: str) -> int | None:
    """The vocab_size make_standin pads to: None for "source", the real model's for "real"."""
    preset.shape("target", vocab)  # checks `vocab`
    return preset.real.vocab_size if vocab == "real" else None


def list_presets() -> str:
    lines = []
    demo_vocab = read_source(DEMO_TARGET).vocab_size if (DEMO_TARGET / "config.json").is_file() else 4096
    for name, p in PRESETS.items():
        real = p.real.params
        lines.append(f"{name}: like {p.real.name} ({real / 1e6:.0f}M params, vocab {p.real.vocab_size})")
        for vocab in VOCABS:
            v = preset_vocab_size(p, vocab) or demo_vocab
            ts, ds = p.shape("target", vocab), p.shape("draft", vocab)
            t, d = param_count(ts, v), param_count(ds, v)
            gap = (f"{(real - t) / 1e6:.0f}M fewer than the real model, {100 * (real - t) / real:.0f}%" if t < real
                   else f"{(t - real) / 1e6:.1f}M more than the real model, {100 * (t - real) / real:.0f}%" if t > real
                   else "the real model's count")
            lines.append(f"  --vocab {vocab} ({v}):")
            lines.append(f"    target  {ts.brief()}: {t / 1e6:.1f}M params, {_fmt_bytes(2 * t)} fp16 ({gap})")
            lines.append(f"    draft   {ds.brief()}: {d / 1e6:.1f}M params, {_fmt_bytes(2 * d)} fp16 "
                         f"({t / d:.0f}x smaller)")
        lines.append(f"  differs {p.differs}")
    return "\n".join(lines)


def widen_attention_head(src: Path, out: Path, e2: int) -> None:
    """An attention feature head (edgespec/attn_head.py) for a stand-in of its target: the stand-in's final hidden
    state and its embeddings are the source's in their first E dims and exactly zero in the padded ones, so W_in's
    rows reading padded dims and W_out's columns writing them are zero, and every proposal is the source head's."""
    from edgespec.attn_head import AttnHeadWeights
    w = AttnHeadWeights.load(src)
    e, h = w.w_out.shape[1], w.w_out.shape[0]
    if e2 < e:
        raise ValueError(f"{src}: a stand-in is at least as wide as its source ({e}), got {e2}")

    def cols(a):  # (X, E) -> (X, E2)
        return np.concatenate([a, np.zeros((a.shape[0], e2 - e), a.dtype)], 1)
    pad = np.zeros((e2 - e, h), w.w_in.dtype)
    w_in = np.concatenate([w.w_in[:e], pad, w.w_in[e:], pad], 0)  # [f, e(x)] each widened to E2
    AttnHeadWeights(w_in, w.b_in, w.norm1, w.w_qkv, w.w_o, w.norm2, w.w_gu, w.w_down, w.norm3, cols(w.w_out),
                    cols(w.b_out[None])[0], cols(w.embed), cols(w.lm), w.heads, w.eps).save(out)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m edgespec.export.standin",
                                 description="make a real-size stand-in checkpoint from a small Llama checkpoint "
                                             "(same function; docs/standins.md)")
    ap.add_argument("--list", action="store_true", help="print the presets with parameter counts and bytes")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a preset shape pair (target from models/demo-target, "
                    "draft from models/demo-draft)")
    ap.add_argument("--role", choices=("both", "target", "draft"), default="both",
                    help="with --preset: which to make, into OUT/target and OUT/draft (default both)")
    ap.add_argument("--source", help="with --shape: the source checkpoint folder (default models/demo-target)")
    ap.add_argument("--shape", help="a custom shape: hidden_size=..,num_attention_heads=..,num_key_value_heads=..,"
                    "head_dim=..,intermediate_size=..,num_hidden_layers=.. (written into OUT itself)")
    ap.add_argument("--vocab", choices=VOCABS, default="source",
                    help="with --preset: the source's vocabulary (default) or the real model's, padded (the real "
                         "model's bytes and LM-head shape; a narrower draft)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="with --shape: pad the vocabulary to this many ids (default: the source's)")
    ap.add_argument("--out", help="output folder (default .cache/standins/PRESET, or PRESET-real-vocab)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dead weights (default 0)")
    ap.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20, help="max MiB per shard (default 1024)")
    ap.add_argument("--force", action="store_true", help="remake even when OUT holds the same recipe")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.list:
            print(list_presets())
            return 0
        if bool(a.preset) == bool(a.shape):
            raise StandinError("arguments: expected exactly one of --preset, --shape (or --list), got "
                               + ("both" if a.preset else "neither"))
        kw = dict(seed=a.seed, shard_bytes=a.shard_mb << 20, progress=not a.no_progress, force=a.force)
        jobs = []
        if a.preset:
            if a.vocab_size is not None:
                raise StandinError("--vocab-size: expected only with --shape (a preset takes --vocab), got "
                                   f"{a.vocab_size}")
            p = PRESETS[a.preset]
            out = Path(a.out) if a.out else default_out(a.preset, a.vocab)
            for role in (("target", "draft") if a.role == "both" else (a.role,)):
                jobs.append((DEMO_TARGET if role == "target" else DEMO_DRAFT, out / role,
                             p.shape(role, a.vocab), f"{a.preset}/{role}", preset_vocab_size(p, a.vocab)))
        else:
            if not a.out:
                raise StandinError("--out: expected a folder for a custom --shape, got nothing")
            if a.vocab != "source":
                raise StandinError(f"--vocab: expected only with --preset (--shape takes --vocab-size), got {a.vocab}")
            jobs.append((Path(a.source) if a.source else DEMO_TARGET, Path(a.out), _parse_shape(a.shape), None,
                         a.vocab_size))
        for source, out, shape, name, vocab_size in jobs:
            rec = make_standin(source, out, shape, name=name, vocab_size=vocab_size, **kw)
            how = "up to date, not remade" if rec.get("reused") else f"made in {rec['wall_s']:.1f} s"
            print(f"{out}: {rec['params'] / 1e6:.1f}M params, {_fmt_bytes(rec['bytes'])} in {len(rec['files'])} "
                  f"shard(s), {how}")
    except (StandinError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

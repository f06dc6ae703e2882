"""The native engine's weights file (native.npz) and its packed layouts: what `edgespec export` writes and
`backends/native.py` loads (engine.json's extra["native"] records the layout: format, features, rotary_dim,
ropes, activation, weights; expected_shapes reads them).

Matrices are packed in panels of PANEL output columns: float16 values, or blocks of QB int8 / int4 values
along the input with one float16 scale per block and output column (w = q * scale). The numpy references
here (dequantize, matmul_reference) are the slow, obvious versions of native_step.c's products.
"""
from __future__ import annotations

import numpy as np

from ..contract import Manifest

NATIVE_FILE = "native.npz"
LAYER_KEYS = ("ln1", "ln2", "wqkv", "wo", "wgu", "wd")  # per layer, as "layers.{i}.{key}"
OPTIONAL_KEYS = ("bqkv", "bo", "qn", "kn", "post_attn", "post_mlp")  # per layer where the model has them
FORMAT = 3  # native.npz's layout (extra["native"]["format"]; absent: 1, one rotary over all dims, no options;
#            2: float16 matrices only; 3: integer blocks too (pack_blocks), read as 2 when the weights are float16)
# extra["native"]["features"]: what the folder's model uses beyond a plain Llama, and the arrays each adds
FEATURES = {"qkv_bias": ("bqkv",), "o_bias": ("bo",), "qk_norm": ("qn", "kn"), "sandwich_norm": ("post_attn", "post_mlp"),
            "gelu_tanh": (), "embed_scale": (), "attn_scale": (), "partial_rotary": (), "several_rotaries": (),
            "layers_without_rotary": (), "windows": ()}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # es_model.act

PANEL = 16  # output columns per packed panel (native_step.c)
QB = 32  # integer weights: values per block along the input (native_step.c's QB)
# extra["native"]["weights"] -> native_step.c's ES_F16 / ES_Q8 / ES_Q4, and bytes per (block, panel)
WEIGHT_KINDS = {"float16": 0, "int8": 1, "int4": 2}
BLOCK_BYTES = {"int8": 32 + QB * 16, "int4": 32 + QB * 8}


def pack(w: np.ndarray) -> np.ndarray:
    """(N, K) float16, PyTorch's Linear layout -> (N/PANEL, K, PANEL): panel p holds columns p*PANEL.. with
    input k's weights in row k, the layout native_step.c streams."""
    n, k = w.shape
    if n % PANEL:
        raise ValueError(f"a packed matrix needs a multiple of {PANEL} output columns, got {n}")
    return np.ascontiguousarray(w.reshape(n // PANEL, PANEL, k).transpose(0, 2, 1))


def quantize_blocks(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) float weights -> q (N, K) int8 and scales (N, K/QB) float16, w ~ q * scale per block of QB along K,
    rounded to nearest with the float16 scale. int8: scale = max |w| / 127, q in -127..127. int4 (llama.cpp's
    q4_0 rule): scale = -(the block's value of largest magnitude) / 8, so that value is exactly -8 and the
    rest fall in -8..7."""
    n, k = w.shape
    if kind not in BLOCK_BYTES or k % QB:
        raise ValueError(f"quantize_blocks: kind must be one of {sorted(BLOCK_BYTES)} and K a multiple of {QB}; "
                         f"got {kind!r}, K = {k}")
    b = np.asarray(w, np.float32).reshape(n, k // QB, QB)
    if kind == "int8":
        scale, lo, hi = np.abs(b).max(axis=2) / np.float32(127), -127, 127
    else:
        idx = np.abs(b).argmax(axis=2)
        scale, lo, hi = np.take_along_axis(b, idx[..., None], 2)[..., 0] / np.float32(-8), -8, 7
    s16 = scale.astype(np.float16)
    s32 = s16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32[..., None] != 0, np.rint(b / s32[..., None]), 0)
    return np.clip(q, lo, hi).astype(np.int8).reshape(n, k), s16


def pack_blocks(q: np.ndarray, scales: np.ndarray, kind: str) -> np.ndarray:
    """q (N, K) int8 and scales (N, K/QB) float16 -> (N/PANEL, K/QB, BLOCK_BYTES[kind]) uint8, native_step.c's
    layout: per panel and block, its 16 columns' scales, then the values as unsigned bytes in groups of 64 that
    AVX-512 VNNI sums 4 at a time (byte 4 c + t of group g: int8: q[4 g + t][c] + 128; int4: q[8 g + t][c] + 8
    in the low nibble, q[8 g + 4 + t][c] + 8 in the high one)."""
    n, k = q.shape
    if n % PANEL or k % QB:
        raise ValueError(f"a packed matrix needs a multiple of {PANEL} outputs and of {QB} inputs, got ({n}, {k})")
    p, nb = n // PANEL, k // QB
    sb = np.ascontiguousarray(scales.astype(np.float16).reshape(p, PANEL, nb).transpose(0, 2, 1)).view(np.uint8)
    qq = q.reshape(p, PANEL, nb, QB).astype(np.int16)  # (P, c, nb, k)
    if kind == "int8":  # (P, nb, g, c, t) with k = 4 g + t
        u = (qq + 128).astype(np.uint8).reshape(p, PANEL, nb, QB // 4, 4).transpose(0, 2, 3, 1, 4)
        body = u.reshape(p, nb, QB * PANEL)
    else:  # (P, nb, g, half, c, t) with k = 8 g + 4 half + t
        u = (qq + 8).astype(np.uint8).reshape(p, PANEL, nb, QB // 8, 2, 4).transpose(0, 2, 3, 4, 1, 5)
        body = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).reshape(p, nb, QB * PANEL // 2)
    return np.ascontiguousarray(np.concatenate([sb.reshape(p, nb, 2 * PANEL), body], axis=2))


def unpack_blocks(packed: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """pack_blocks' inverse: -> q (N, K) int8, scales (N, K/QB) float16."""
    p, nb, _ = packed.shape
    sc = np.ascontiguousarray(packed[:, :, :2 * PANEL]).view(np.float16).reshape(p, nb, PANEL)
    body = packed[:, :, 2 * PANEL:].astype(np.int16)
    if kind == "int8":  # (P, nb, g, c, t) -> (P, c, nb, g, t)
        qq = (body.reshape(p, nb, QB // 4, PANEL, 4) - 128).transpose(0, 3, 1, 2, 4)
    else:  # (P, nb, g, c, t) nibbles -> (P, c, nb, g, half, t)
        b = body.reshape(p, nb, QB // 8, PANEL, 4)
        qq = np.stack([(b & 15) - 8, (b >> 4) - 8], axis=3).transpose(0, 4, 1, 2, 3, 5)
    q = qq.reshape(p * PANEL, nb * QB).astype(np.int8)
    return q, sc.transpose(0, 2, 1).reshape(p * PANEL, nb)


def dequantize(packed: np.ndarray, kind: str) -> np.ndarray:
    """The weights a packed matrix holds, (N, K) float32: q * scale, exactly (the slow obvious reference of the
    integer kernels)."""
    if kind == "float16":
        n_p, k, _ = packed.shape
        return packed.transpose(0, 2, 1).reshape(n_p * PANEL, k).astype(np.float32)
    q, s = unpack_blocks(packed, kind)
    return (q.reshape(q.shape[0], -1, QB).astype(np.float32) * s.astype(np.float32)[..., None]).reshape(q.shape)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """native_step.c's quantize_row in numpy: rows x (T, K) float32 -> xq (T, K) int8 = round(x 127 / max|x|)
    per block of QB, and dx (T, K/QB) float32 = max|x| / 127 (0 for an all-zero block)."""
    t, k = x.shape
    b = np.asarray(x, np.float32).reshape(t, k // QB, QB)
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8).reshape(t, k)
    return xq, (amax / np.float32(127)).astype(np.float32)


def matmul_reference(x: np.ndarray, packed: np.ndarray, kind: str) -> np.ndarray:
    """What es_matmul computes, the slow obvious way: x (T, K) float32 @ the packed matrix -> (T, N) float32.
    float16: float32 products of the widened weights. int8 / int4: the rows quantized (quantize_activations),
    each block's exact integer dot product, then y = fma(dot, dx * scale, y) over the blocks in order (the fma
    done in float64 and rounded once: equal to native_step.c's but in rare double-rounding cases)."""
    x = np.asarray(x, np.float32)
    if kind == "float16":
        return (x.astype(np.float64) @ dequantize(packed, kind).astype(np.float64).T).astype(np.float32)
    q, s = unpack_blocks(packed, kind)
    xq, dx = quantize_activations(x)
    t, k = x.shape
    n, nb = q.shape[0], k // QB
    dots = np.einsum("tbk,nbk->tnb", xq.reshape(t, nb, QB).astype(np.int64), q.reshape(n, nb, QB).astype(np.int64))
    y = np.zeros((t, n), np.float32)
    for b in range(nb):  # ds = dx * scale rounded to float32, then one rounding of dot * ds + y
        ds = (dx[:, b:b + 1] * s[:, b].astype(np.float32)[None, :]).astype(np.float32)
        y = (dots[:, :, b].astype(np.float64) * ds.astype(np.float64) + y.astype(np.float64)).astype(np.float32)
    return y


def head_rows(vocab_size: int) -> int:
    """The lm_head's packed rows: the vocabulary rounded up to whole panels. The rows past the vocabulary are
    zeros, so their logits are 0; the step's argmax never reads them, and the decoders hand out the vocabulary's
    columns only (engine.json's extra.native.head_rows records it where it differs from vocab_size)."""
    return -(-vocab_size // PANEL) * PANEL


def packed_shape(n: int, k: int, kind: str) -> tuple:
    """The shape of an (N, K) matrix packed as `kind` (pack, pack_blocks)."""
    return (n // PANEL, k, PANEL) if kind == "float16" else (n // PANEL, k // QB, BLOCK_BYTES[kind])


def expected_shapes(m: Manifest, info: dict) -> dict[str, tuple]:
    """native.npz's arrays and their shapes for manifest m and its extra["native"] record `info` (matrices
    packed as info["weights"] / info["head_weights"] say: packed_shape; the optional arrays of
    info["features"])."""
    e, h, hk, d, v = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size
    inter, n_layers = int(info["intermediate_size"]), m.num_layers
    rot, ropes = int(info.get("rotary_dim", d)), int(info.get("ropes", 1))
    kind = info.get("weights", "float16")
    packed = lambda n, k: packed_shape(n, k, kind)  # noqa: E731
    rows = int(info.get("head_rows", v))
    shapes = {"embed": (v, e), "lm_head": packed_shape(rows, e, info.get("head_weights", kind)), "norm": (e,),
              "inv_freq": (ropes, rot // 2),
              "rope_scale": (ropes,), "layer_rope": (n_layers,), "layer_window": (n_layers,), "scalars": (3,)}
    optional = {"bqkv": ((h + 2 * hk) * d,), "bo": (e,), "qn": (d,), "kn": (d,), "post_attn": (e,), "post_mlp": (e,)}
    present = [k for f in info.get("features", []) for k in FEATURES.get(f, ())]
    for i in range(n_layers):
        shapes.update({f"layers.{i}.ln1": (e,), f"layers.{i}.ln2": (e,),
                       f"layers.{i}.wqkv": packed((h + 2 * hk) * d, e), f"layers.{i}.wo": packed(e, h * d),
                       f"layers.{i}.wgu": packed(2 * inter, e), f"layers.{i}.wd": packed(e, inter)})
        shapes.update({f"layers.{i}.{k}": optional[k] for k in present})
    return shapes


def upgrade_format1(arrays: dict[str, np.ndarray], m: Manifest) -> None:
    """A native.npz of format 1 (exported before the families: one rotary over all head dims, scalars = eps
    and its scaling, no options) -> format 2's arrays, in place."""
    eps, scale = (float(x) for x in arrays.pop("scalars"))
    arrays["scalars"] = np.array([eps, 1.0, 1.0 / np.sqrt(np.float32(m.head_dim))], np.float32)
    arrays["inv_freq"] = np.ascontiguousarray(arrays["inv_freq"].reshape(1, -1))
    arrays["rope_scale"] = np.array([scale], np.float32)
    arrays["layer_rope"] = np.zeros(m.num_layers, np.int64)
    arrays["layer_window"] = np.zeros(m.num_layers, np.int64)


def manifest_windows(m: Manifest) -> list[int]:
    """Each layer's window as engine.json says (0: every row): layer_windows, else the uniform sliding_window."""
    if m.layer_windows:
        return [int(w or 0) for w in m.layer_windows]
    return [int(m.sliding_window or 0)] * m.num_layers

"""The native CPU engine (provider "cpu-native"): one C call per decoder step, float32 math over float16 weights
or blocks of int8 / int4 weights.

A checkpoint stored in float16 (the bundled pair is) is exported to an fp32 ONNX graph whose weights are
those float16 values widened: 4 bytes read per weight and token, where 2 hold the same number. Decoding on
the CPU is bound by reading the weights, so `native_step.c` keeps them as float16, widens each on the fly
(exactly) and accumulates in float32: the same function as the fp32 engine, in another summation order (the
export gate and the tests compare the two), at half the weight bytes per token. int8 and int4 folders carry
integer weights (WEIGHT_KINDS): blocks of 32 values along the input with one float16 scale per block and
output column, w = q * scale, read at 1.06 / 0.56 bytes per weight; the arithmetic stays float32.

    engine folder: engine.json, whose extra["native"] names
                   native.npz   the weights (matrices in packed panels of float16 or of integer blocks:
                                extra["native"]["weights"] and ["head_weights"] say which; float32 norms,
                                biases, rope frequencies and scalings; int64 per-layer rotary index and
                                window), written by `edgespec export` (or `python -m edgespec.export.native`);
                                extra["native"] records its layout (format 2, features, rotary_dim, ropes,
                                activation, weights: expected_shapes reads them)

Every family export/checkpoint.py reads runs here (native_step.c's header lists the per-layer computation);
the load checks native.npz against engine.json (shapes, the features' arrays and no others, the per-layer
windows against layer_windows). A format 1 file (before the families: plain Llama) is read as format 2.

The C source is compiled on first use with the system C compiler (`cc`, pthreads) for this CPU, into
$EDGESPEC_CACHE (default ~/.cache/edgespec)/native/; `NativeEngine.decoder(batch)` gives a `Decoder` whose
calls run that step on the same KV cache (B, Hkv, T, D), written in place at the committed lengths: one C
call per decoder call, the batch's rows through each weight matrix together.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from .contract import EngineError, Manifest, checked_folder, file_sha256
from .decoder import Decoder
from .kvcache import KVCache
from .memory import HostMemory

SOURCE = Path(__file__).with_name("native_step.c")
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


def cache_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec") / "native"


def compiler() -> str | None:
    """$CC (a name on PATH or a path), else cc or gcc on PATH; None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def build_library() -> Path:
    """Compile native_step.c for this CPU (once per source and compiler): -> the shared library's path."""
    cc = compiler()
    if cc is None:
        raise EngineError("provider 'cpu-native' compiles edgespec/native_step.c on first use and found no C "
                          f"compiler (CC={os.environ.get('CC')!r}, cc, gcc): install one (Debian/Ubuntu: apt-get install gcc), or use "
                          "provider 'cpu'")
    # EDGESPEC_NATIVE_MARCH: the target CPU (default: this one; the tests also build "x86-64", the portable C path)
    flags = ["-O3", f"-march={os.environ.get('EDGESPEC_NATIVE_MARCH', 'native')}", "-pthread", "-shared", "-fPIC",
             "-std=gnu11"]
    # EDGESPEC_NATIVE_CFLAGS: more flags (the tests' -DES_TEST_STALL: helpers that stall, native_step.c's pool)
    flags += os.environ.get("EDGESPEC_NATIVE_CFLAGS", "").split()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags]).encode()
                         + subprocess.run([cc, "--version"], capture_output=True).stdout).hexdigest()[:16]
    out = cache_dir() / f"edgespec_step-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, str(SOURCE), "-o", tmp, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise EngineError(f"provider 'cpu-native': compiling {SOURCE} failed ({' '.join(cmd)}):\n{r.stderr.strip()}")
    os.replace(tmp, out)  # atomic: a concurrent build writes the same bytes
    return out


class _Model(ctypes.Structure):
    """native_step.c's es_model, field for field."""
    _fields_ = [(n, ctypes.c_int64) for n in ("E", "H", "Hkv", "D", "I", "V", "L", "argmax_lo", "argmax_hi", "R",
                                              "n_ropes", "act", "wkind", "head_kind")] + [
        ("eps", ctypes.c_float), ("embed_scale", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("inv_freq", ctypes.c_void_p), ("rope_scale", ctypes.c_void_p), ("layer_rope", ctypes.c_void_p),
        ("layer_window", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
        ("norm", ctypes.c_void_p)] + [(k, ctypes.POINTER(ctypes.c_void_p)) for k in LAYER_KEYS + OPTIONAL_KEYS]


def _library(path: Path):
    lib = ctypes.CDLL(str(path))
    P = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.es_forward.argtypes = [ctypes.POINTER(_Model), i64, i64, P, P, P, P, i64, P, P, P, P, ctypes.c_int]
    lib.es_forward.restype = ctypes.c_int
    lib.es_scratch_floats.argtypes = [ctypes.POINTER(_Model), i64]
    lib.es_scratch_floats.restype = i64
    lib.es_matmul.argtypes = [ctypes.c_int, P, i64, P, i64, i64, P, ctypes.c_int]
    lib.es_matmul.restype = ctypes.c_int
    lib.es_quiesce.argtypes = []
    lib.es_quiesce.restype = None
    lib.es_stolen.argtypes = []
    lib.es_stolen.restype = i64
    lib.es_profile.argtypes = [P, ctypes.c_int]
    lib.es_profile.restype = ctypes.c_int
    lib.es_model_layout.argtypes = [ctypes.POINTER(i64)]
    lib.es_model_layout.restype = i64
    off = i64()
    size = lib.es_model_layout(ctypes.byref(off))
    if size != ctypes.sizeof(_Model) or off.value != _Model.inv_freq.offset:
        raise EngineError(f"{path}: es_model is {size} bytes (pointers from {off.value}) in C, "
                          f"{ctypes.sizeof(_Model)} ({_Model.inv_freq.offset}) in native.py: they must agree")
    return lib


_LIBS: dict[Path, ctypes.CDLL] = {}


def library():
    """The compiled step for this process's flags, loaded once (its helper threads serve every engine)."""
    path = build_library()
    if path not in _LIBS:
        _LIBS[path] = _library(path)
    return _LIBS[path]


PANEL = 16  # output columns per packed panel (native_step.c)
QB = 32  # integer weights: values per block along the input (native_step.c's QB)
# extra["native"]["weights"] -> native_step.c's ES_F16 / ES_Q8 / ES_Q4, and bytes per (block, panel)
WEIGHT_KINDS = {"float16": 0, "int8": 1, "int4": 2}
BLOCK_BYTES = {"int8": 32 + QB * 16, "int4": 32 + QB * 8}


JOB_KINDS = ("norm", "add_norm", "matmul", "kv", "attention", "activation", "argmax", "quantize")  # native_step.c


def profile(reset: bool = True) -> dict[str, dict]:
    """Where the native step's calls spent their time since the last reset, by job kind (JOB_KINDS):
    {kind: {"jobs": n, "ms": the calling thread's wall time in them, "wait_ms": of which waiting for helper
    threads to finish chunks they had claimed}}. Counted in every build; reading costs a few microseconds."""
    lib = library()
    out = np.zeros(3 * len(JOB_KINDS), np.int64)
    if lib.es_profile(out.ctypes.data, int(reset)) != len(JOB_KINDS):
        raise EngineError(f"{SOURCE}: es_profile counts other job kinds than native.py's {JOB_KINDS}")
    n = len(JOB_KINDS)
    return {k: {"jobs": int(out[i]), "ms": out[n + i] / 1e6, "wait_ms": out[2 * n + i] / 1e6}
            for i, k in enumerate(JOB_KINDS)}


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
    shapes = {"embed": (v, e), "lm_head": packed_shape(v, e, info.get("head_weights", kind)), "norm": (e,), "inv_freq": (ropes, rot // 2),
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


class NativeEngine:
    """An engine folder's native weights, ready for `decoder()`; checked against engine.json at load."""

    provider = "cpu-native"

    def __init__(self, engine_dir: str | Path, threads: int | None = None, check_hashes: bool = True):
        self.dir, self.manifest = checked_folder(engine_dir, check_hashes)
        m = self.manifest
        info = m.extra.get("native") or {}
        if not info.get("file"):
            why = info.get("unavailable", "it was exported before native weights existed")
            raise EngineError(f"{self.dir}: no native weights for provider 'cpu-native' ({why}); add them with "
                              f"`python -m edgespec.export.native {self.dir} --checkpoint CHECKPOINT_DIR`, or use "
                              f"provider 'cpu'")
        path = self.dir / info["file"]
        if not path.is_file():
            raise EngineError(f"{self.dir}: native weights {info['file']} named in engine.json are missing")
        if check_hashes and info.get("sha256") and file_sha256(path) != info["sha256"]:
            raise EngineError(f"{path}: sha256 differs from engine.json's extra.native.sha256 (changed after export)")
        if m.input_mode != "ids" or m.kind != "decoder":  # its cache is its own, float32 whatever engine.json's
            raise EngineError(f"{self.dir}: provider 'cpu-native' runs ids-input decoders; this folder has "
                              f"input_mode {m.input_mode!r}, kind {m.kind!r}: use provider 'cpu'")
        fmt = int(info.get("format", 1))
        if fmt not in (1, 2, FORMAT) or (fmt < 3 and info.get("weights", "float16") != "float16"):
            raise EngineError(f"{path}: native weights of format {fmt} ({info.get('weights', 'float16')}); this "
                              f"edgespec reads formats 1 and 2 (float16) and {FORMAT} "
                              f"(re-add them with `python -m edgespec.export.native {self.dir} --checkpoint ...`)")
        with np.load(path) as z:
            self.arrays = {k: np.ascontiguousarray(z[k]) for k in z.files}
        if fmt == 1 and "scalars" in self.arrays and self.arrays["scalars"].shape == (2,):
            upgrade_format1(self.arrays, m)
        intermediate = int(info["intermediate_size"])
        kinds = {k: info.get(k, "float16") for k in ("weights", "head_weights")}
        odd = {k: v for k, v in kinds.items() if v not in WEIGHT_KINDS}
        if odd:
            raise EngineError(f"{path}: engine.json's extra.native says " + ", ".join(
                f"{k} {v!r}" for k, v in odd.items()) + f": the native step reads {sorted(WEIGHT_KINDS)}")
        want = expected_shapes(m, info)
        a = self.arrays
        bad = [f"{k}: expected {s}, got {a[k].shape if k in a else 'nothing'}"
               for k, s in want.items() if k not in a or a[k].shape != s]
        bad += [f"{k}: not expected (engine.json's extra.native.features: {info.get('features', [])})"
                for k in sorted(set(a) - set(want))]
        unknown = sorted(set(info.get("features", [])) - set(FEATURES))
        if unknown:
            bad.append(f"features {unknown} are not computed by this edgespec's native step")
        for what, n in (("hidden_size", m.hidden_size), ("vocab_size", m.vocab_size),
                        ("num_heads x head_dim", m.num_heads * m.head_dim), ("intermediate_size", intermediate)):
            if n % PANEL:
                bad.append(f"{what} must be a multiple of {PANEL} (native_step.c's panels), got {n}")
        if info.get("weights", "float16") != "float16":
            for what, n in (("hidden_size", m.hidden_size), ("num_heads x head_dim", m.num_heads * m.head_dim),
                            ("intermediate_size", intermediate)):
                if n % QB:
                    bad.append(f"{what} must be a multiple of {QB} for integer weights (blocks along K), got {n}")
        if m.head_dim % 8:
            bad.append(f"head_dim must be a multiple of 8, got {m.head_dim}")
        if m.head_dim > 512 or m.num_heads % m.num_kv_heads:
            bad.append(f"head_dim <= 512 and num_heads a multiple of num_kv_heads, got {m.head_dim}, "
                       f"{m.num_heads}/{m.num_kv_heads}")
        rot = int(info.get("rotary_dim", m.head_dim))
        if not (0 < rot <= m.head_dim and rot % 2 == 0):
            bad.append(f"rotary_dim must be even and in 1..head_dim {m.head_dim}, got {rot}")
        if info.get("activation", "silu") not in ACTIVATIONS:
            bad.append(f"activation {info.get('activation')!r}: the native step computes {sorted(ACTIVATIONS)}")
        if not bad:  # the per-layer tables against engine.json and the record
            if a["layer_window"].tolist() != manifest_windows(m):
                bad.append(f"layer_window {a['layer_window'].tolist()} differs from engine.json's windows "
                           f"{manifest_windows(m)}")
            ropes = want["rope_scale"][0]
            if not all(-1 <= j < ropes for j in a["layer_rope"].tolist()):
                bad.append(f"layer_rope {a['layer_rope'].tolist()} names rotaries outside -1..{ropes - 1}")
        if bad:
            raise EngineError(f"{path}: does not fit {self.dir}/engine.json:\n  - " + "\n  - ".join(bad))
        self.info = info
        self.intermediate = intermediate
        self.threads = threads or int(os.environ.get("EDGESPEC_THREADS", 0)) or os.cpu_count() or 1
        self.lib = library()
        self.model = self._model()

    def _model(self) -> _Model:
        m, a, info = self.manifest, self.arrays, self.info
        lo, hi = m.argmax_range
        eps, embed_scale, attn_scale = (float(x) for x in a["scalars"])
        for k in ("layer_rope", "layer_window"):
            a[k] = np.ascontiguousarray(a[k], np.int64)
        for k in ("inv_freq", "rope_scale"):
            a[k] = np.ascontiguousarray(a[k], np.float32)
        kind = info.get("weights", "float16")
        st = _Model(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, self.intermediate, m.vocab_size,
                    m.num_layers, lo, hi, int(info.get("rotary_dim", m.head_dim)), a["rope_scale"].shape[0],
                    ACTIVATIONS[info.get("activation", "silu")], WEIGHT_KINDS[kind],
                    WEIGHT_KINDS[info.get("head_weights", kind)], eps, embed_scale, attn_scale,
                    a["inv_freq"].ctypes.data, a["rope_scale"].ctypes.data, a["layer_rope"].ctypes.data,
                    a["layer_window"].ctypes.data, a["embed"].ctypes.data, a["lm_head"].ctypes.data,
                    a["norm"].ctypes.data)
        self._tables = []  # keeps the pointer tables alive with the struct
        for key in LAYER_KEYS + OPTIONAL_KEYS:
            if f"layers.0.{key}" not in a:
                continue  # an absent option: NULL
            table = (ctypes.c_void_p * m.num_layers)(*[a[f"layers.{i}.{key}"].ctypes.data for i in range(m.num_layers)])
            self._tables.append(table)
            setattr(st, key, ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p)))
        return st

    def decoder(self, batch: int = 1, embedding: np.ndarray | None = None) -> "NativeDecoder":
        return NativeDecoder(self, batch)


class _Outputs:
    """The last call's outputs, shaped like decoder._Binding's (logits, ids, hidden)."""

    def __init__(self, memory: HostMemory, b: int, s: int, m: Manifest):
        self.logits = memory.zeros((b, s, m.vocab_size), np.float32)
        self.ids = memory.zeros((b, s), np.int64)
        self.hidden = memory.zeros((b, s, m.hidden_size), np.float32) if m.has_hidden else None


class NativeDecoder(Decoder):
    """decoder.Decoder's interface (run / ids / __call__ / last_ids / last_logits / hidden_at, cache, calls,
    engine_s, trace) over native_step.c: a call is one es_forward over every sequence, each at its own
    committed length (the weights are read once per call, whatever the batch)."""

    def __init__(self, engine: NativeEngine, batch: int = 1):
        self.engine, self.m = engine, engine.manifest
        m = self.m
        self.batch = batch
        self.memory = HostMemory()
        self.cache = KVCache(m.num_layers, batch, m.num_kv_heads, m.head_dim, m.max_context, "float32", self.memory)
        self._outs: dict[int, _Outputs] = {}
        self._scratch, self._scratch_s = np.zeros(0, np.float32), 0  # scratch sized for calls of up to S tokens
        self._pointers: tuple = (-1, [])  # (cache generation, per sequence (key, value) address tables)
        self._last = None
        self.last_start = np.zeros(batch, np.int64)
        self._ids_host = None
        self.embedding = None
        self.calls, self.engine_s = 0, 0.0
        self.trace: list | None = None
        self.trace_name = "engine"

    def run(self, tokens, valid=None, embeds=None) -> None:
        """tokens (B, S) int64 at positions lengths[b]..lengths[b]+S-1 (see Decoder.run). Padding tokens
        (valid False) are computed like any token; their rows are never committed."""
        if embeds is not None:
            raise ValueError("provider 'cpu-native' runs ids-input engines; got embeds")
        ids = self._first(tokens, None)  # (B, S) int64, checked
        if valid is not None:  # a padding token means nothing: any in-range id computes its (unused) row
            ids = np.ascontiguousarray(np.where(valid, ids, 0))
        ids = np.ascontiguousarray(ids, np.int64)
        b, s = ids.shape
        lo, hi = 0, self.m.vocab_size
        if ids.size and (ids.min() < lo or ids.max() >= hi):
            raise ValueError(f"token ids must be in 0..{hi - 1}, got {int(ids.min())}..{int(ids.max())}")
        cache = self.cache
        e = self.engine
        grow = int(cache.lengths.max()) + s > cache.capacity or s > self._scratch_s
        if grow:  # buffers a helper thread of the last call may still read are about to be freed
            e.lib.es_quiesce()
        cache.reserve(int(cache.lengths.max()) + s)
        start = np.ascontiguousarray(cache.lengths, np.int64)  # a copy: (B,)
        out = self._outs.get(s)
        if out is None:
            out = self._outs[s] = _Outputs(self.memory, b, s, self.m)
        if s > self._scratch_s:
            need = e.lib.es_scratch_floats(ctypes.byref(e.model), b * s)
            if self._scratch.size < need:
                self._scratch = np.zeros(need, np.float32)
            self._scratch_s = s
        if self._pointers[0] != cache.generation:  # key / value addresses, sequence-major: [b L + layer]
            L = self.m.num_layers
            keys = [cache.buffers[2 * j].handle[i].ctypes.data for i in range(b) for j in range(L)]
            values = [cache.buffers[2 * j + 1].handle[i].ctypes.data for i in range(b) for j in range(L)]
            self._pointers = (cache.generation, ((ctypes.c_void_p * (b * L))(*keys), (ctypes.c_void_p * (b * L))(*values)))
        ks, vs = self._pointers[1]
        logits, nid = out.logits.handle, out.ids.handle
        hidden = out.hidden.handle if out.hidden is not None else None
        t0 = time.perf_counter()
        rc = e.lib.es_forward(ctypes.byref(e.model), b, s, ids.ctypes.data, start.ctypes.data, ks, vs,
                              cache.capacity, logits.ctypes.data, nid.ctypes.data,
                              hidden.ctypes.data if hidden is not None else None, self._scratch.ctypes.data,
                              e.threads)
        if rc == -1:
            raise EngineError(f"native step: rows {start.tolist()} + {s} do not fit the cache's {cache.capacity} rows")
        if rc != 0:
            raise MemoryError("native step: could not allocate its scratch")
        self._called(s, out, t0, time.perf_counter(), start, valid)

    def __del__(self):
        try:  # a helper thread may still read this decoder's buffers (native_step.c's pool)
            self.engine.lib.es_quiesce()
        except Exception:  # interpreter shutdown
            pass

    def greedy_steps(self, pending: int, n: int):
        """One call at a time through run() (a native step's host work is a ctypes call and a few checks)."""
        return self.greedy_steps_reference(pending, n)

    def reference_call(self, tokens, valid=None, embeds=None):
        raise NotImplementedError("the native decoder's reference is the ONNX Runtime engine of the same folder")

"""An engine folder's native weights (native.npz), read and checked against engine.json: what the native CPU
step (native.py) and the CUDA step (cuda_native.py) both load, and the es_model struct (native_lib._Model) that
points each of them at its copy of the arrays.
"""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..contract import EngineError, Manifest, file_sha256
from .native_format import (ACTIVATIONS, FEATURES, FORMAT, LAYER_KEYS, OPTIONAL_KEYS, PANEL, QB, WEIGHT_KINDS,
                            expected_shapes, head_rows, manifest_windows, upgrade_format1)
from .hugepages import hugepages_wanted, read_npz
from .native_lib import _Model
from .providers import checked_folder


@dataclass
class NativeFolder:
    """A folder's native weights, checked: arrays by native.npz's names (format 1 upgraded), its extra["native"]
    record (`info`) and the MLP width."""
    dir: Path
    manifest: Manifest
    info: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)
    intermediate: int = 0

    @property
    def head_rows(self) -> int:
        """The lm_head's rows, so the logits' row width in the step (native_format.head_rows)."""
        return int(self.info.get("head_rows", self.manifest.vocab_size))


def in_memory(manifest: Manifest, info: dict, arrays: dict[str, np.ndarray]) -> NativeFolder:
    """A native folder that exists only in memory (the device check's models, made where they run): checked as
    read_native checks a file."""
    intermediate = check_native(manifest, info, arrays, "native arrays in memory")
    return NativeFolder(Path("<memory>"), manifest, info, arrays, intermediate)


def read_native(engine_dir: str | Path, check_hashes: bool = True, provider: str = "cpu-native") -> NativeFolder:
    """Read and check a folder's native weights for `provider` (named in the errors): one EngineError that says
    what is wrong and what to do."""
    f = NativeFolder(*checked_folder(engine_dir, check_hashes))
    m = f.manifest
    info = m.extra.get("native") or {}
    if not info.get("file"):
        why = info.get("unavailable", "it was exported before native weights existed")
        raise EngineError(f"{f.dir}: no native weights for provider {provider!r} ({why}); add them with "
                          f"`python -m edgespec.export.native {f.dir} --checkpoint CHECKPOINT_DIR`, or use "
                          f"provider 'cpu'")
    path = f.dir / info["file"]
    if not path.is_file():
        raise EngineError(f"{f.dir}: native weights {info['file']} named in engine.json are missing")
    if check_hashes and info.get("sha256") and file_sha256(path) != info["sha256"]:
        raise EngineError(f"{path}: sha256 differs from engine.json's extra.native.sha256 (changed after export)")
    if m.input_mode not in ("ids", "embeds") or m.kind != "decoder":  # its cache is its own, float32
        raise EngineError(f"{f.dir}: provider {provider!r} runs decoders (ids or inputs_embeds input); this folder "
                          f"has input_mode {m.input_mode!r}, kind {m.kind!r}: use provider 'cpu'")
    fmt = int(info.get("format", 1))
    if fmt not in (1, 2, FORMAT) or (fmt < 3 and info.get("weights", "float16") != "float16"):
        raise EngineError(f"{path}: native weights of format {fmt} ({info.get('weights', 'float16')}); this "
                          f"edgespec reads formats 1 and 2 (float16) and {FORMAT} "
                          f"(re-add them with `python -m edgespec.export.native {f.dir} --checkpoint ...`)")
    f.arrays = _shared_arrays(path, m, fmt)
    f.info, f.intermediate = info, check_native(m, info, f.arrays, str(path), f"{f.dir}/engine.json")
    return f


class _Arrays(dict):
    """native.npz's arrays by name; a dict subclass so that _SHARED can hold it weakly."""


# Every folder loaded in this process, while some engine still holds its arrays: a second load of the same file
# (another draft mode of one policy, a second edgespec.load) shares the first's read-only weights instead of
# reading another copy, which at 3B in float16 is 5.7 GB each.
_SHARED: "weakref.WeakValueDictionary[tuple, _Arrays]" = weakref.WeakValueDictionary()


def _shared_arrays(path: Path, m: Manifest, fmt: int) -> _Arrays:
    st = path.stat()
    huge = hugepages_wanted()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, huge)
    arrays = _SHARED.get(key)
    if arrays is None:
        arrays = _Arrays(read_npz(path, huge))  # one arena on huge pages: the weights stream without TLB misses
        if fmt == 1 and "scalars" in arrays and arrays["scalars"].shape == (2,):
            upgrade_format1(arrays, m)
        for a in arrays.values():
            a.flags.writeable = False  # shared: no engine may change another's weights
        _SHARED[key] = arrays
    return arrays


def check_native(m: Manifest, info: dict, arrays: dict, where: str, against: str = "its manifest") -> int:
    """native.npz's arrays against the manifest and its extra["native"] record: one EngineError listing what does
    not fit (`where` names the file); -> the MLP width."""
    intermediate = int(info["intermediate_size"])
    kinds = {k: info.get(k, "float16") for k in ("weights", "head_weights")}
    odd = {k: v for k, v in kinds.items() if v not in WEIGHT_KINDS}
    if odd:
        raise EngineError(f"{where}: engine.json's extra.native says " + ", ".join(
            f"{k} {v!r}" for k, v in odd.items()) + f": the native step reads {sorted(WEIGHT_KINDS)}")
    want = expected_shapes(m, info)
    a = arrays
    bad = [f"{k}: expected {s}, got {a[k].shape if k in a else 'nothing'}"
           for k, s in want.items() if k not in a or a[k].shape != s]
    bad += [f"{k}: not expected (engine.json's extra.native.features: {info.get('features', [])})"
            for k in sorted(set(a) - set(want))]
    unknown = sorted(set(info.get("features", [])) - set(FEATURES))
    if unknown:
        bad.append(f"features {unknown} are not computed by this edgespec's native step")
    rows = info.get("head_rows", m.vocab_size)
    if rows != head_rows(m.vocab_size):
        bad.append(f"head_rows (the lm_head's packed rows) must be vocab_size {m.vocab_size} rounded up to a "
                   f"multiple of {PANEL}, {head_rows(m.vocab_size)}; got {rows}")
    for what, n in (("hidden_size", m.hidden_size),
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
        raise EngineError(f"{where}: does not fit {against}:\n  - " + "\n  - ".join(bad))
    return intermediate


def model_struct(f: NativeFolder, address: Callable[[str], int]) -> tuple[_Model, list]:
    """es_model for folder f, each array at `address(name)` (a host address for native_step.c, a device one for
    cuda_step.cu), except layer_rope and layer_window, which both steps read on the host: -> (the struct, the
    pointer tables it points into, to keep alive with it)."""
    m, a, info = f.manifest, f.arrays, f.info
    lo, hi = m.argmax_range
    eps, embed_scale, attn_scale = (float(x) for x in a["scalars"])
    for k in ("layer_rope", "layer_window"):
        a[k] = np.ascontiguousarray(a[k], np.int64)
    kind = info.get("weights", "float16")
    st = _Model(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, f.intermediate, f.head_rows,
                m.num_layers, lo, hi, int(info.get("rotary_dim", m.head_dim)), a["rope_scale"].shape[0],
                ACTIVATIONS[info.get("activation", "silu")], WEIGHT_KINDS[kind],
                WEIGHT_KINDS[info.get("head_weights", kind)], eps, embed_scale, attn_scale,
                address("inv_freq"), address("rope_scale"), a["layer_rope"].ctypes.data,
                a["layer_window"].ctypes.data, address("embed"), address("lm_head"), address("norm"))
    tables = []
    for key in LAYER_KEYS + OPTIONAL_KEYS:
        if f"layers.0.{key}" not in a:
            continue  # an absent option: NULL
        table = (ctypes.c_void_p * m.num_layers)(*[address(f"layers.{i}.{key}") for i in range(m.num_layers)])
        tables.append(table)
        setattr(st, key, ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p)))
    return st, tables


def device_arrays(f: NativeFolder) -> list[str]:
    """The names of the arrays a step reads through es_model's addresses (every array but the host-side ones)."""
    return [k for k in f.arrays if k not in ("layer_rope", "layer_window", "scalars")]

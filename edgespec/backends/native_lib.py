"""The native step's C library: native_step.c compiled on first use with the system C compiler (`cc`,
pthreads) for this CPU into $EDGESPEC_CACHE (default ~/.cache/edgespec)/native/, loaded once per process
(its helper threads serve every engine), and the step's per-job-kind profile counters.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..contract import EngineError
from .native_format import LAYER_KEYS, OPTIONAL_KEYS

SOURCE = Path(__file__).resolve().parents[1] / "native_step.c"  # package data of edgespec (pyproject.toml)


def cache_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec") / "native"


def compiler() -> str | None:
    """$CC (a name on PATH or a path), else cc or gcc on PATH; None when there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


# Every build's language flags. -ffp-contract=off: the compiler fuses no a * b + c of its own (GCC does on Arm
# and on x86 with FMA), so the code outside the kernels' explicit FMAs rounds the same on every target: a Jetson's
# build computes the portable x86 build's bits (tests/test_native_arm.py).
C_FLAGS = ["-std=gnu11", "-ffp-contract=off"]


def build_library() -> Path:
    """Compile native_step.c for this CPU (once per source and compiler): -> the shared library's path."""
    cc = compiler()
    if cc is None:
        raise EngineError("provider 'cpu-native' compiles edgespec/native_step.c on first use and found no C "
                          f"compiler (CC={os.environ.get('CC')!r}, cc, gcc): install one (Debian/Ubuntu: apt-get install gcc), or use "
                          "provider 'cpu'")
    # EDGESPEC_NATIVE_MARCH: the target CPU (default: this one; the tests also build "x86-64", the portable C path)
    flags = ["-O3", f"-march={os.environ.get('EDGESPEC_NATIVE_MARCH', 'native')}", "-pthread", "-shared", "-fPIC",
             *C_FLAGS]
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
    lib.es_forward.argtypes = [ctypes.POINTER(_Model), i64, i64, P, P, P, P, P, i64, P, P, P, P, ctypes.c_int]
    lib.es_forward.restype = ctypes.c_int
    lib.es_scratch_floats.argtypes = [ctypes.POINTER(_Model), i64]
    lib.es_scratch_floats.restype = i64
    lib.es_matmul.argtypes = [ctypes.c_int, P, i64, P, i64, i64, P, ctypes.c_int]
    lib.es_matmul.restype = ctypes.c_int
    lib.es_rows_f16.argtypes = [P, i64, P, i64, i64, P]
    lib.es_rows_f16.restype = ctypes.c_int
    lib.es_quiesce.argtypes = []
    lib.es_quiesce.restype = None
    lib.es_stolen.argtypes = []
    lib.es_stolen.restype = i64
    lib.es_profile.argtypes = [P, ctypes.c_int]
    lib.es_profile.restype = ctypes.c_int
    lib.es_model_layout.argtypes = [ctypes.POINTER(i64)]
    lib.es_model_layout.restype = i64
    lib.es_set_prefetch_rows.argtypes = [ctypes.c_int]
    lib.es_set_prefetch_rows.restype = ctypes.c_int
    lib.es_prefetch_rows.argtypes = []
    lib.es_prefetch_rows.restype = ctypes.c_int
    lib.es_set_prefetch_rows(prefetch_rows_setting())
    lib.es_set_q4_row_panels.argtypes = [ctypes.c_int]
    lib.es_set_q4_row_panels.restype = ctypes.c_int
    lib.es_q4_row_panels.argtypes = []
    lib.es_q4_row_panels.restype = ctypes.c_int
    lib.es_set_q4_row_panels(q4_row_panels_setting())
    off = i64()
    size = lib.es_model_layout(ctypes.byref(off))
    if size != ctypes.sizeof(_Model) or off.value != _Model.inv_freq.offset:
        raise EngineError(f"{path}: es_model is {size} bytes (pointers from {off.value}) in C, "
                          f"{ctypes.sizeof(_Model)} ({_Model.inv_freq.offset}) in native.py: they must agree")
    return lib


def prefetch_rows_setting() -> int:
    """$EDGESPEC_PREFETCH_ROWS: the fewest rows a matrix product prefetches weights for (>= 1); 0 when unset,
    which lets native_step.c pick this CPU's default (es_set_prefetch_rows)."""
    raw = os.environ.get("EDGESPEC_PREFETCH_ROWS", "").strip()
    if not raw:
        return 0
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if rows < 1:
        raise EngineError(f"EDGESPEC_PREFETCH_ROWS: expected an integer >= 1 (the fewest rows a matrix product "
                          f"prefetches for), got {raw!r}")
    return rows


def q4_row_panels_setting() -> int:
    """$EDGESPEC_INT4_ROW_PANELS: the panels of 16 columns a one-row int4 product streams per pass (1, 2 or 4); 0
    when unset, which lets native_step.c pick this CPU's default (es_set_q4_row_panels). The same bits either way."""
    raw = os.environ.get("EDGESPEC_INT4_ROW_PANELS", "").strip()
    if not raw:
        return 0
    if raw not in ("1", "2", "4"):
        raise EngineError(f"EDGESPEC_INT4_ROW_PANELS: expected 1, 2 or 4 (panels a one-row int4 product streams "
                          f"per pass), got {raw!r}")
    return int(raw)


_LIBS: dict[Path, ctypes.CDLL] = {}


def library():
    """The compiled step for this process's flags, loaded once (its helper threads serve every engine)."""
    path = build_library()
    if path not in _LIBS:
        _LIBS[path] = _library(path)
    return _LIBS[path]


JOB_KINDS = ("norm", "add_norm", "matmul", "kv", "attention", "activation", "argmax", "quantize")  # native_step.c


def profile(reset: bool = True, lib=None) -> dict[str, dict]:
    """Where the native step's calls spent their time since the last reset, by job kind (JOB_KINDS):
    {kind: {"jobs": n, "ms": the calling thread's wall time in them, "wait_ms": of which waiting for helper
    threads to finish chunks they had claimed}}. Counted in every build; reading costs a few microseconds.
    lib: whose counters (an engine's `lib`, when a process loads builds with other flags); default library()."""
    lib = lib or library()
    out = np.zeros(3 * len(JOB_KINDS), np.int64)
    if lib.es_profile(out.ctypes.data, int(reset)) != len(JOB_KINDS):
        raise EngineError(f"{SOURCE}: es_profile counts other job kinds than native.py's {JOB_KINDS}")
    n = len(JOB_KINDS)
    return {k: {"jobs": int(out[i]), "ms": out[n + i] / 1e6, "wait_ms": out[2 * n + i] / 1e6}
            for i, k in enumerate(JOB_KINDS)}

"""The native step's 64-bit Arm kernels (edgespec/native_step.c's ES_NEON / ES_SDOT paths: a Jetson's CPU cores),
built with an aarch64 compiler and run under qemu-user on other machines: every weight kind's products equal,
bit for bit, this machine's build and the portable C build, for one call of many rows and for calls of few rows on
two threads. Speed cannot be measured here; the bits can.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user (the README's test command installs both); on an aarch64
machine the system compiler runs the builds directly.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgespec.backends.native_format import QB, WEIGHT_KINDS, matmul_reference, pack, pack_blocks, quantize_blocks
from edgespec.backends.native_lib import SOURCE

HARNESS = Path(__file__).parent / "native" / "matmul_harness.c"
ON_ARM = platform.machine() in ("aarch64", "arm64")
CC = shutil.which("gcc" if ON_ARM else "aarch64-linux-gnu-gcc")
QEMU = [] if ON_ARM else [shutil.which("qemu-aarch64") or ""]
OBJDUMP = shutil.which("objdump" if ON_ARM else "aarch64-linux-gnu-objdump")
if CC is None or not all(QEMU + [shutil.which("cc") or shutil.which("gcc")]):
    pytest.skip("the Arm kernels' test needs an aarch64 C compiler and qemu-aarch64 (apt-get install "
                "gcc-aarch64-linux-gnu qemu-user)", allow_module_level=True)

# the builds: (march, extra flags, instructions its products must use)
BUILDS = {"sdot": ("armv8.2-a+dotprod+fp16", [], ("sdot", "fcvtl")),  # Cortex-A78AE (Jetson Orin), Graviton 2+
          "neon": ("armv8-a", [], ("fcvtl",)),  # no dot product (Cortex-A57, Jetson Nano): float16 NEON, integer C
          "portable": ("armv8.2-a+dotprod+fp16", ["-DES_PORTABLE"], ())}


@pytest.fixture(scope="module")
def arm_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("arm")
    out = {}
    for name, (march, extra, _) in BUILDS.items():
        exe = root / f"harness-{name}"
        cmd = [CC, "-O3", f"-march={march}", *extra, "-static", "-pthread", "-std=gnu11", str(SOURCE), str(HARNESS),
               "-o", str(exe), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stderr}"
        out[name] = exe
    return out


def _problem(kind):
    """-> x (30, K) float32, the packed (N, K) matrix, K, N: 37 panels (tails of every kernel's panel groups)"""
    rng = np.random.default_rng(7)
    k, n = 20 * QB, 16 * 37
    w = rng.normal(0, 0.2, (n, k)).astype(np.float32)
    x = rng.normal(0, 1, (30, k)).astype(np.float32)
    x[3, :QB] = 0  # an all-zero activation block (int kinds: dx 0)
    packed = pack(w.astype(np.float16)) if kind == "float16" else pack_blocks(*quantize_blocks(w, kind), kind)
    return x, packed, k, n


def _run(exe: Path, kind: str, x: np.ndarray, packed: np.ndarray, k: int, n: int, threads: int, tmp: Path):
    xf, wf, yf = tmp / "x.bin", tmp / "w.bin", tmp / "y.bin"
    np.ascontiguousarray(x, np.float32).tofile(xf)
    packed.tofile(wf)
    r = subprocess.run([*QEMU, str(exe), str(WEIGHT_KINDS[kind]), str(k), str(n), str(len(x)), str(threads),
                        str(xf), str(wf), str(yf)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return np.fromfile(yf, np.float32).reshape(len(x), n)


def test_the_arm_builds_use_their_instructions(arm_builds):
    """The builds are what they claim (a kernel left out by a macro would still pass the bit test below)."""
    if OBJDUMP is None:
        pytest.skip("no aarch64 objdump (binutils-aarch64-linux-gnu, which gcc-aarch64-linux-gnu installs)")
    for name, (_, _, want) in BUILDS.items():
        text = subprocess.run([OBJDUMP, "-d", str(arm_builds[name])], capture_output=True, text=True).stdout
        words = {w for line in text.splitlines() for w in line.split("\t")[2:3]}
        ops = {w.split()[0] for w in words if w.strip()}
        for op in ("sdot", "fcvtl"):
            assert (op in ops) == (op in want), (name, op)


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
def test_every_arm_build_computes_this_machines_bits(kind, arm_builds, tmp_path):
    from edgespec.backends.native_lib import library
    x, packed, k, n = _problem(kind)
    here = np.zeros((len(x), n), np.float32)
    assert library().es_matmul(WEIGHT_KINDS[kind], x.ctypes.data, len(x), packed.ctypes.data, k, n,
                               here.ctypes.data, 1) == 0
    np.testing.assert_allclose(here, matmul_reference(x, packed, kind), rtol=0, atol=1e-5 * np.abs(here).max())
    for name, exe in arm_builds.items():
        whole = _run(exe, kind, x, packed, k, n, 1, tmp_path)
        assert np.array_equal(whole, here), (name, float(np.abs(whole - here).max()))
        parts = np.concatenate([_run(exe, kind, x[a:b], packed, k, n, 2, tmp_path)
                                for a, b in ((0, 1), (1, 6), (6, 19), (19, 30))])
        assert np.array_equal(parts, here), (name, "rows split over calls of 1, 5, 13, 11 on 2 threads")

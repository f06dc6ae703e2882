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
from edgespec.backends import open_engine
from edgespec.backends.native_lib import C_FLAGS, SOURCE

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


def _build(name: str, harness: Path, exe: Path) -> Path:
    """native_step.c and a harness program, as build `name` (BUILDS), static (qemu-user needs no sysroot)."""
    march, extra, _ = BUILDS[name]
    cmd = [CC, "-O3", f"-march={march}", *extra, "-static", "-pthread", *C_FLAGS, str(SOURCE), str(harness), "-o",
           str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stderr}"
    return exe


@pytest.fixture(scope="module")
def arm_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("arm")
    return {name: _build(name, HARNESS, root / f"harness-{name}") for name in BUILDS}


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


# ---- whole forward passes ----

FORWARD = Path(__file__).parent / "native" / "forward_harness.c"
FORWARD_FAMILIES = ("gemma3", "qwen2", "phi3")  # between them every option of es_model (test_native_families.py)


@pytest.fixture(scope="module")
def arm_forward(tmp_path_factory):
    """The forward harness built like the three builds above."""
    root = tmp_path_factory.mktemp("arm-forward")
    return {name: _build(name, FORWARD, root / f"forward-{name}") for name in BUILDS}


@pytest.fixture(scope="module")
def forward_folders(tmp_path_factory):
    """(family, kind) -> engine folder with native weights of that kind."""
    import transformers  # noqa: F401 - test_native_families' configs
    from test_native_families import CONFIGS, _make
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import add_native
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("arm-forward-folders")
    out = {}
    for i, name in enumerate(FORWARD_FAMILIES):
        _make(CONFIGS[name](), root / "ck" / name, seed=90 + i)
        base = out[(name, "float16")] = root / name / "float16"
        export_engine(root / "ck" / name, base, max_context=96, progress=False)
        spec, weights = load_checkpoint(root / "ck" / name)
        rows = [np.random.default_rng(3).integers(0, spec.vocab_size, 40)]
        for kind in ("int8", "int4"):
            folder = out[(name, kind)] = root / name / kind
            shutil.copytree(base, folder)
            add_native(folder, spec, weights, None, kind, base=(rows, [np.zeros((40, spec.vocab_size), np.float32)]),
                       role="draft")  # a draft's gate records, never refuses: the test is the bits
    return out


def _model_file(engine, path: Path) -> None:
    """engine.model (es_model) and every array it points to, in forward_harness.c's MODEL format."""
    import ctypes
    from edgespec.backends.native_lib import _Model
    arrays = {a.ctypes.data: a for a in engine.arrays.values()}
    st = engine.model
    parts = [np.int64(ctypes.sizeof(st)).tobytes(), ctypes.string_at(ctypes.addressof(st), ctypes.sizeof(st))]
    relocs = []
    for name, typ in _Model._fields_:
        field, value = getattr(_Model, name), getattr(st, name)
        if typ is ctypes.c_void_p and value:
            relocs.append((field.offset, -1, [arrays[value]]))
        elif typ is ctypes.POINTER(ctypes.c_void_p) and value:  # a table of L arrays (per-layer weights)
            relocs.append((field.offset, st.L, [arrays[value[i]] for i in range(st.L)]))
    parts.append(np.int64(len(relocs)).tobytes())
    for offset, count, arrs in relocs:
        parts.append(np.array([offset, count], np.int64).tobytes())
        for a in arrs:
            parts += [np.int64(a.nbytes).tobytes(), np.ascontiguousarray(a).tobytes()]
    path.write_bytes(b"".join(parts))


@pytest.mark.parametrize("kind", ["float16", "int8", "int4"])
@pytest.mark.parametrize("family", FORWARD_FAMILIES)
def test_whole_forward_passes_on_arm_equal_the_portable_build(family, kind, arm_forward, forward_folders, tmp_path,
                                                              monkeypatch):
    """Two sequences through a prefill, single steps across the sliding windows and verify-sized calls, the second
    sequence keeping fewer rows of each call (so at its own lengths), on 2 threads: every logit, id and final
    hidden state of the three Arm builds equals, bit for bit, the portable C build's on this machine (x86-64: the
    same C outside the products, and C_FLAGS' -ffp-contract=off rounds it the same way on both). This machine's
    own build (AVX2 / AVX-512) sums the norms and the attention in another order: test_native_families.py holds
    it to ONNX Runtime within rounding instead."""
    from test_native_families import _calls
    if not ON_ARM:
        monkeypatch.setenv("EDGESPEC_NATIVE_MARCH", "x86-64")
    folder = forward_folders[(family, kind)]
    dec = open_engine(folder, "cpu-native").decoder(batch=2)
    e, m = dec.engine, dec.m
    assert e.info.get("weights", "float16") == kind
    _model_file(e, tmp_path / "model.bin")
    calls = [np.concatenate([c, c[:, ::-1]]) for c in _calls()]  # (2, S): the second sequence another text
    parts = [np.array([2, m.num_kv_heads, m.head_dim, m.max_context, 2, len(calls)], np.int64).tobytes()]
    want = []
    for c in calls:
        s = c.shape[1]
        parts += [np.int64(s).tobytes(), np.array(dec.cache.lengths, np.int64).tobytes(),
                  np.ascontiguousarray(c, np.int64).tobytes()]
        dec.run(c)
        hidden = dec._last.hidden
        want.append((np.array(dec._last.full.handle), np.array(dec.last_ids()),
                     None if hidden is None else np.array(hidden.handle)))
        dec.cache.commit(np.array([s, max(1, s - 1)]))
    (tmp_path / "calls.bin").write_bytes(b"".join(parts))
    V, E = e.head_rows, m.hidden_size
    for name, exe in arm_forward.items():
        r = subprocess.run([*QEMU, str(exe), str(tmp_path / "model.bin"), str(tmp_path / "calls.bin"),
                            str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.returncode, r.stderr)
        raw, at = (tmp_path / "out.bin").read_bytes(), 0
        assert len(raw) == sum(c.size * (4 * V + 8 + 4 * E) for c in calls), name
        for i, (c, (logits, ids, hidden)) in enumerate(zip(calls, want)):
            t = c.size
            got = np.frombuffer(raw, np.float32, t * V, at).reshape(logits.shape)
            assert np.array_equal(got, logits), (name, i, c.shape, float(np.abs(got - logits).max()))
            assert np.array_equal(np.frombuffer(raw, np.int64, t, at + 4 * t * V).reshape(ids.shape), ids), (name, i)
            if hidden is not None:
                assert np.array_equal(np.frombuffer(raw, np.float32, t * E, at + t * (4 * V + 8)), hidden.reshape(-1))
            at += t * (4 * V + 8 + 4 * E)

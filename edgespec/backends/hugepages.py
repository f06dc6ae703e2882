"""Read an uncompressed .npz (native.npz) into one anonymous mapping advised for transparent huge pages.

A decode step streams every weight from DRAM once per token. With 4 KiB pages that stream crosses a page, and
misses the TLB, every 4 KiB, and the core's hardware prefetcher restarts at each page; with 2 MiB pages it does
neither for 512 times as long (bench/results/NOTES.md, "huge pages"). Linux backs an anonymous mapping with huge
pages when /sys/kernel/mm/transparent_hugepage/enabled is `always`, or `madvise` and the mapping asked for them
(MADV_HUGEPAGE). numpy advises its own large allocations too, but whether the kernel grants them varies by machine
(on ours they get 4 KiB pages, on CI's most of them come huge): the arena makes it the same everywhere.

    read_npz(path, huge=True)  -> {name: array}: every array a view into one arena, each 64-byte aligned, the
                                  arena's start 2 MiB aligned; huge=False (or no MADV_HUGEPAGE on this
                                  platform): the same arrays, each numpy's own
    hugepages_wanted()         -> whether to ask: EDGESPEC_HUGEPAGES unset or 1 (0 turns it off, for A/B runs)
    huge_bytes(a)              -> bytes of the arena behind `a` the kernel backs with huge pages (Linux' smaps),
                                  None where that cannot be read

Members are read straight into their place in the arena (no second copy of the weights), so peak memory is the
arena plus one read buffer.
"""
from __future__ import annotations

import mmap
import os
import zipfile
from pathlib import Path

import numpy as np

ALIGN = 64  # each array's start: a cache line
HUGE = 2 << 20  # the arena's start: a huge page (x86-64 and aarch64 with 4 KiB base pages)
READ_CHUNK = 16 << 20


def hugepages_wanted() -> bool:
    v = os.environ.get("EDGESPEC_HUGEPAGES", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"EDGESPEC_HUGEPAGES must be 0 or 1, got {v!r}")
    return v == "1"


def _members(zf: zipfile.ZipFile, path) -> list[tuple[str, np.dtype, tuple, bool, int]]:
    """(name, dtype, shape, fortran_order, data offset within the member) of each .npy member, headers only."""
    out = []
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            raise ValueError(f"{path}: member {info.filename!r} is not an .npy array")
        with zf.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            if dtype.hasobject:
                raise ValueError(f"{path}: member {info.filename!r} holds Python objects, expected numbers")
            out.append((info.filename[:-4], dtype, tuple(shape), fortran, f.tell()))
    return out


def read_npz(path: str | Path, huge: bool = True) -> dict[str, np.ndarray]:
    """Every array of the .npz at `path`, in one arena advised for huge pages (see the module's docstring)."""
    if not huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        with np.load(path) as z:
            return {k: np.ascontiguousarray(z[k]) for k in z.files}
    with zipfile.ZipFile(path) as zf:
        members = _members(zf, path)
        offsets, total = [], 0
        for _, dtype, shape, _, _ in members:
            offsets.append(total)
            total += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
        # private: a shared anonymous mapping is shmem, which takes huge pages only by another switch (shmem_enabled)
        arena = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
        base = np.frombuffer(arena, np.uint8)  # keeps `arena` alive as long as any view of it
        start = -base.ctypes.data % HUGE
        arrays = {}
        for (name, dtype, shape, fortran, skip), off in zip(members, offsets):
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            dst = base[start + off:start + off + n]
            with zf.open(name + ".npy") as f:
                f.read(skip)  # past the header
                got = 0
                while got < n:
                    k = f.readinto(memoryview(dst[got:got + min(READ_CHUNK, n - got)]))
                    if not k:
                        raise ValueError(f"{path}: member {name!r} ends after {got} of its {n} bytes")
                    got += k
            a = dst.view(dtype)
            arrays[name] = a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
        return {k: np.ascontiguousarray(v) for k, v in arrays.items()}  # a Fortran-ordered member is copied


def huge_bytes(a: np.ndarray) -> int | None:
    """Bytes of huge pages (AnonHugePages in /proc/self/smaps) in the mapping that holds `a`'s first byte."""
    addr = a.ctypes.data
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

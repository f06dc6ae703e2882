"""native.npz read into one huge-page arena (edgespec/backends/hugepages.py): the same arrays as np.load."""
from __future__ import annotations

import mmap
import zipfile

import numpy as np
import pytest

from edgespec.backends.hugepages import ALIGN, HUGE, hugepages_wanted, read_npz


def _write(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.integers(0, 255, (3, 7, 289), dtype=np.uint8),  # an odd size: the next array's offset is rounded
        "f16": rng.normal(size=(33, 5)).astype(np.float16),
        "big": rng.normal(size=(1 << 19,)).astype(np.float32),  # 2 MiB: spans a huge page
        "scalar": np.int64(3),
        "fortran": np.asfortranarray(rng.normal(size=(4, 6))),
        "empty": np.zeros((0, 16), np.float32),
        "be": np.arange(10, dtype=">i4"),
    }
    path = tmp_path / "native.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("huge", [True, False])
def test_same_arrays_as_np_load(tmp_path, huge):
    path = _write(tmp_path)
    got = read_npz(path, huge=huge)
    with np.load(path) as z:
        assert sorted(got) == sorted(z.files)
        for k in z.files:
            want = np.ascontiguousarray(z[k])  # what native_folder read before: a 0-d member comes back as (1,)
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            assert np.array_equal(got[k], want), k
            assert got[k].flags.c_contiguous, k


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_arrays_share_one_aligned_arena(tmp_path):
    got = read_npz(_write(tmp_path), huge=True)
    addrs = {k: v.ctypes.data for k, v in got.items() if k not in ("fortran", "empty")}  # fortran: copied
    assert all(a % ALIGN == 0 for a in addrs.values()), addrs
    assert min(addrs.values()) % HUGE == 0  # the arena's first array starts on a huge page
    assert max(addrs.values()) - min(addrs.values()) < 4 << 20  # all in one arena
    got["w"][0, 0, 0] ^= 1  # writable, like np.load's arrays


def test_truncated_member_is_refused(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, a=np.arange(1000, dtype=np.float32))
    # the member's header kept, its data 100 bytes short
    with zipfile.ZipFile(path) as zf:
        data = zf.read("a.npy")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("a.npy", data[:-100])
    with pytest.raises(ValueError, match="ends after"):
        read_npz(path, huge=True)


def test_switch(monkeypatch):
    monkeypatch.delenv("EDGESPEC_HUGEPAGES", raising=False)
    assert hugepages_wanted()
    monkeypatch.setenv("EDGESPEC_HUGEPAGES", "0")
    assert not hugepages_wanted()
    monkeypatch.setenv("EDGESPEC_HUGEPAGES", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        hugepages_wanted()


def _thp_setting() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_setting() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {_thp_setting() or 'not available'} here")
def test_the_arena_gets_huge_pages(tmp_path):
    """On `madvise` (Linux' common default) a private mapping that asked gets them (a shared anonymous mapping,
    shmem, would not). numpy's own arrays are not checked: numpy advises them too, and the kernel grants that on
    some machines and not on others."""
    from edgespec.backends.hugepages import huge_bytes
    path = tmp_path / "w.npz"
    np.savez(path, w=np.ones(16 << 20, np.uint8))
    got = read_npz(path, huge=True)["w"]
    assert huge_bytes(got) >= 2 << 20, "no huge page behind the arena"

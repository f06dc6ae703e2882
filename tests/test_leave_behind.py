"""tools/device/leave_behind.sh: the bundled target's weights stay behind when a run carries the checkout to a
lent GPU machine, and come back exactly as committed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "device" / "leave_behind.sh"

if shutil.which("git") is None:
    pytest.skip("needs git", allow_module_level=True)


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _run(repo, *args):
    return subprocess.run(["bash", str(repo / "tools/device/leave_behind.sh"), *args], capture_output=True, text=True)


def test_on_leaves_the_target_behind_and_off_brings_it_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools/device").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "tools/device/leave_behind.sh")
    (repo / "models/demo-target").mkdir(parents=True)
    (repo / "models/demo-target/model.safetensors").write_bytes(b"w" * 100_000)
    (repo / "models/demo-draft").mkdir(parents=True)
    (repo / "models/demo-draft/model.safetensors").write_bytes(b"d" * 1000)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    before = _run(repo, "size").stdout
    r = _run(repo, "on")
    assert r.returncode == 0, r.stderr
    travels = _git(repo, "ls-files", "--cached", "--others", "--exclude-standard").split()
    assert "models/demo-target/model.safetensors" not in travels and "models/demo-draft/model.safetensors" in travels
    assert (repo / "models/demo-target/model.safetensors").is_file()  # nothing deleted
    assert int(r.stdout.splitlines()[-1].split()[0]) < int(before.split()[0]) - 99_000
    r = _run(repo, "off")
    assert r.returncode == 0, r.stderr
    assert _git(repo, "status", "--porcelain") == ""  # exactly as committed, exclude restored
    assert "models/demo-target/model.safetensors" in _git(repo, "ls-files")


def test_on_refuses_staged_changes(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools/device").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "tools/device/leave_behind.sh")
    (repo / "models/demo-target").mkdir(parents=True)
    (repo / "models/demo-target/a").write_text("a")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    (repo / "b").write_text("b")
    _git(repo, "add", "b")
    r = _run(repo, "on")
    assert r.returncode == 1 and "staged changes" in r.stderr
    assert "models/demo-target/a" in _git(repo, "ls-files")

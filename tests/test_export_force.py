"""--out / --force: an export replaces only a folder edgespec wrote, never the current directory, home, the
repository, the source checkpoint or their parents; a killed export's staging folder is removed by the next
export beside it. The refusals happen before any work (no export runs); one real tiny export at the end."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import make_checkpoint
from edgespec import contract as C
from edgespec import policy_contract as PC
from edgespec.export.onnx_export import export_engine
from edgespec.export.staging import REPO_ROOT, UnsafeOutputError, check_out_dir, remove_dead_stages
from edgespec.export.vla import export_policy


def dead_pid() -> int:
    """A process id no process has: above the kernel's largest."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return 2 ** 22 + 1


def fake_engine(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / C.MANIFEST_FILE).write_text(json.dumps({"contract_version": C.CONTRACT_VERSION,
                                                      "model_file": "model.onnx"}))
    return folder


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A checkpoint folder path (the refusals come before it is read: it need not hold weights)."""
    d = tmp_path / "models" / "tiny"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text("weights")
    return d


@pytest.mark.parametrize("out, why", [
    (lambda tmp, ck: Path("."), "the current directory"),
    (lambda tmp, ck: tmp.parent, "a parent of the current directory"),
    (lambda tmp, ck: Path("/"), "the filesystem root"),
    (lambda tmp, ck: REPO_ROOT, "the edgespec repository"),
    (lambda tmp, ck: REPO_ROOT.parent, "a parent of the edgespec repository"),
    (lambda tmp, ck: ck, "the source"),
    (lambda tmp, ck: ck.parent, "a parent of the source"),
])
def test_out_that_would_destroy_something_is_refused(tmp_path, monkeypatch, ckpt, out, why):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    if why.endswith("edgespec repository") and work.resolve().is_relative_to(out(work, ckpt).resolve()):
        why = f"({why}|a parent of the current directory)"  # a clone under /tmp: both hold, either is named
    for force in (False, True):
        with pytest.raises(UnsafeOutputError, match=f"refusing to export into .*: it is {why}"):
            export_engine(ckpt, out(work, ckpt), force=force, progress=False)
    assert (ckpt / "model.safetensors").read_text() == "weights"


def test_home_is_refused(tmp_path, monkeypatch, ckpt):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(UnsafeOutputError, match="it is your home folder"):
        export_engine(ckpt, home, force=True, progress=False)


def test_force_replaces_only_an_edgespec_folder(tmp_path, ckpt):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="pass --force"):
        export_engine(ckpt, mine, progress=False)
    with pytest.raises(UnsafeOutputError, match="not an engine or policy folder edgespec exported"):
        export_engine(ckpt, mine, force=True, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeOutputError, match="not an engine or policy folder"):
        export_engine(ckpt, tmp_path / "file", force=True, progress=False)
    (tmp_path / "link").symlink_to(fake_engine(tmp_path / "engine"))
    with pytest.raises(UnsafeOutputError, match="symbolic link"):
        export_engine(ckpt, tmp_path / "link", force=True, progress=False)
    assert (mine / "todo.txt").read_text() == "keep me"
    check_out_dir(tmp_path / "engine", [ckpt], force=True)  # an engine folder: replaceable
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / PC.POLICY_FILE).write_text(json.dumps({"format": "edgespec-vla/1"}))
    check_out_dir(policy, [ckpt], force=True)  # a policy folder: replaceable


def test_export_policy_refuses_its_model_folder(tiny_reacher_policy):
    model = tiny_reacher_policy.parent / "model"  # conftest's tiny_reacher_policy exported this model folder
    with pytest.raises(UnsafeOutputError, match="it is the source"):
        export_policy(model, model, force=True, progress=False)
    with pytest.raises(UnsafeOutputError, match="it is a parent of the source"):
        export_policy(model, model.parent, force=True, progress=False)
    assert (model / "encoder.safetensors").is_file()


def test_dead_staging_folders_are_removed_live_ones_kept(tmp_path):
    dead = tmp_path / f".engine.partial-{dead_pid()}"
    live = tmp_path / f".engine.partial-{os.getpid()}"
    other = tmp_path / ".notes.partial-x"  # not a pid: not ours
    for d in (dead, live, other):
        d.mkdir()
    assert remove_dead_stages(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_export_replaces_an_engine_folder_and_removes_a_killed_exports_stage(tmp_path):
    """One real tiny export: a stage left by a killed export beside OUT is removed, OUT (an edgespec
    engine folder) is replaced, and nothing but OUT is left."""
    ckpt = tmp_path / "ckpt"
    make_checkpoint("llama", ckpt)
    out = fake_engine(tmp_path / "engines" / "tiny")
    stale = tmp_path / "engines" / f".tiny.partial-{dead_pid()}"
    stale.mkdir()
    (stale / "model.onnx").write_text("half written")
    m = export_engine(ckpt, out, force=True, progress=False, max_context=32)
    assert C.Manifest.read(out) == m and (out / "model.onnx").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == ["tiny"]

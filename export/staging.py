"""Where an export may write: the checks before it starts, its staging folder, and the final swap.

    stage = prepare(out_dir, sources=[ckpt_dir], force=force)   # refuses an unsafe OUT, removes dead stages
    ... write every file into stage ...
    publish(stage, out_dir)                                     # replaces OUT (only an edgespec folder)

An export writes into `.NAME.partial-PID` beside OUT and renames it to OUT when every gate passed, so a
failed export never leaves a folder that loads. `--force` replaces OUT only when OUT is a folder edgespec
wrote (its manifest says so), and never a place whose loss would hurt: the filesystem root, home, the
current directory or one of its parents, the repository or one of its parents, the source model or one of
its parents. A stage whose process is gone (killed mid-export) is removed by the next export beside it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from edgespec import contract as C
from edgespec import policy_contract as PC

STAGE_MARK = ".partial-"  # staging folders are named f".{OUT name}{STAGE_MARK}{pid}"
REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout this edgespec runs from


class UnsafeOutputError(ValueError):
    """An export's output folder that it must not create or replace."""


def stage_dir(out_dir: Path, pid: int | None = None) -> Path:
    return out_dir.parent / f".{out_dir.name}{STAGE_MARK}{os.getpid() if pid is None else pid}"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_edgespec_folder(path: Path) -> bool:
    """A folder edgespec exported: an engine (engine.json with the contract's version and model file) or a
    policy (policy.json whose format is edgespec-vla/...)."""
    engine = _read_json(path / C.MANIFEST_FILE)
    if "contract_version" in engine and "model_file" in engine:
        return True
    fmt = _read_json(path / PC.POLICY_FILE).get("format")
    return isinstance(fmt, str) and fmt.startswith(PC.POLICY_FORMAT)


def _protected(sources: list[Path]) -> dict[Path, str]:
    """Resolved folders OUT must never be -> why."""
    places = {Path(Path.cwd().anchor).resolve(): "the filesystem root", Path.home().resolve(): "your home folder"}
    for what, base in [("the current directory", Path.cwd().resolve()), ("the edgespec repository", REPO_ROOT)] + \
            [(f"the source {s}", s.resolve()) for s in sources]:
        places.setdefault(base, what)
        for parent in base.parents:
            places.setdefault(parent, f"a parent of {what} ({base})")
    return places


def check_out_dir(out_dir: Path, sources: list[Path], force: bool) -> None:
    """Refuse (UnsafeOutputError, or FileExistsError without force) an OUT that export must not write."""
    out = Path(out_dir).resolve()
    why = _protected([Path(s) for s in sources]).get(out)
    if why:
        raise UnsafeOutputError(f"refusing to export into {out_dir}: it is {why}; pass a new folder for --out "
                                f"(e.g. engines/NAME)")
    if not Path(out_dir).exists() and not Path(out_dir).is_symlink():
        return
    if not force:
        raise FileExistsError(f"{out_dir} already exists; pass --force to replace it")
    if Path(out_dir).is_symlink():
        raise UnsafeOutputError(f"refusing to replace {out_dir} with --force: it is a symbolic link (to {out}); "
                                f"pass the folder itself or another --out")
    if not out.is_dir() or not is_edgespec_folder(out):
        raise UnsafeOutputError(f"refusing to replace {out_dir} with --force: it is not an engine or policy folder "
                                f"edgespec exported (expected {C.MANIFEST_FILE} with contract_version or "
                                f"{PC.POLICY_FILE} with format {PC.POLICY_FORMAT}/...); remove it yourself or pick "
                                f"another --out")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, ValueError):
        return False  # a number no process can have
    return True


def remove_dead_stages(parent: Path) -> list[Path]:
    """Remove `.NAME.partial-PID` folders in parent whose process no longer runs -> what was removed."""
    removed = []
    if not parent.is_dir():
        return removed
    for p in parent.glob(f".*{STAGE_MARK}*"):
        pid = p.name.rpartition(STAGE_MARK)[2]
        if p.is_dir() and not p.is_symlink() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def prepare(out_dir: Path, sources: list[Path], force: bool) -> Path:
    """Check OUT, remove dead stages beside it, -> this process's empty staging folder."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, sources, force)
    remove_dead_stages(out_dir.parent)
    stage = stage_dir(out_dir)
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    return stage


def publish(stage: Path, out_dir: Path) -> None:
    """Replace OUT (absent, or an edgespec folder: checked again now) with the finished stage."""
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        if out_dir.is_symlink() or not out_dir.is_dir() or not is_edgespec_folder(out_dir):
            raise UnsafeOutputError(f"{out_dir} changed during the export and is no longer an edgespec folder; "
                                    f"not replacing it")
        shutil.rmtree(out_dir)
    os.replace(stage, out_dir)

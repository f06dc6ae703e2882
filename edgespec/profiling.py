"""Latency profiling on the device: per-round timeline, percentiles, a Chrome/Perfetto trace, and, on a
Jetson, memory-controller load and rail power from `tegrastats` (joules per token).

    edgespec profile --target engines/demo-target --draft engines/demo-draft --trace trace.json
"""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


class Timer:
    """Named wall-clock sections (draft / verify / sampling / prefill); the rest of the wall is 'other'.
    With `events` (a list), every section is also recorded as (name, start, end) for a trace."""

    def __init__(self, events: list | None = None):
        self.t = defaultdict(float)
        self.events = events

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, t0, time.perf_counter())

    def add(self, name: str, t0: float, t1: float) -> None:
        """Record a section timed by the caller (perf_counter stamps): for loops too tight for `with`."""
        self.t[name] += t1 - t0
        if self.events is not None:
            self.events.append((name, t0, t1))


_RAM = re.compile(r"RAM (\d+)/(\d+)MB")
_EMC = re.compile(r"EMC_FREQ (\d+)%(?:@(\d+))?")
_GR3D = re.compile(r"GR3D_FREQ (\d+)%")
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?\b")
NOT_RAILS = {"RAM", "SWAP"}
TOTAL_RAILS = ("VDD_IN", "VIN_SYS_5V0", "POM_5V_IN")  # board input rail, when a board reports one


def parse_tegrastats(line: str) -> dict:
    """One tegrastats line -> {ram_used_mb, ram_total_mb, emc_pct, emc_mhz, gpu_pct, power_mw: {rail: mW}}.
    Fields a board does not print are None (never 0); rails give their current value, not the average."""
    out = {"ram_used_mb": None, "ram_total_mb": None, "emc_pct": None, "emc_mhz": None, "gpu_pct": None,
           "power_mw": {}}
    if m := _RAM.search(line):
        out["ram_used_mb"], out["ram_total_mb"] = int(m.group(1)), int(m.group(2))
    if m := _EMC.search(line):
        out["emc_pct"] = int(m.group(1))
        out["emc_mhz"] = int(m.group(2)) if m.group(2) else None
    if m := _GR3D.search(line):
        out["gpu_pct"] = int(m.group(1))
    for name, cur, _avg in _RAIL.findall(line):
        if name not in NOT_RAILS:
            out["power_mw"][name] = int(cur)
    return out


@dataclass
class TegrastatsSampler:
    """Runs `tegrastats --interval MS` in the background while profiling (Jetson only)."""
    interval_ms: int = 100
    samples: list = field(default_factory=list)  # (time, parsed)

    @property
    def available(self) -> bool:
        return shutil.which("tegrastats") is not None

    def __enter__(self):
        self._proc = None
        if self.available:
            self._proc = subprocess.Popen(["tegrastats", "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            self.samples.append((time.perf_counter(), parse_tegrastats(line)))

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)

    def summary(self, tokens: int) -> dict:
        if not self.available:
            return {"available": False, "reason": "no tegrastats on PATH (not a Jetson): no EMC load or power figures"}
        if len(self.samples) < 2:
            return {"available": False, "reason": f"tegrastats gave {len(self.samples)} samples; run longer"}
        t = np.array([s[0] for s in self.samples])
        emc = [s[1]["emc_pct"] for s in self.samples if s[1]["emc_pct"] is not None]
        rails = sorted({r for _, s in self.samples for r in s["power_mw"]})
        power = {r: float(np.mean([s["power_mw"].get(r, np.nan) for _, s in self.samples])) for r in rails}
        total = next((r for r in TOTAL_RAILS if r in rails), None)
        out = {"available": True, "samples": len(self.samples), "emc_pct_mean": float(np.mean(emc)) if emc else None,
               "power_mw_mean": power}
        if total:
            mw = np.array([s["power_mw"].get(total, np.nan) for _, s in self.samples], dtype=float)
            joules = float(np.trapezoid(mw, t) / 1e3) if hasattr(np, "trapezoid") else float(np.trapz(mw, t) / 1e3)
            out.update(energy_rail=total, joules=joules, joules_per_token=joules / tokens if tokens else None)
        else:
            out["joules_per_token"] = None
            out["reason"] = f"no board input rail among {rails} (expected one of {TOTAL_RAILS})"
        return out


def percentiles(xs) -> dict:
    xs = np.asarray(xs, dtype=float)
    if xs.size == 0:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    return {"p50": float(np.percentile(xs, 50)), "p95": float(np.percentile(xs, 95)),
            "p99": float(np.percentile(xs, 99)), "n": int(xs.size)}


def chrome_trace(events: list, origin: float) -> dict:
    """(name, start, end) perf_counter events -> Chrome trace JSON (open in ui.perfetto.dev)."""
    lanes = {"round": 1, "draft": 2, "verify": 2, "sampling": 2, "prefill": 2}
    out = []
    for name, t0, t1 in events:
        tid = lanes.get(name, 3)  # engine runs and KV writes on their own lane
        out.append({"name": name, "ph": "X", "ts": (t0 - origin) * 1e6, "dur": (t1 - t0) * 1e6, "pid": 1, "tid": tid})
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}}
            for n, t in (("rounds", 1), ("round sections", 2), ("engine calls", 3))]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def round_breakdown(events: list) -> list[dict]:
    """Per round: total, draft, verify, sampling, engine runs, KV writes, and the Python rest (ms)."""
    rounds = [(t0, t1) for n, t0, t1 in events if n == "round"]
    out = []
    j = 0
    ev = sorted(events, key=lambda e: e[1])
    for r0, r1 in rounds:
        parts = {"draft": 0.0, "verify": 0.0, "sampling": 0.0, "engine": 0.0, "kv_write": 0.0}
        while j < len(ev) and ev[j][1] < r0:
            j += 1
        k = j
        while k < len(ev) and ev[k][1] < r1:
            n, t0, t1 = ev[k]
            if n in parts:
                parts[n] += t1 - t0
            elif n.endswith("kv_write"):
                parts["kv_write"] += t1 - t0
            elif ".run" in n:
                parts["engine"] += t1 - t0
            k += 1
        total = r1 - r0
        out.append({"total_ms": total * 1e3, **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
                    "python_ms": (total - parts["engine"] - parts["kv_write"]) * 1e3})
    return out


def profile(gen, prompts: list, max_new_tokens: int = 128, lossless_check: int = 0, **kw) -> tuple[dict, dict]:
    """Decode `prompts` with tracing on; return (report, chrome trace)."""
    events: list = []
    gen.trace = events
    per_round, per_token, ttft, tokens = [], [], [], 0
    origin = time.perf_counter()
    with TegrastatsSampler() as ts:
        t_start = time.perf_counter()
        for p in prompts:
            start = len(events)
            out = gen.generate(p, max_new_tokens=max_new_tokens, **kw)
            rb = round_breakdown(events[start:])
            per_round += rb
            emitted = np.diff([0] + [n for n, _ in out.stats.gamma_history] + [out.stats.new_tokens])[1:]
            for r, e in zip(rb, emitted):
                per_token += [r["total_ms"] / max(int(e), 1)] * max(int(e), 1)
            ttft.append(out.stats.time_s["prefill"] * 1e3)
            tokens += out.stats.new_tokens
        wall = time.perf_counter() - t_start
    gen.trace = None
    keys = ["total_ms", "draft_ms", "verify_ms", "sampling_ms", "engine_ms", "kv_write_ms", "python_ms"]
    report = {"prompts": len(prompts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
              "round_ms": {k[:-3]: percentiles([r[k] for r in per_round]) for k in keys},
              "token_ms": percentiles(per_token), "ttft_ms": percentiles(ttft),
              "tegrastats": ts.summary(tokens)}
    total = sum(r["total_ms"] for r in per_round) or 1.0
    report["round_time_share"] = {k[:-3]: sum(r[k] for r in per_round) / total for k in keys[1:]}
    if lossless_check:
        report["lossless_check"] = lossless(gen, prompts[:lossless_check], max_new_tokens, **kw)
    return report, chrome_trace(events, origin)


def lossless(gen, prompts: list, max_new_tokens: int, **kw) -> dict:
    """Shadow-decode each prompt without speculation (same seed, coupled noise when sampling) and count
    prompts whose output differs: a self-check that speculation changed nothing."""
    plain = gen.plain()
    kw = dict(kw)
    if kw.get("temperature", 0) > 0 and kw.get("acceptance") != "coupled":
        return {"checked": 0, "reason": "sampled output can be compared token for token only with "
                                        "--acceptance coupled (rejection sampling is exact in distribution)"}
    diverged, first = 0, []
    for p in prompts:
        a = gen.generate(p, max_new_tokens=max_new_tokens, **kw).token_ids
        b = plain.generate(p, max_new_tokens=max_new_tokens, **kw).token_ids
        if a != b:
            diverged += 1
            first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"checked": len(prompts), "diverged": diverged, "divergence_rate": diverged / max(len(prompts), 1),
            "first_divergent_token": first}

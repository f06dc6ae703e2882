"""The control loop's latency profile: percentiles, a Chrome / Perfetto trace, and a timeline PNG.

    rep = ControlLoop(robot, policy, LoopConfig(hz=50)).run(10)
    loop_profile(rep)               # dict: per-section / jitter / inference percentiles, misses, faults
    chrome_trace(rep, "loop.json")  # open in ui.perfetto.dev or chrome://tracing
    plot_timeline(rep, "loop.png")  # needs matplotlib (the `bench` extra)
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np

from edgespec.profiling import chrome_trace as _x_events
from edgespec.profiling import percentiles

from .loop import SECTIONS, LoopReport

LOOP_TID, WORKER_TID = 1, 2  # trace tracks: the loop thread, the inference worker


def _stats(xs) -> dict:
    """p50/p95/p99/max (same unit as xs) and n; None values when xs is empty."""
    out = percentiles(xs)
    out["max"] = float(np.max(xs)) if out["n"] else None
    return out


def loop_profile(report: LoopReport, dt: float | None = None) -> dict:
    """Per-section p50/p95/p99/max (ms), tick-period jitter |interval - dt| (ms), deadline misses, starved /
    held / stopped ticks, inference latency (observation -> chunk landed, ms) and outcomes, faults, safe stop.
    `dt` defaults to the report's period."""
    dt = dt or 1.0 / report.hz
    periods = np.diff(np.asarray(report.tick_start_s, dtype=float))  # (ticks - 1,) s
    return {
        "hz": 1.0 / dt, "ticks": report.ticks, "duration_s": report.end_s, "realtime": report.realtime,
        "achieved_hz": (report.ticks - 1) / float(np.sum(periods)) if periods.size else None,
        "sent": report.sent, "held_ticks": report.held, "stopped_ticks": report.stopped_ticks,
        "starved_ticks": report.starved, "deadline_misses": report.deadline_misses,
        "sections_ms": {k: _stats(v) for k, v in report.sections_ms.items()},
        "jitter_ms": _stats(np.abs(periods - dt) * 1e3),
        "inference_ms": _stats(report.inference_ms),
        "inferences": dict(Counter(report.inference_outcome)),
        "queue_dropped_stale": report.queue_dropped_stale,
        "remote": {"fallbacks": report.remote_fallbacks, "unavailable": report.remote_unavailable},
        "clipped_by_robot": report.clipped, "max_clip": report.max_clip,  # sent actions the robot limited
        "gc_pauses_ms": _stats([ms for _, _, ms in report.gc_pauses]),
        "faults": list(report.faults), "safe_stop_reason": report.safe_stop_reason,
        "safe_stop_s": report.safe_stop_s,
    }


def chrome_trace(report: LoopReport, path=None) -> dict:
    """Chrome trace JSON ("traceEvents"; "X" events, ts / dur in µs from run start): track 1 is the loop
    thread (each tick's sections), track 2 the inference worker (each policy call, args.outcome); faults,
    deadline misses and the safe stop are instant events. Written to `path` when given; returned."""
    ticks = []  # (section, start s, end s, tick index)
    for i in range(report.ticks):
        for name in SECTIONS:
            s0 = report.section_start_s[name][i]
            ticks.append((name, s0, s0 + report.sections_ms[name][i] / 1e3, i))
    calls = [("inference" if o == "ok" else f"inference: {o}", a, b, o)
             for a, b, o in zip(report.inference_start_s, report.inference_end_s, report.inference_outcome)]

    def complete(rows, tid, key):  # "X" events via edgespec.profiling's helper, moved to their track
        xs = [e for e in _x_events([r[:3] for r in rows], 0.0)["traceEvents"] if e["ph"] == "X"]
        for e, r in zip(xs, rows):
            e.update(tid=tid, args={key: r[3]})
        return xs
    events = complete(ticks, LOOP_TID, "tick") + complete(calls, WORKER_TID, "outcome")
    start = report.tick_start_s

    def instant(name, t, args, tid=LOOP_TID, scope="g"):
        return {"name": name, "ph": "i", "s": scope, "ts": t * 1e6, "pid": 1, "tid": tid, "args": args}
    events += [instant("fault", t, {"message": m}) for t, m in zip(report.fault_s, report.faults)]
    events += [instant("deadline miss", start[i], {"tick": i}, scope="t") for i in report.deadline_miss_ticks]
    if report.safe_stop_s is not None:
        events.append(instant("safe stop", report.safe_stop_s, {"reason": report.safe_stop_reason}))
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"control loop {report.hz:g} Hz"}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}}
             for t, n in ((LOOP_TID, "loop thread"), (WORKER_TID, "inference worker"))]
    trace = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def plot_timeline(report: LoopReport, path) -> None:
    """PNG timeline. Top: each tick's stacked section durations (ms) vs loop time, the period as a line,
    deadline misses marked. Bottom: inference calls as bars (colour = outcome), starved ticks marked.
    Faults and the safe stop are vertical lines on both. Needs matplotlib (no pyplot, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    prof = loop_profile(report)
    dt_ms = 1e3 / report.hz
    t = np.asarray(report.tick_start_s, dtype=float)  # (ticks,) s
    ys = np.array([report.sections_ms[k] for k in SECTIONS], dtype=float).reshape(len(SECTIONS), -1)  # (4, ticks) ms
    fig = Figure(figsize=(13, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    if t.size:
        top.stackplot(t, ys, labels=SECTIONS, step="post", colors=["tab:blue", "tab:orange", "tab:green", "0.8"])
    top.axhline(dt_ms, color="k", ls="--", lw=1, label=f"period {dt_ms:.1f} ms")
    miss = np.asarray(report.deadline_miss_ticks, dtype=int)
    if miss.size:
        top.scatter(t[miss], ys[:, miss].sum(0), marker="v", color="red", zorder=3,
                    label=f"deadline miss ({miss.size})")
    top.set_ylabel("tick sections (ms)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    colors = {"ok": "tab:green", "raised": "tab:red", "bad chunk": "tab:red", "late": "tab:orange",
              "unfinished": "tab:gray"}
    calls = list(zip(report.inference_start_s, report.inference_end_s, report.inference_outcome))
    for outcome in sorted({o for *_, o in calls}):
        bars = [(a, b - a) for a, b, o in calls if o == outcome]
        bottom.broken_barh(bars, (0.6, 0.8), color=colors.get(outcome, "tab:purple"), label=f"inference: {outcome}")
    acts = np.asarray(report.tick_action)
    for mode, color in (("held", "tab:orange"), ("stopped", "tab:red")):
        sel = acts == mode
        if sel.any():
            bottom.plot(t[sel], np.zeros(sel.sum()), "|", color=color, ms=12, label=f"{mode} tick ({sel.sum()})")
    bottom.set_yticks([0, 1], ["starved ticks", "inference"])
    bottom.set_ylim(-0.6, 1.6)
    bottom.set_xlabel("loop time (s)")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    for ax in (top, bottom):
        for ft in report.fault_s:
            ax.axvline(ft, color="red", ls=":", lw=1)
        if report.safe_stop_s is not None:
            ax.axvline(report.safe_stop_s, color="red", lw=1.5)
    j99 = prof["jitter_ms"]["p99"]
    jitter = f"p99 jitter {j99:.2f} ms" if j99 is not None else "no jitter (< 2 ticks)"
    title = (f"control loop {report.hz:g} Hz: {jitter}, {report.deadline_misses} deadline misses, "
             f"{report.starved} starved ticks")
    if report.safe_stop_reason:
        title += f"\nsafe stop: {report.safe_stop_reason}"
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.8)
    fig.savefig(path, format="png")

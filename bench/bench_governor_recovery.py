"""How soon the native step's default thread count takes back a core that another process has just freed.

    python bench/bench_governor_recovery.py --engine .cache/engines-realsize/llama-3.2-1b-int4 \\
        --out bench/results/governor-recovery/llama-3.2-1b-int4.json

Beside a CPU-bound process the thread governor (edgespec/backends/threads.py) may move a call shape to fewer
threads; when the process stops, the free core should be used again soon. Each trial starts the one-token decode
shape on one thread of a quiet machine (ThreadGovernor.start_on: where the governor stands right after such a
neighbour stops) and decodes --steps tokens greedily on provider cpu-native, recording each step's time and thread
count. Two governors, alternated trial by trial: "watched" (the engine's default: it reads the machine's idle time
and probes the next count up once a core is free) and "schedule" (the same governor without the idle time: it
probes only every probe_every calls, as before). Reports, per governor, the medians over --repeats trials of the
steps and milliseconds until it first runs on every core, and of tok/s over the trial. Writes JSON, a markdown
table and a PNG (each step's thread count and time, one trial of each) beside --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)

SHAPE = (1, 1)  # one sequence, one new token: a decode step's call shape


def trial(engine, gov, prompt: list[int], steps: int) -> dict:
    """Decode `steps` tokens with `gov` as the engine's governor, the decode shape started on one thread."""
    engine.governor = gov
    dec = engine.decoder()
    dec(np.asarray([prompt], np.int64))
    dec.cache.commit(len(prompt))
    gov.start_on(SHAPE, 1)
    nxt = dec.last_ids()[:, -1:]
    ms, used = [], []
    for _ in range(steps):
        t = gov.threads(SHAPE)  # what the engine's next call runs on (threads() is idempotent until observe())
        t0 = time.perf_counter()
        dec(np.ascontiguousarray(nxt, np.int64))
        ms.append((time.perf_counter() - t0) * 1e3)
        used.append(t)
        dec.cache.commit(1)
        nxt = dec.last_ids()[:, -1:]
    back = next((i for i, t in enumerate(used) if t == gov.most), None)
    return {"step_ms": ms, "threads": used, "steps_to_all_cores": back,
            "ms_to_all_cores": None if back is None else float(sum(ms[:back])),
            "tok_s": steps / (sum(ms) / 1e3), "idle_probes": gov.idle_probes, "switches": gov.switches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="an engine folder with native weights")
    ap.add_argument("--out", type=Path, default=Path("bench/results/governor-recovery.json"))
    ap.add_argument("--steps", type=int, default=96, help="tokens per trial (the probe schedule's period is 64)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.repeats < 1:
        ap.error(f"--steps and --repeats must be >= 1, got {a.steps} and {a.repeats}")
    from host import run_record

    from edgespec.backends import open_engine
    from edgespec.backends.threads import ThreadGovernor
    from edgespec.contract import Manifest

    if os.environ.get("EDGESPEC_THREADS"):
        ap.error("the governor runs only with the thread count left open: unset EDGESPEC_THREADS")
    engine = open_engine(a.engine, "cpu-native")
    if engine.governor is None:
        ap.error(f"{a.engine}: opened without a thread governor (one core?): nothing to measure")
    base = engine.governor
    make = {"watched": base.fresh, "schedule": lambda: ThreadGovernor(base.most, base.config)}
    prompt = list(range(10, 42))
    trial(engine, make["watched"](), prompt, 8)  # compile and warm
    started, load_before = time.time(), os.getloadavg()
    trials: dict[str, list[dict]] = {k: [] for k in make}
    for r in range(a.repeats):
        for k in (list(make) if r % 2 == 0 else list(make)[::-1]):
            trials[k].append(trial(engine, make[k](), prompt, a.steps))
            t = trials[k][-1]
            print(f"{k:9s} repeat {r}: all cores after {t['steps_to_all_cores']} steps "
                  f"({t['ms_to_all_cores'] or 0:.0f} ms), {t['tok_s']:.1f} tok/s", flush=True)

    def med(k, key):
        v = [t[key] for t in trials[k] if t[key] is not None]
        return float(np.median(v)) if v else None

    summary = {k: {"steps_to_all_cores": med(k, "steps_to_all_cores"), "ms_to_all_cores": med(k, "ms_to_all_cores"),
                   "tok_s": med(k, "tok_s"), "never": sum(t["steps_to_all_cores"] is None for t in trials[k])}
               for k in make}
    m = Manifest.read(a.engine)
    report = {"command": " ".join(shlex.quote(x) for x in ["python", *sys.argv]), "engine": str(a.engine),
              "weights": m.extra.get("native", {}).get("weights"), "steps": a.steps, "repeats": a.repeats,
              "config": vars(base.config), "summary": summary, "trials": trials,
              "machine": run_record(load_before),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "seconds": round(time.time() - started, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# The thread governor taking back a freed core ({a.engine.name}, {report['weights']} weights)", "",
             f"`{report['command']}`", "",
             f"Each trial: the decode step starts on 1 thread of {base.most} on a quiet machine, {a.steps} steps; "
             f"medians of {a.repeats} trials per governor, alternated.", "",
             "| governor | steps until every core | ms until every core | tok/s over the trial |", "|---|---|---|---|"]
    for k, v in summary.items():
        fmt = (lambda x, f: "never" if x is None else format(x, f))
        lines.append(f"| {k} | {fmt(v['steps_to_all_cores'], '.0f')} | {fmt(v['ms_to_all_cores'], '.0f')} | "
                     f"{fmt(v['tok_s'], '.1f')} |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for k in make:
            t = trials[k][0]
            ax.plot(np.cumsum(t["step_ms"]) / 1e3, 1e3 / np.asarray(t["step_ms"]), label=f"{k} (first trial)")
        ax.set_xlabel("seconds since the neighbour stopped")
        ax.set_ylabel("decode step, tok/s")
        ax.set_title(f"cpu-native, {a.engine.name}: from 1 thread back to {base.most}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

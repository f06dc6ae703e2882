"""A policy's action decode in the caller's own process, on a quiet machine and beside busy processes.

    MUJOCO_GL=osmesa python bench/bench_policy_load.py --out bench/results/policy-load.json
    PYTHONPATH=OTHER_CHECKOUT MUJOCO_GL=osmesa python bench/bench_policy_load.py --out B.json   # an A/B

What a robot's computer looks like: other processes (camera drivers, ROS nodes) keep cores busy. For each --hogs
count (processes that each keep one core busy, bench_loop.Load), every mode decodes the same --obs observations of
the three-target reacher (taken where the bins policy, run closed loop, replans), interleaved observation by observation (plain, exact with the bins policy's draft head,
and, with --fast, the FAST policy's plain and feature-head modes). Per mode and load: median and p90 decode ms, and
the speedup over its plain under the same load. The policy is loaded in this process (edgespec.load_policy), not in
robots/inference.py's child process, which starts with single-threaded BLAS.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import edgespec  # noqa: E402
from bench_loop import Load  # noqa: E402
from host import machine  # noqa: E402
from edgespec.robots.reacher import ThreeTargetReacher  # noqa: E402


def runtime() -> str:
    """Which edgespec ran: its checkout's commit (an A/B puts another checkout on PYTHONPATH)."""
    import subprocess
    where = Path(edgespec.__file__).resolve().parent
    r = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown (not a git checkout)"


def modes(bins: Path, fast: Path | None) -> dict:
    out = {"bins plain": edgespec.load_policy(bins), "bins exact (draft head)": edgespec.load_policy(bins, draft="head")}
    if fast is not None:
        out["FAST plain"] = edgespec.load_policy(fast)
        out["FAST exact (feature head, gamma 2)"] = edgespec.load_policy(fast, draft="head", gamma=2)
    return out


def closed_loop_observations(policy, n: int, execute: int) -> list:
    """n observations where a robot asks for chunks: episodes (seeds 900000+i) run closed loop by `policy`,
    replanning every `execute` steps, an observation kept at each replanning."""
    env, out, seed = ThreeTargetReacher(), [], 900_000
    while len(out) < n:
        o, done = env.reset(seed=seed), False
        seed += 1
        while not done and len(out) < n:
            out.append(o)
            for act in policy.act(o["image"], o["state"], o["instruction"])[:execute]:
                o, _, done, _ = env.step(act)
                if done:
                    break
    env.close()
    return out


def run(pols: dict, obs: list, repeats: int) -> dict:
    """-> {mode: [decode ms per observation (fastest of repeats)]}, modes interleaved per observation."""
    ms = {k: [] for k in pols}
    for o in obs:
        for k, p in pols.items():
            prefix = p.encode(o["image"], o["state"] if p.state_dim else None, o["instruction"])
            best = np.inf
            for _ in range(repeats):
                t = time.perf_counter()
                p.decode_ids(prefix)
                best = min(best, time.perf_counter() - t)
            ms[k].append(best * 1e3)
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bins", type=Path, default=Path("engines/vla-reacher"))
    ap.add_argument("--fast", type=Path, default=None, help="a FAST policy folder with a feature head")
    ap.add_argument("--hogs", default="0,1", help="comma-separated counts of busy processes beside the decoder")
    ap.add_argument("--obs", type=int, default=200, help="observations, from closed-loop episodes of the bins policy")
    ap.add_argument("--execute", type=int, default=4, help="chunk steps executed before replanning")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/policy-load.json"))
    a = ap.parse_args(argv)
    if not (a.bins / "policy.json").is_file():
        from edgespec.export.bundled import ensure_policy_engines
        ensure_policy_engines(Path("models"), Path("engines"))
    pols = modes(a.bins, a.fast)
    obs = closed_loop_observations(pols["bins plain"], a.obs, a.execute)
    run(pols, obs[:3], 1)  # warm-up
    res = {"command": "MUJOCO_GL=osmesa python bench/bench_policy_load.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine(), "runtime": runtime(),
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
        "observations": a.obs, "repeats": a.repeats, "loads": {}}
    for n in (int(h) for h in a.hogs.split(",")):
        with Load(n):
            ms = run(pols, obs, a.repeats)
        rows = {k: {"median_ms": float(np.median(v)), "p90_ms": float(np.percentile(v, 90)),
                    "mean_ms": float(np.mean(v))} for k, v in ms.items()}
        for k, r in rows.items():
            plain = rows[k.split(" ")[0] + " plain"]
            r["speedup_vs_plain_mean"] = plain["mean_ms"] / r["mean_ms"]
            print(f"hogs {n}  {k:36s} median {r['median_ms']:6.2f} ms  p90 {r['p90_ms']:6.2f}  "
                  f"{r['speedup_vs_plain_mean']:.2f}x its plain", flush=True)
        res["loads"][str(n)] = rows
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

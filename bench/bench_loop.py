"""The 20 Hz control loop with the bundled VLA pair on the MuJoCo reacher: plain vs speculative decoding,
on an idle CPU and on a CPU shared with more and more other work, all in one run.

    MUJOCO_GL=osmesa python bench/bench_loop.py --out bench/results/loop.json --load 3,6,9
    MUJOCO_GL=osmesa python bench/bench_loop.py --out bench/results/loop-pinned/loop.json --episodes 15 \
        --load 1,2,1,2,1 --loop-cpus 0 --policy-cpus 1 --rt-priority 50 --spin-ms 2

Phases: "idle" (nothing else running), then "load N" for each N of --load (N background processes each
spinning a single-threaded numpy matmul, standing in for perception / logging on the robot's computer; a
number given again repeats the phase as "load N #2", ...). --loop-cpus / --policy-cpus isolate the loop
on its own core, as robot controllers do, with the policy process and the load processes on the others.
In each phase, plain and speculative (exact; the numpy draft head by default) policies run the same
--episodes reacher episodes (2 s each, seeds 950000+i; the draft head trains on 700000+), interleaved
episode by episode. The policy runs in a child process by default (--inference process; robots/inference.py).
The loop asks for the next chunk when fewer than --request-threshold actions are queued, so an inference
must land within about (threshold - 1) periods or the loop starves (holds the last position target).
Per phase and policy: loop jitter |tick interval - period| p50/p99/max, deadline misses, starved ticks,
section percentiles, inference latency, success. Writes JSON, the Chrome trace and timeline PNG of one
episode per policy at the heaviest load, and a summary PNG.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from host import machine  # noqa: E402
from edgespec.export.bundled import ensure_policy_engines  # noqa: E402
from edgespec.robots.policy_args import cpu_set  # noqa: E402
from edgespec.robots.inference import InferenceProcess, single_threaded_env  # noqa: E402
from edgespec.robots.loop import ControlLoop, LoopConfig  # noqa: E402
from edgespec.robots.profile import chrome_trace, plot_timeline  # noqa: E402
from edgespec.robots.reacher import COLORS, SUCCESS_RADIUS, ReacherRobot  # noqa: E402


SEED0 = 950_000  # loop episodes; bench_vla evaluates on 900000+, the draft head trains on 700000+


def _hog(stop, cpus=None) -> None:  # one busy thread: Load starts it with single-threaded BLAS
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    a = np.random.default_rng(0).random((256, 256))
    while not stop.is_set():
        a = np.tanh(a @ a)


class Load:
    """n background processes keeping CPUs busy (those in `cpus`, default any), for a `with` block."""

    def __init__(self, n: int, cpus=None):
        self.n, self.cpus = n, cpus

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_hog, args=(self.stop, self.cpus), daemon=True) for _ in range(self.n)]
        with single_threaded_env():  # numpy reads it at import in the child: exactly one busy thread each
            for p in self.procs:
                p.start()
        time.sleep(0.5 if self.n else 0.0)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(5)


class PolicyCall:
    def __init__(self, policy):
        self.policy = policy
        self.infos: list[dict] = []

    def __call__(self, obs):
        chunk = self.policy(obs)  # a Policy, or an InferenceProcess running one
        self.infos.append(self.policy.last_info)
        return chunk


def episode(policy, cfg: LoopConfig, seed: int, seconds: float):
    color = list(COLORS)[seed % 3]
    call = PolicyCall(policy)
    with ReacherRobot(seed=seed, color=color) as robot:
        rep = ControlLoop(robot, call, cfg).run(seconds)
        dist = robot.distances[-1] if robot.distances else float("nan")
    return rep, dist, call.infos


def pooled(reps, dists, infos, dt) -> dict:
    periods = np.concatenate([np.diff(np.asarray(r.tick_start_s)) for r in reps])
    jit = np.abs(periods - dt) * 1e3
    inf = np.concatenate([np.asarray(r.inference_ms, float) for r in reps if r.inference_ms] or [np.zeros(0)])
    sect = {k: np.concatenate([np.asarray(r.sections_ms[k]) for r in reps]) for k in reps[0].sections_ms}
    dec = [i["decode_ms"] for ii in infos for i in ii]
    def split(r):  # (ticks before the first chunk landed, starved ticks after it)
        first = r.tick_action.index("sent") if "sent" in r.tick_action else len(r.tick_action)
        return first, sum(a != "sent" for a in r.tick_action[first:])

    startup, after = zip(*(split(r) for r in reps))
    out = {"episodes": len(reps), "ticks": int(sum(r.ticks for r in reps)),
           "startup_ticks": int(sum(startup)),  # holding the start pose until the first chunk lands
           "starved_after_first_chunk": int(sum(after)),
           "episodes_starved_after_first_chunk": int(sum(a > 0 for a in after)),
           "jitter_ms": {"p50": float(np.percentile(jit, 50)), "p99": float(np.percentile(jit, 99)),
                         "max": float(jit.max())},
           "deadline_misses": int(sum(r.deadline_misses for r in reps)),
           "starved_ticks": int(sum(r.starved for r in reps)),
           "episodes_with_starved_ticks": int(sum(r.starved > 0 for r in reps)),
           "held_ticks": int(sum(r.held for r in reps)), "stopped_ticks": int(sum(r.stopped_ticks for r in reps)),
           "faults": [f for r in reps for f in r.faults],
           "inference_ms": {"p50": float(np.percentile(inf, 50)), "p99": float(np.percentile(inf, 99)),
                            "max": float(inf.max())} if inf.size else None,
           "decode_ms": {"p50": float(np.percentile(dec, 50)), "p99": float(np.percentile(dec, 99))},
           "sections_ms_p99": {k: float(np.percentile(v, 99)) for k, v in sect.items()},
           "success_rate": float(np.mean(np.asarray(dists) <= SUCCESS_RADIUS)),
           "queue_dropped_stale": int(sum(r.queue_dropped_stale for r in reps)),
           "realtime": sorted({r.realtime for r in reps}),
           "realtime_worker": sorted({r.realtime_worker for r in reps}),
           "loop_cpus": sorted({r.cpus for r in reps}),
           "gc_pauses": {"collections": int(sum(len(r.gc_pauses) for r in reps)),  # in the loop's process
                         "max_ms": float(max((ms for r in reps for _, _, ms in r.gc_pauses), default=0.0))}}
    acc = [i for ii in infos for i in ii if i.get("rounds")]
    if acc:
        out["tokens_per_round"] = float(np.mean([i["tokens_per_round"] for i in acc]))
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    phases = list(results["phases"])
    x = np.arange(len(phases))
    for k, (name, key, title) in enumerate([("starved", "starved_after_first_chunk",
                                             "starved ticks after the first chunk"),
                                            ("jitter p99 (ms)", None, "loop jitter p99 (ms)"),
                                            ("inference p99 (ms)", None, "inference latency p99 (ms)")]):
        ax = axes[k]
        for j, pol in enumerate(("plain", "speculative")):
            vals = []
            for ph in phases:
                r = results["phases"][ph][pol]
                vals.append(r[key] if key else (r["jitter_ms"]["p99"] if k == 1 else r["inference_ms"]["p99"]))
            ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, label=pol)
        if k == 1:
            ax.axhline(2.0, ls=":", c="gray", lw=1)
        if k == 2:
            ax.axhline(1e3 * (results["request_threshold"] - 1) / results["hz"], ls=":", c="gray", lw=1,
                       label="slack before starving")
        ax.set_xticks(x, phases)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['hz']:g} Hz control loop, bundled VLA pair, MuJoCo reacher", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/loop.json")
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--hz", type=float, default=20.0)
    ap.add_argument("--load", default="3", help="background busy processes per loaded phase, comma-separated "
                    "(one phase each, after the idle phase; a number given again repeats that phase)")
    ap.add_argument("--request-threshold", type=int, default=2)
    ap.add_argument("--draft", default="head", help="speculative policy's draft: 'head' or 'decoder'")
    ap.add_argument("--gamma", type=int, default=15)
    ap.add_argument("--stop-below", type=float, default=0.6)
    ap.add_argument("--inference", choices=["process", "thread"], default="process",
                    help="policy in a child process (default) or in the loop's worker thread")
    ap.add_argument("--spin-ms", type=float, default=0.0, help="busy-wait the last ms before each tick")
    ap.add_argument("--policy-nice", type=int, default=None,
                    help="nice value for the policy process (negative raises its priority; needs CAP_SYS_NICE)")
    ap.add_argument("--rt-priority", type=int, default=None, help="SCHED_FIFO priority for the loop thread")
    ap.add_argument("--loop-cpus", type=cpu_set, default=None,
                    help="CPUs for the loop thread, e.g. 0 (default: any)")
    ap.add_argument("--policy-cpus", type=cpu_set, default=None,
                    help="CPUs for the policy process and the load processes, e.g. 1 (default: any)")
    ap.add_argument("--models", default="models")
    ap.add_argument("--engines", default="engines")
    args = ap.parse_args(argv)
    try:
        loads = [int(x) for x in str(args.load).split(",")]
        assert all(n > 0 for n in loads)
    except (ValueError, AssertionError):
        ap.error(f"--load must be positive integers separated by commas, got {args.load!r}")
    loop_cpus, policy_cpus = args.loop_cpus, args.policy_cpus
    for flag, cpus in (("--loop-cpus", loop_cpus), ("--policy-cpus", policy_cpus)):
        if cpus is not None and not cpus <= os.sched_getaffinity(0):
            ap.error(f"{flag} {sorted(cpus)}: this machine lets the bench use CPUs {sorted(os.sched_getaffinity(0))}")
    engines = ensure_policy_engines(args.models, args.engines)
    kw = {"plain": {}, "speculative": dict(draft="head" if args.draft == "head" else True, gamma=args.gamma,
                                           stop_below=args.stop_below)}
    if args.inference == "process":
        policies = {k: InferenceProcess(partial(edgespec.load_policy, str(engines), **v), nice=args.policy_nice,
                                        cpus=policy_cpus) for k, v in kw.items()}
    else:
        if policy_cpus is not None:
            ap.error("--policy-cpus needs --inference process (a thread runs on the loop's CPUs)")
        policies = {k: edgespec.load_policy(engines, **v) for k, v in kw.items()}
    cfg = LoopConfig(hz=args.hz, request_threshold=args.request_threshold, rt_priority=args.rt_priority,
                     rt_worker=args.inference == "process", spin_s=args.spin_ms / 1e3, cpus=loop_cpus)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"command": "MUJOCO_GL=osmesa python bench/bench_loop.py " + " ".join(argv or sys.argv[1:]),
               "machine": machine(), "hz": args.hz, "request_threshold": args.request_threshold,
               "load_processes": loads, "speculative": kw["speculative"], "inference": args.inference,
               "rt_priority": args.rt_priority, "policy_nice": args.policy_nice,
               "spin_ms": args.spin_ms, "loop_cpus": sorted(loop_cpus) if loop_cpus else None,
               "policy_cpus": sorted(policy_cpus) if policy_cpus else None, "phases": {}}
    t0 = time.time()
    phases = [("idle", 0)]
    for n in loads:  # a load given twice runs twice: "load 1", then "load 1 #2" (a repeat in the same run)
        k = sum(m == n for _, m in phases)
        phases.append((f"load {n}" + (f" #{k + 1}" if k else ""), n))
    for phase, n in phases:
        acc = {k: ([], [], []) for k in policies}
        with Load(n, policy_cpus):
            for ep in range(args.episodes):
                for name, pol in policies.items():
                    rep, dist, infos = episode(pol, cfg, SEED0 + ep, args.seconds)
                    acc[name][0].append(rep), acc[name][1].append(dist), acc[name][2].append(infos)
                    if phase == f"load {max(loads)}" and ep == 0:  # the trace of one episode at the heaviest load
                        stem = out.with_name(f"loop-load{n}-{name}")
                        chrome_trace(rep, stem.with_suffix(".trace.json"))
                        plot_timeline(rep, stem.with_suffix(".png"))
        results["phases"][phase] = {k: pooled(*v, cfg.dt) for k, v in acc.items()}
        for k, r in results["phases"][phase].items():
            print(f"{phase:10s} {k:11s} jitter p99 {r['jitter_ms']['p99']:.2f} ms, starved after the first chunk "
                  f"{r['starved_after_first_chunk']} ({r['episodes_starved_after_first_chunk']}/{r['episodes']} "
                  f"episodes; start-up {r['startup_ticks']}), inference p50/p99 "
                  f"{r['inference_ms']['p50']:.1f}/{r['inference_ms']['p99']:.1f} ms, success {r['success_rate']:.2f}")
    for pol in policies.values():
        if isinstance(pol, InferenceProcess):
            pol.close()
    results["wall_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run-to-run stability of `--gamma auto`: the bundled demo pair loaded fresh several times.

    python bench/bench_auto_gamma.py --out bench/results/auto-gamma.json

Each load is a new process (new ONNX Runtime sessions, a new load-time cost measurement). In it the same
held-out code prompts are decoded greedily with `--gamma auto` and with plain decoding (γ = 0 on the same
engines), interleaved prompt by prompt, and tokens/s of each over all prompts is recorded. Reported: per
load tokens/s of both, the speedup, the γ auto chose, the cost model it measured; over loads the spread
(min / median / max, and (max - min) / median) of each. The goal: auto's spread no wider than plain's own
(plain decoding has no cost model, so its spread is the machine's). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
from prompts import code_prompts  # noqa: E402


def one_load(args) -> dict:
    """In this (fresh) process: load the pair with auto γ, decode every prompt with auto and with plain."""
    import edgespec
    t = time.perf_counter()
    gen = edgespec.load(args.target, draft=args.draft, gamma="auto", gamma_max=args.gamma_max)
    load_s = time.perf_counter() - t
    measured = gen.cost.to_dict()
    prompts = code_prompts(gen.tok, args.prompts, args.context)
    for g in ("auto", 0):  # warm every shape outside the timed decoding
        gen.generate(prompts[0], max_new_tokens=16, gamma=g)
    acc = {name: {"time_s": 0.0, "tokens": 0} for name in ("plain", "auto")}
    gammas, accepted, drafted, mismatches = [], 0, 0, 0
    for i, p in enumerate(prompts):
        order = ("plain", "auto") if i % 2 == 0 else ("auto", "plain")  # neither always runs first
        outs = {}
        for name in order:
            out = gen.generate(p, max_new_tokens=args.max_new_tokens, gamma=0 if name == "plain" else "auto")
            acc[name]["time_s"] += out.stats.time_s["decode"]
            acc[name]["tokens"] += out.stats.new_tokens
            outs[name] = out
        mismatches += outs["plain"].token_ids != outs["auto"].token_ids
        st = outs["auto"].stats
        gammas += [g for _, g in st.gamma_history]
        accepted, drafted = accepted + st.accepted, drafted + st.drafted
    tps = {name: a["tokens"] / a["time_s"] for name, a in acc.items()}
    return {"load_s": load_s, "plain_tok_s": tps["plain"], "auto_tok_s": tps["auto"],
            "speedup": tps["auto"] / tps["plain"], "mean_gamma": float(np.mean(gammas)),
            "gamma_counts": np.bincount(gammas, minlength=args.gamma_max + 1).tolist(),
            "acceptance_rate": accepted / drafted if drafted else 0.0, "mismatches": mismatches,
            "cost_model_at_load": measured, "cost_model_after": gen.cost.to_dict(), **acc}


def spread(xs: list[float]) -> dict:
    med = float(np.median(xs))
    return {"min": float(min(xs)), "median": med, "max": float(max(xs)),
            "relative_spread": (max(xs) - min(xs)) / med if med else float("nan")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--loads", type=int, default=5, help="fresh loads (one process each)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--context", type=int, default=96, help="prompt length in tokens")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma-max", type=int, default=8)
    ap.add_argument("--draft", default=None, help="draft engine folder or 'ngram' (default: the demo draft)")
    ap.add_argument("--engines", type=Path, default=Path("engines"))
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one load, JSON on stdout
    ap.add_argument("--target", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loads < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        ap.error(f"--loads, --prompts and --max-new-tokens must be >= 1, got {args.loads}, {args.prompts}, "
                 f"{args.max_new_tokens}")
    if args.worker:
        print(json.dumps(one_load(args)))
        return 0

    from edgespec.export.bundled import ensure_demo_engines
    from host import machine
    target, draft = ensure_demo_engines(args.models, args.engines)
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(args.out),
              "--target", str(target), "--draft", str(args.draft or draft), "--prompts", str(args.prompts),
              "--context", str(args.context), "--max-new-tokens", str(args.max_new_tokens),
              "--gamma-max", str(args.gamma_max)]
    loads = []
    for i in range(args.loads):
        t = time.perf_counter()
        r = subprocess.run(worker, capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stderr)
            raise SystemExit(f"load {i + 1} failed (exit {r.returncode})")
        loads.append(json.loads(r.stdout.strip().splitlines()[-1]))
        x = loads[-1]
        print(f"load {i + 1}/{args.loads}: plain {x['plain_tok_s']:.1f} tok/s, auto {x['auto_tok_s']:.1f} tok/s "
              f"({x['speedup']:.2f}x, mean γ {x['mean_gamma']:.2f}, load {x['load_s']:.1f} s, "
              f"{time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    summary = {key: spread([x[key] for x in loads]) for key in ("plain_tok_s", "auto_tok_s", "speedup",
                                                                 "mean_gamma", "load_s")}
    verdict = summary["auto_tok_s"]["relative_spread"] <= summary["plain_tok_s"]["relative_spread"]
    report = {"command": "python bench/bench_auto_gamma.py " + shlex.join(argv), "machine": machine(),
              "draft": str(args.draft or draft), "prompts": args.prompts, "context": args.context,
              "max_new_tokens": args.max_new_tokens, "gamma_max": args.gamma_max,
              "summary": summary, "auto_spread_within_plain_spread": verdict,
              "mismatches": sum(x["mismatches"] for x in loads), "loads": loads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key in ("plain_tok_s", "auto_tok_s", "speedup"):
        s = summary[key]
        print(f"{key:12s} min {s['min']:8.2f}  median {s['median']:8.2f}  max {s['max']:8.2f}  "
              f"spread {100 * s['relative_spread']:.1f}%")
    print(f"auto's spread {'within' if verdict else 'WIDER than'} plain's; outputs differing from plain: "
          f"{report['mismatches']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

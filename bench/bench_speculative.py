"""Speculative vs plain decoding on the bundled pair, same engines, one run.

    python bench/bench_speculative.py --out bench/results/speculative.json

Greedy, held-out code prompts. For each configuration (plain; draft model with γ = 1..8 and auto;
n-gram with auto) the prompts are decoded `--repeats` times, interleaved, and reported as tokens/s
(median, min, max over repeats) and speedup over plain decoding measured in the same repeat. Also:
predicted speedup from the paper's formula with the measured α, draft cost and verify cost; time
outside engine calls; the cost of one round at contexts 64..1024. Writes JSON and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from edgespec.export.bundled import ensure_demo_engines  # noqa: E402
from edgespec.costmodel import expected_tokens  # noqa: E402
from edgespec.backends.ort import OrtDecoder  # noqa: E402
from prompts import code_prompts  # noqa: E402
from host import machine  # noqa: E402


def alpha_hat(accepted: int, rejections: int) -> float:
    """Per-token acceptance α: accepted drafts over drafts tried (a round stops at its first rejection)."""
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def round_cost_vs_context(gen, gamma: int, contexts=(64, 128, 256, 512, 1024), reps: int = 15) -> dict:
    """Median seconds of one synthetic round (γ draft calls + one verify call of γ+1) at each context."""
    rng = np.random.default_rng(0)
    v = gen.target.manifest.vocab_size
    out = {}
    for ctx in contexts:
        tgt, dft = OrtDecoder(gen.target, 1), OrtDecoder(gen.draft, 1)
        ids = rng.integers(0, v, (1, ctx))
        tgt(ids)
        dft(ids)
        tgt.cache.commit(ctx)
        dft.cache.commit(ctx)
        one, ver = rng.integers(0, v, (1, 1)), rng.integers(0, v, (1, gamma + 1))
        ts = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            for _ in range(gamma):
                dft.ids(one)
            tgt.ids(ver)
            ts.append(time.perf_counter() - t)
        out[ctx] = float(np.median(ts[2:]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/speculative.json"))
    ap.add_argument("--engines", type=Path, default=Path("engines"))
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gammas", default="1,2,3,4,5,6,8")
    args = ap.parse_args(argv)

    target, draft = ensure_demo_engines(args.models, args.engines)
    plain = edgespec.load(target)
    prompts = code_prompts(plain.tok, args.prompts)
    configs = {"plain": plain}
    for g in map(int, args.gammas.split(",")):
        configs[f"draft γ={g}"] = edgespec.load(target, draft=draft, gamma=g)
    configs["draft auto"] = edgespec.load(target, draft=draft, gamma="auto")
    configs["ngram auto"] = edgespec.load(target, draft="ngram", gamma="auto")
    configs["ngram γ=4"] = edgespec.load(target, draft="ngram", gamma=4)
    cost = configs["draft auto"].measure_costs(reps=9)
    configs["ngram auto"].measure_costs(reps=9)
    for gen in configs.values():  # warm every shape
        gen.generate(prompts[0], max_new_tokens=16)

    rows = {name: {"time": [], "tokens": [], "engine": [], "accepted": 0, "drafted": 0, "rounds": 0,
                   "rejections": 0, "new_tokens": 0, "target_calls": 0, "hist": np.zeros(9, int), "gammas": []} for name in configs}
    mismatches = {name: 0 for name in configs}
    t_start = time.time()
    for rep in range(args.repeats):
        per = {name: [0.0, 0, 0.0] for name in configs}
        for i, prompt in enumerate(prompts):
            ref = None
            for name, gen in configs.items():
                out = gen.generate(prompt, max_new_tokens=args.max_new_tokens)
                st = out.stats
                per[name][0] += st.time_s["decode"]
                per[name][1] += st.new_tokens
                per[name][2] += st.engine_s
                if name == "plain":
                    ref = out.token_ids
                elif out.token_ids != ref:
                    mismatches[name] += 1
                if rep == 0:
                    r = rows[name]
                    r["accepted"] += st.accepted
                    r["drafted"] += st.drafted
                    r["rounds"] += st.rounds
                    r["new_tokens"] += st.new_tokens
                    r["target_calls"] += st.target_calls
                    r["rejections"] += st.rejections
                    r["hist"] += np.array(st.histogram)
                    r["gammas"] += [g for _, g in st.gamma_history]
            print(f"repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)} "
                  f"({time.time() - t_start:.0f} s)", end="\r", file=sys.stderr, flush=True)
        for name in configs:
            rows[name]["time"].append(per[name][0])
            rows[name]["tokens"].append(per[name][1])
            rows[name]["engine"].append(per[name][2])
    print(file=sys.stderr)

    t1 = cost.t_verify[0]
    c = cost.t_draft / t1
    results = {}
    plain_times = np.array(rows["plain"]["time"])
    for name, r in rows.items():
        t, n = np.array(r["time"]), np.array(r["tokens"])
        tps = n / t
        speed = plain_times / t * (n / np.array(rows["plain"]["tokens"]))
        a = alpha_hat(r["accepted"], r["rejections"])
        entry = {"tokens_per_s": {"median": float(np.median(tps)), "min": float(tps.min()), "max": float(tps.max())},
                 "speedup_vs_plain": {"median": float(np.median(speed)), "min": float(speed.min()),
                                      "max": float(speed.max())},
                 "host_fraction": float(1 - np.sum(r["engine"]) / np.sum(t)),
                 "outputs_identical_to_plain": mismatches[name] == 0, "mismatched_prompts": mismatches[name]}
        if r["drafted"]:
            g_mean = float(np.mean([g for g in r["gammas"] if g > 0])) if any(r["gammas"]) else 0.0
            g = int(name.split("=")[1]) if "γ=" in name else round(g_mean)
            entry.update(acceptance_rate=r["accepted"] / r["drafted"], alpha=a,
                         mean_accepted_per_round=r["accepted"] / r["rounds"],
                         tokens_per_round=r["new_tokens"] / r["target_calls"],  # per target call
                         accept_histogram=r["hist"].tolist(), mean_gamma=g_mean)
            if name.startswith("draft") and g > 0:
                pred = expected_tokens(a, g) / (g * c + cost.t_verify[g] / t1)
                entry.update(predicted_speedup=pred, measured_over_predicted=entry["speedup_vs_plain"]["median"] / pred)
        results[name] = entry
    best = max((n for n in results if n.startswith("draft γ")), key=lambda n: results[n]["speedup_vs_plain"]["median"])
    g_best = int(best.split("=")[1])
    rc = round_cost_vs_context(configs[best], g_best)
    report = {
        "command": "python bench/bench_speculative.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "decoding": "greedy",
        "cost_model": {**cost.to_dict(), "c_draft_over_target": c,
                       "verify_over_single": [t / t1 for t in cost.t_verify]},
        "results": results,
        "best_fixed_gamma": g_best,
        "round_cost_vs_context_ms": {str(k): v * 1e3 for k, v in rc.items()},
        "round_cost_1024_over_64": rc[1024] / rc[64],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    for name, e in results.items():
        extra = f" acceptance {e['acceptance_rate']:.3f}" if "acceptance_rate" in e else ""
        pred = f" (predicted {e['predicted_speedup']:.2f}x)" if "predicted_speedup" in e else ""
        print(f"{name:12s} {e['tokens_per_s']['median']:7.1f} tok/s  {e['speedup_vs_plain']['median']:.2f}x{pred}"
              f"  host {100 * e['host_fraction']:.1f}%{extra}  identical={e['outputs_identical_to_plain']}")
    print(f"round cost at 1024 / at 64: {report['round_cost_1024_over_64']:.3f}")
    return 0


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return
    res = report["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(res)
    axes[0].barh(names, [res[n]["tokens_per_s"]["median"] for n in names], color="tab:blue")
    axes[0].set_xlabel("tokens/s (median over repeats)")
    axes[0].invert_yaxis()
    axes[0].set_title("Throughput, greedy, code prompts")
    gs = sorted(int(n.split("=")[1]) for n in res if n.startswith("draft γ"))
    meas = [res[f"draft γ={g}"]["speedup_vs_plain"]["median"] for g in gs]
    pred = [res[f"draft γ={g}"].get("predicted_speedup", np.nan) for g in gs]
    axes[1].plot(gs, meas, "o-", label="measured")
    axes[1].plot(gs, pred, "s--", label="predicted (paper's formula)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xlabel("draft length γ")
    axes[1].set_ylabel("speedup over plain decoding")
    axes[1].legend()
    axes[1].set_title("Speedup vs γ")
    g = report["best_fixed_gamma"]
    h = res[f"draft γ={g}"]["accept_histogram"][:g + 1]
    axes[2].bar(range(len(h)), h)
    axes[2].set_xlabel(f"draft tokens accepted per round (γ={g})")
    axes[2].set_ylabel("rounds")
    axes[2].set_title("Acceptance histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

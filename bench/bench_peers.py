"""edgespec vs ONNX Runtime GenAI and Hugging Face assisted generation, same checkpoints, same prompts.

    bash bench/setup_peers.sh && python bench/bench_peers.py --out bench/results/peers.json

Every system runs in its own process (so peak RSS is its own): edgespec through this script's
`--edgespec-runner` mode, the peers through bench/peers/*_runner.py in their virtual environments.
Greedy runs compare every system's tokens with edgespec plain; a sampled edgespec run reports speed
and acceptance. A peer that fails to install or run is recorded with its error, never dropped.
Writes JSON, a markdown table (.md) and a PNG beside --out.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


def _prompts(n_code: int) -> list[str]:
    import edgespec
    from prompts import PROSE, code_prompts
    tok = edgespec.tokenizer.TextTokenizer(ROOT / "models" / "demo-target" / "tokenizer.json")
    return code_prompts(tok, n_code) + PROSE


def edgespec_runner(args) -> None:
    """Subprocess: decode the prompts with edgespec in one mode; print one JSON object."""
    import edgespec
    from edgespec.cli import ensure_demo_engines
    target, draft = ensure_demo_engines(ROOT / "models", args.engines)
    prompts = json.loads(args.prompts.read_text())
    d = {"plain": None, "draft": draft, "ngram": "ngram"}[args.mode]
    gen = edgespec.load(target, draft=d, gamma=args.gamma if args.gamma is not None else "auto")
    kw = dict(max_new_tokens=args.max_new_tokens)
    if args.temperature:
        kw.update(temperature=args.temperature, seed=0, acceptance="rejection")
    gen.generate(prompts[0], max_new_tokens=16)  # warm-up (and the auto-γ cost measurement)
    results = []
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            if args.temperature:
                kw["seed"] = rep * 1000 + i
            out = gen.generate(p, **kw)
            st = out.stats
            results.append({"prompt_index": i, "repeat": rep, "token_ids": out.token_ids, "new_tokens": st.new_tokens,
                            "decode_s": st.time_s["decode"], "ttft_s": st.time_s["prefill"],
                            "tokens_per_s": st.tokens_per_second, "drafted": st.drafted, "accepted": st.accepted,
                            "rounds": st.rounds, "rejections": st.rejections, "host_fraction": st.host_fraction})
    cost = gen.cost.to_dict() if gen.cost else None
    print(json.dumps({"system": f"edgespec {edgespec.__version__}", "mode": args.mode, "results": results,
                      "cost_model": cost,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_system(name: str, cmd: list[str], timeout: int) -> dict:
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[:3])} …", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except FileNotFoundError as e:
        return {"error": f"could not start: {e} (run bash bench/setup_peers.sh)"}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {p.returncode}, no JSON; stderr tail: {p.stderr[-1500:]}"}
    out = json.loads(lines[-1])
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def summarize(out: dict, ref: dict | None, n_prompts: int) -> dict:
    if "error" in out:
        return {"status": "failed", "error": out["error"]}
    res = out["results"]
    reps = sorted({r["repeat"] for r in res})
    tps = [sum(r["new_tokens"] for r in res if r["repeat"] == k) / sum(r["decode_s"] for r in res if r["repeat"] == k)
           for k in reps]
    s = {"status": "ok", "system": out.get("system"), "tokens_per_s": {"median": float(np.median(tps)),
         "min": float(min(tps)), "max": float(max(tps))}, "repeats": len(reps),
         "ttft_ms_median": float(np.median([r["ttft_s"] for r in res]) * 1e3),
         "peak_rss_mib": out.get("peak_rss_bytes", 0) / 2 ** 20}
    drafted = sum(r.get("drafted", 0) for r in res if r["repeat"] == 0)
    spec = out.get("speculative_stats") or {}
    if drafted:
        acc = sum(r["accepted"] for r in res if r["repeat"] == 0)
        rounds = sum(r["rounds"] for r in res if r["repeat"] == 0)
        s.update(acceptance_rate=acc / drafted, mean_accepted_per_round=acc / rounds)
    elif spec:
        prop = spec.get("draft_tokens_evaluated") or spec.get("draft_tokens_proposed")
        acc = spec.get("draft_tokens_accepted")
        if prop and acc is not None:
            s["acceptance_rate"] = acc / prop
        if spec.get("rounds") and acc is not None:
            s["mean_accepted_per_round"] = acc / spec["rounds"]
    if ref is not None:
        ours = {r["prompt_index"]: r["token_ids"] for r in ref["results"] if r["repeat"] == 0}
        theirs = {r["prompt_index"]: r["token_ids"] for r in res if r["repeat"] == 0}
        same = sum(ours.get(i) == theirs.get(i) for i in range(n_prompts))
        tok = [np.mean([a == b for a, b in zip(ours[i], theirs[i])]) if ours[i] and theirs[i] else 0.0
               for i in range(n_prompts) if i in ours and i in theirs]
        s.update(identical_prompts=f"{same}/{n_prompts}", token_agreement_with_edgespec=float(np.mean(tok)))
    return s


def memory_bandwidth_gbs(mib: int = 512, reps: int = 5) -> dict:
    """Read bandwidth (a sum over a 512 MiB array, what streaming weights needs) and copy bandwidth
    (read + write) of this machine, measured with numpy on all cores it will use."""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(mib * 2 ** 20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    rd, cp = [], []
    with ThreadPoolExecutor(n) as pool:  # numpy releases the GIL in reductions: one slice per core
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(lambda x: x.sum(dtype=np.float32), parts))
            rd.append(time.perf_counter() - t)
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        cp.append(time.perf_counter() - t)
    return {"read_gbs": a.nbytes / min(rd) / 1e9, "copy_gbs": 2 * a.nbytes / min(cp) / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    ap.add_argument("--engines", type=Path, default=ROOT / "engines")
    ap.add_argument("--code-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-repeats", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=None, help="edgespec/peer draft length (default: edgespec auto, peers 4)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--only", default=None, help="comma-separated system names to (re)run; others are read "
                                                  "from the previous run's .cache/peers/raw.json")
    ap.add_argument("--edgespec-runner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.edgespec_runner:
        edgespec_runner(args)
        return 0

    work = ROOT / ".cache" / "peers"
    work.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args.code_prompts)
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    me = [sys.executable, str(Path(__file__).resolve()), "--edgespec-runner", "--prompts", str(pfile),
          "--engines", str(args.engines), "--max-new-tokens", str(args.max_new_tokens)]
    tgt, dft = str(ROOT / "models" / "demo-target"), str(ROOT / "models" / "demo-draft")
    g_peer = str(args.gamma or 4)
    genai = [str(ROOT / ".venv-genai" / "bin" / "python"), str(HERE / "peers" / "genai_runner.py"), "--target", tgt,
             "--draft", dft, "--prompts", str(pfile), "--max-new-tokens", str(args.max_new_tokens),
             "--repeats", str(args.peer_repeats), "--work", str(work / "genai")]
    hf = [str(ROOT / ".venv-hf" / "bin" / "python"), str(HERE / "peers" / "hf_runner.py"), "--target", tgt,
          "--draft", dft, "--prompts", str(pfile), "--max-new-tokens", str(args.max_new_tokens),
          "--repeats", str(args.peer_repeats)]
    optimum = [str(ROOT / ".venv-optimum" / "bin" / "python"), str(HERE / "peers" / "optimum_runner.py"),
               "--target", tgt, "--prompts", str(pfile), "--max-new-tokens", str(args.max_new_tokens),
               "--repeats", str(args.peer_repeats), "--work", str(work / "optimum")]
    eg = [] if args.gamma is None else ["--gamma", str(args.gamma)]
    systems = {
        "edgespec plain": me + ["--mode", "plain", "--repeats", str(args.repeats)],
        "edgespec draft": me + ["--mode", "draft", "--repeats", str(args.repeats)] + eg,
        "edgespec ngram": me + ["--mode", "ngram", "--repeats", str(args.repeats)] + eg,
        "ORT GenAI plain": genai + ["--mode", "plain"],
        "ORT GenAI draft": genai + ["--mode", "draft", "--gamma", g_peer],
        "ORT GenAI ngram": genai + ["--mode", "ngram", "--gamma", g_peer],
        "HF plain": hf + ["--mode", "plain"],
        "HF assisted": hf + ["--mode", "assisted", "--gamma", g_peer],
        "HF prompt lookup": hf + ["--mode", "prompt_lookup", "--gamma", g_peer],
        "optimum ORTModelForCausalLM plain": optimum,
        "edgespec draft sampled T=0.8": me + ["--mode", "draft", "--repeats", "1", "--temperature", "0.8"] + eg,
    }
    prev = json.loads((work / "raw.json").read_text()) if args.only and (work / "raw.json").is_file() else {}
    only = set(args.only.split(",")) if args.only else set(systems)
    raw = {name: run_system(name, cmd, args.timeout) if name in only or name not in prev else prev[name]
           for name, cmd in systems.items()}
    (work / "raw.json").write_text(json.dumps(raw))
    ref = raw["edgespec plain"] if "error" not in raw["edgespec plain"] else None
    table = {name: summarize(out, ref if "sampled" not in name else None, len(prompts)) for name, out in raw.items()}

    def tps(name):
        t = table.get(name, {})
        return t["tokens_per_s"]["median"] if t.get("status") == "ok" else None

    ratios = {}
    for a, b in (("edgespec draft", "ORT GenAI draft"), ("edgespec draft", "HF assisted"),
                 ("edgespec plain", "ORT GenAI plain"), ("edgespec draft", "edgespec plain"),
                 ("ORT GenAI draft", "ORT GenAI plain"), ("HF assisted", "HF plain"),
                 ("edgespec ngram", "ORT GenAI ngram"), ("edgespec ngram", "HF prompt lookup")):
        if tps(a) and tps(b):
            ratios[f"{a} / {b}"] = tps(a) / tps(b)
    bw = memory_bandwidth_gbs()
    weights = (args.engines / "demo-target" / "model.onnx").stat().st_size
    m = json.loads((args.engines / "demo-target" / "engine.json").read_text())
    ctx = 160  # ~ mean context of these runs (prompt ~96 + half of 128 new tokens)
    kv = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4 * ctx
    roof = bw["read_gbs"] * 1e9 / (weights + kv)
    roofline = {"read_bandwidth_gbs": bw["read_gbs"], "copy_bandwidth_gbs": bw["copy_gbs"],
                "bytes_per_token": weights + kv, "weights_bytes": weights,
                "kv_bytes_at_mean_context": kv, "roofline_tokens_per_s": roof,
                "plain_share_of_roofline": {n: tps(n) / roof for n in ("edgespec plain", "ORT GenAI plain", "HF plain")
                                            if tps(n)}}
    pred = None
    ed = raw.get("edgespec draft", {})
    if "error" not in ed and ed.get("cost_model"):
        from edgespec.costmodel import expected_tokens
        cm = ed["cost_model"]
        r0 = [r for r in ed["results"] if r["repeat"] == 0]
        acc, rej, dr, rounds = (sum(r[k] for r in r0) for k in ("accepted", "rejections", "drafted", "rounds"))
        alpha = acc / (acc + rej) if acc + rej else 0.0
        g = round(dr / rounds) if rounds else 0
        t1 = cm["t_verify_ms"][0]
        p = expected_tokens(alpha, g) / (g * cm["t_draft_ms"] / t1 + cm["t_verify_ms"][g] / t1) if g else 1.0
        pred = {"alpha": alpha, "mean_gamma": g, "predicted_speedup": p,
                "measured_speedup": ratios.get("edgespec draft / edgespec plain")}
    report = {"command": "python bench/bench_peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "prompts": {"code": args.code_prompts, "prose": len(prompts) - args.code_prompts},
              "max_new_tokens": args.max_new_tokens, "decoding": "greedy (except the sampled row)",
              "rerun_only": sorted(only) if args.only else None,
              "note": (f"rows other than {sorted(only)} come from the previous full run (.cache/peers/raw.json), "
                       "same prompts and settings" if args.only else None),
              "systems": table, "ratios": ratios, "roofline": roofline, "edgespec_predicted_vs_measured": pred}
    from bench_speculative import machine
    report["machine"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md)
    plot(report, args.out.with_suffix(".png"))
    print(md)
    return 0


def markdown(r: dict) -> str:
    rows = ["| system | tok/s median (min–max) | TTFT ms | acceptance | accepted/round | identical prompts | peak RSS MiB |",
            "|---|---|---|---|---|---|---|"]
    for name, s in r["systems"].items():
        if s["status"] != "ok":
            rows.append(f"| {name} | failed: {s['error'][:120]} | | | | | |")
            continue
        t = s["tokens_per_s"]
        acc = f"{s['acceptance_rate']:.3f}" if "acceptance_rate" in s else "–"
        apr = f"{s['mean_accepted_per_round']:.2f}" if "mean_accepted_per_round" in s else "–"
        rows.append(f"| {name} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | {s['ttft_ms_median']:.1f} | "
                    f"{acc} | {apr} | {s.get('identical_prompts', '–')} | {s['peak_rss_mib']:.0f} |")
    rows += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.2f}x |" for k, v in r["ratios"].items()]
    rf = r["roofline"]
    rows += ["", f"Roofline: read bandwidth {rf['read_bandwidth_gbs']:.1f} GB/s (numpy sum; copy "
                 f"{rf['copy_bandwidth_gbs']:.1f} GB/s) ÷ {rf['bytes_per_token'] / 1e6:.1f} MB "
                 f"per token = {rf['roofline_tokens_per_s']:.0f} tok/s; plain decoders' share: "
                 + ", ".join(f"{k} {100 * v:.0f}%" for k, v in rf["plain_share_of_roofline"].items())]
    if r.get("edgespec_predicted_vs_measured"):
        p = r["edgespec_predicted_vs_measured"]
        rows.append(f"edgespec draft: α = {p['alpha']:.3f}, mean γ {p['mean_gamma']}, predicted speedup "
                    f"{p['predicted_speedup']:.2f}x, measured {p['measured_speedup'] or float('nan'):.2f}x")
    rows.append(f"\nCommand: `{r['command']}`" + (f" ({r['note']})" if r.get("note") else ""))
    return "\n".join(rows) + "\n"


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = {n: s for n, s in r["systems"].items() if s["status"] == "ok"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = list(ok)
    med = [ok[n]["tokens_per_s"]["median"] for n in names]
    err = [[m - ok[n]["tokens_per_s"]["min"] for n, m in zip(names, med)],
           [ok[n]["tokens_per_s"]["max"] - m for n, m in zip(names, med)]]
    colors = ["tab:green" if n.startswith("edgespec") else "tab:blue" if "GenAI" in n else "tab:orange" for n in names]
    ax.barh(names, med, xerr=err, color=colors)
    ax.axvline(r["roofline"]["roofline_tokens_per_s"], color="grey", ls="--", lw=1, label="plain-decode roofline")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median over repeats; bars: min–max)")
    ax.set_title("Bundled pair, 2-core CPU: edgespec vs ONNX Runtime GenAI vs HF")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight-only quantization of the bundled demo target: per dtype, the top-1 agreement with fp32 on held-out
code, the weight bytes read per decoded token, plain (no draft) decoding tokens/s, and the share of the memory
roofline those reach.

    python bench/bench_quant.py --out bench/results/quant.json                         # the full run
    python bench/bench_quant.py --rounds 1 --prompts 1 --max-new-tokens 24             # a smoke run

What it does, in order:
  1) exports models/demo-target at each --dtypes into a temporary folder (edgespec export, as a target with
     --allow-lossy, so a dtype below the 0.99 gate is measured, and the gate's verdict recorded)
  2) measures this machine's memory bandwidth: a numpy copy of a large array (COPY_MB), best of COPY_REPS;
     bytes read + bytes written over the time. numpy copies on one thread, so the decoders run on --threads 1
     by default: the roofline and the decoder see the same one core
  3) decodes the same held-out code prompts with every engine, interleaved (dtype order rotated each round,
     so drift on a shared machine spreads over all of them); median decode tokens/s per dtype
  4) per dtype: bytes per token x tokens/s = the weight bandwidth reached, over the measured bandwidth = the
     roofline share (weights only: the KV cache adds 2 x layers x kv heads x head dim x 4 bytes per context
     token, reported beside it)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from host import machine  # noqa: E402
from edgespec.contract import PRECISIONS  # noqa: E402
from edgespec.export.onnx_export import export_engine  # noqa: E402
from prompts import code_prompts  # noqa: E402

DTYPES = ("fp32", "int8", "int4")
COPY_MB = 512  # larger than any last-level cache, so the copy streams from memory
COPY_REPS = 7


def copy_bandwidth(mb: int = COPY_MB, reps: int = COPY_REPS) -> dict:
    """Memory bandwidth of a numpy copy of `mb` MB (read + write bytes / s), best of `reps`."""
    src = np.ones(mb * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return {"bytes_per_s": 2 * src.nbytes / best, "array_mb": mb, "reps": reps,
            "method": "numpy copyto of a float64 array, one thread; (read + written bytes) / best time"}


def decode_rates(engines: dict, prompts: list[str], rounds: int, max_new_tokens: int, threads: int) -> dict:
    """dtype -> decode tokens/s of every (round, prompt), interleaved over the dtypes."""
    gens = {d: edgespec.load(e, threads=threads) for d, e in engines.items()}
    for g in gens.values():
        g.generate(prompts[0], max_new_tokens=8)  # warm-up
    order, rates = list(gens), {d: [] for d in gens}
    for r in range(rounds):
        for p in prompts:
            for d in order:
                st = gens[d].generate(p, max_new_tokens=max_new_tokens).stats
                rates[d].append(st.tokens_per_second)
        order = order[1:] + order[:1]  # rotate: no dtype always runs first
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--checkpoint", default="demo-target")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=PRECISIONS,
                    help="the first is the speed baseline")
    ap.add_argument("--prompts", type=int, default=6, help="held-out code prompts")
    ap.add_argument("--rounds", type=int, default=5, help="passes over the prompts (each with every dtype)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (numpy copies on one)")
    ap.add_argument("--agreement-tokens", type=int, default=1024, help="held-out tokens for the agreement")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.rounds < 1 or args.max_new_tokens < 2:
        ap.error(f"--prompts and --rounds must be >= 1 and --max-new-tokens >= 2, got {args.prompts}, "
                 f"{args.rounds}, {args.max_new_tokens}")
    ckpt = args.models / args.checkpoint
    if not (ckpt / "config.json").is_file():
        ap.error(f"{ckpt} is not a checkpoint folder (no config.json): run from the repository root or pass --models")
    report = {"command": "python bench/bench_quant.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "threads": args.threads, "checkpoint": str(ckpt), "dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for dtype in args.dtypes:  # 1) export
            print(f"exporting {ckpt} at {dtype} ...", file=sys.stderr)
            engines[dtype] = Path(tmp) / dtype
            m = export_engine(ckpt, engines[dtype], dtype=dtype, progress=False, allow_lossy=True,
                              agreement_tokens=args.agreement_tokens)
            v = m.extra["validation"]
            report["dtypes"][dtype] = {
                "flavor": m.flavor, "quantization": m.extra.get("quantization"),
                "agreement_vs_fp32": v.get("agreement_vs_fp32", {"top1_agreement": 1.0, "mean_kl": 0.0}),
                "precision_gate": v.get("precision_gate"),
                "weight_bytes_per_token": m.extra["weight_bytes_per_token"],
                "kv_bytes_per_context_token": 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4}
        bw = copy_bandwidth()  # 2)
        report["memory_bandwidth"] = bw
        prompts = code_prompts(edgespec.load(engines[args.dtypes[0]]).tok, args.prompts)
        rates = decode_rates(engines, prompts, args.rounds, args.max_new_tokens, args.threads)  # 3)
    base = statistics.median(rates[args.dtypes[0]])
    for dtype, r in rates.items():  # 4)
        d = report["dtypes"][dtype]
        tps = statistics.median(r)
        reached = d["weight_bytes_per_token"]["total"] * tps
        d.update({"decode_tokens_per_s_median": tps, "decode_tokens_per_s_all": r,
                  f"speed_vs_{args.dtypes[0]}": tps / base, "weight_bytes_per_s": reached,
                  "memory_roofline_share": reached / bw["bytes_per_s"]})
    print(f"memory bandwidth (numpy copy, one thread): {bw['bytes_per_s'] / 1e9:.1f} GB/s; decoding on "
          f"{args.threads} thread(s), {args.rounds} x {args.prompts} prompts x {args.max_new_tokens} tokens, "
          f"interleaved")
    print(f"{'dtype':>12s} {'top-1 vs fp32':>13s} {'mean KL':>9s} {'MB/token':>9s} {'tok/s':>7s} "
          f"{'x ' + args.dtypes[0]:>7s} {'GB/s':>6s} {'roofline':>8s}")
    for dtype, d in report["dtypes"].items():
        a = d["agreement_vs_fp32"]
        print(f"{dtype:>12s} {a['top1_agreement']:13.4f} {a['mean_kl']:9.2e} "
              f"{d['weight_bytes_per_token']['total'] / 1e6:9.2f} {d['decode_tokens_per_s_median']:7.1f} "
              f"{d[f'speed_vs_{args.dtypes[0]}']:7.2f} {d['weight_bytes_per_s'] / 1e9:6.2f} "
              f"{100 * d['memory_roofline_share']:7.1f}%")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

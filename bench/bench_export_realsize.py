"""Real-size exports: the stand-ins of docs/standins.md (0.5B, 1B, 3B shapes) exported at each precision, each
export in its own process, with its time, peak RSS (the child's own, and the export's per-stage record), the
memory estimate it was checked against, the gates, the engine's size and a decode on cpu and cpu-native.

    python bench/bench_export_realsize.py --out bench/results/export-realsize.json \\
        [--presets qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b] [--dtypes fp32,fp16,int8,int4]

Stand-ins are made on demand into .cache/standins/ (python -m edgespec.export.standin --preset P) and the
engines kept in .cache/engines-realsize/P-DTYPE for the decode benchmarks. Resumable: an entry already in --out
(same preset, dtype and source recipe) is kept, so a killed run continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b")
DTYPES = ("fp32", "fp16", "int8", "int4")

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np
import edgespec
from edgespec.export.onnx_export import export_engine
ckpt, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
t0 = time.time()
m = export_engine(ckpt, out, dtype=dtype, force=True, progress=False, allow_lossy=True, max_context=2048)
export_s = time.time() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
v = m.extra["validation"]
prompt = list(np.random.default_rng(0).integers(1, m.vocab_size, 24))
decode = {}
for provider in ("cpu", "cpu-native"):
    if provider == "cpu-native" and not (m.extra.get("native") or {}).get("file"):
        decode[provider] = {"unavailable": (m.extra.get("native") or {}).get("unavailable", "no native weights")}
        continue
    gen = edgespec.load(out, provider=provider)
    gen.generate(prompt, max_new_tokens=4)
    t = time.perf_counter()
    ids = gen.generate(prompt, max_new_tokens=32).token_ids
    decode[provider] = {"token_ids": [int(i) for i in ids], "tokens_per_s": len(ids) / (time.perf_counter() - t)}
files = {f.name: f.stat().st_size for f in out.iterdir() if f.is_file()}
print(json.dumps({"export_s": round(export_s, 1), "child_peak_rss_bytes": peak,
                  "export_memory": m.extra["export_memory"], "parameters": m.extra["parameters"],
                  "flavor": m.flavor, "fusion": m.fusion, "files": files, "engine_bytes": sum(files.values()),
                  "weight_bytes_per_token": m.extra["weight_bytes_per_token"]["total"],
                  "parity": {k: v["parity"][k] for k in ("max_abs_diff", "tolerance", "top1")},
                  "verify": {k: v["verify"][k] for k in ("max_abs_diff", "tolerance")},
                  "agreement_vs_fp32": v.get("agreement_vs_fp32"), "precision_gate": v.get("precision_gate"),
                  "native": {k: (m.extra.get("native") or {}).get(k) for k in ("file", "unavailable", "gate")},
                  "decode": decode}))
"""


def standin(preset: str) -> Path:
    folder = REPO / ".cache" / "standins" / preset
    if not (folder / "target" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "edgespec.export.standin", "--preset", preset, "--role", "target",
                        "--no-progress"], check=True, cwd=REPO)
    return folder / "target"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "export-realsize.json")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    args = ap.parse_args(argv)
    report = json.loads(args.out.read_text()) if args.out.is_file() else {}
    report["command"] = "python bench/bench_export_realsize.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report.setdefault("runs", {})
    with open("/proc/meminfo") as f:
        report["machine"] = {"cpus": len(__import__("os").sched_getaffinity(0)),
                             "mem_total_bytes": int(f.readline().split()[1]) * 1024}
    for preset in args.presets.split(","):
        ckpt = standin(preset)
        recipe = json.loads((ckpt / "standin.json").read_text()) if (ckpt / "standin.json").is_file() else {}
        for dtype in args.dtypes.split(","):
            key = f"{preset}/{dtype}"
            if key in report["runs"] and report["runs"][key].get("recipe") == recipe and "error" not in report["runs"][key]:
                print(f"{key}: kept from an earlier run")
                continue
            out = REPO / ".cache" / "engines-realsize" / f"{preset}-{dtype}"
            print(f"{key}: exporting {ckpt} -> {out}", flush=True)
            t0 = time.time()
            r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(out), dtype], capture_output=True, text=True,
                               cwd=REPO)
            entry = {"recipe": recipe, "wall_s": round(time.time() - t0, 1)}
            if r.returncode == 0:
                entry.update(json.loads(r.stdout.strip().splitlines()[-1]))
            else:
                entry["error"] = (r.stderr.strip().splitlines() or ["?"])[-1]
                entry["child_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            report["runs"][key] = entry
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            peak = entry.get("child_peak_rss_bytes", 0) / 2**30
            print(f"{key}: {entry.get('error') or 'ok'}; {entry['wall_s']} s, peak RSS {peak:.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

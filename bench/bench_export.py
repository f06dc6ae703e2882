"""Export benchmark for the bundled pair: export time, engine sizes, fp16/int8 agreement with fp32,
the target's single-token vs 5-token verify cost, and the pair's greedy acceptance on held-out code.

    python bench/bench_export.py --out bench/results/export.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from host import machine  # noqa: E402
from edgespec.backends.ort import OrtDecoder  # noqa: E402
from edgespec.export.onnx_export import export_engine  # noqa: E402
from prompts import code_prompts  # noqa: E402


def dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def verify_cost(engine_dir: Path, context: int = 128, reps: int = 30) -> dict:
    gen = edgespec.load(engine_dir)
    d = OrtDecoder(gen.target, 1)
    rng = np.random.default_rng(0)
    d(rng.integers(0, gen.target.manifest.vocab_size, (1, context)))
    d.cache.commit(context)
    out = {}
    for s in (1, 5):
        ids = rng.integers(0, gen.target.manifest.vocab_size, (1, s))
        for _ in range(3):
            d(ids)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            d(ids)
            ts.append(time.perf_counter() - t)
        out[s] = float(np.median(ts))
    return {"single_token_ms": out[1] * 1e3, "verify_5_ms": out[5] * 1e3, "verify5_over_single": out[5] / out[1],
            "context": context}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/export.json"))
    ap.add_argument("--models", type=Path, default=Path("models"))
    args = ap.parse_args(argv)
    report = {"command": "python bench/bench_export.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "engines": {}}
    train = args.models / "demo-train.json"
    if train.is_file():
        t = json.loads(train.read_text())
        report["training"] = {"params": t["params"], "target_val_loss": t["target"]["val_loss"],
                              "draft_val_loss": t["draft"]["val_loss"],
                              "draft_top1_agreement_with_target": t["draft"].get("top1_agreement_with_target"),
                              "train_wall_s": t["wall_s"], "command": t["command"]}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("demo-target", "demo-draft"):
            for dtype in ("fp32", "fp16", "int8"):
                out = Path(tmp) / f"{name}-{dtype}"
                t0 = time.time()
                # allow_lossy: this bench measures agreement; the gate would refuse the variants it reports on
                m = export_engine(args.models / name, out, dtype=dtype, max_context=2048, force=True, progress=False,
                                  role=name.split("-")[-1], allow_lossy=True)
                entry = {"export_s": round(time.time() - t0, 2), "engine_bytes": dir_size(out),
                         "model_bytes": (out / m.model_file).stat().st_size,
                         "parity_max_abs_diff": m.extra["validation"]["parity"]["max_abs_diff"],
                         "verify_max_abs_diff": m.extra["validation"]["verify"]["max_abs_diff"]}
                if "agreement_vs_fp32" in m.extra["validation"]:
                    entry["agreement_vs_fp32"] = m.extra["validation"]["agreement_vs_fp32"]
                if name == "demo-target":
                    entry["verify_cost"] = verify_cost(out)
                report["engines"][f"{name}/{dtype}"] = entry
                print(f"{name}/{dtype}: {json.dumps(entry)}", flush=True)
        gen = edgespec.load(Path(tmp) / "demo-target-fp32", draft=Path(tmp) / "demo-draft-fp32", gamma=4)
        report["greedy_acceptance_held_out_code"] = acceptance(gen)
        gen = edgespec.load(Path(tmp) / "demo-target-fp32", draft=Path(tmp) / "demo-draft-int8", gamma=4)
        report["greedy_acceptance_held_out_code_int8_draft"] = acceptance(gen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith("greedy")}))
    return 0


def acceptance(gen) -> dict:
    """Share of draft tokens the target keeps (greedy, γ = 4) on 20 held-out code prompts."""
    acc = drafted = rej = 0
    for p in code_prompts(gen.tok, 20):
        st = gen.generate(p, max_new_tokens=128).stats
        acc, drafted, rej = acc + st.accepted, drafted + st.drafted, rej + st.rejections
    return {"gamma": 4, "prompts": 20, "max_new_tokens": 128, "acceptance_rate": acc / drafted,
            "alpha_per_token": acc / (acc + rej)}


if __name__ == "__main__":
    raise SystemExit(main())

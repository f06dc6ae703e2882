"""Where a plain decode step's time goes inside ONNX Runtime: per-op-type kernel time of the demo target.

    python bench/bench_ops.py --out bench/results/ops.json

Uses ORT's own node profiler (which adds a little time per node, so small ops look somewhat heavier
than they are) over 200 single-token steps at context 100, and counts the nodes of the optimised graph.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgespec.backends import ort as E
from edgespec.backends.ort import OrtDecoder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-target"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/ops.json"))
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    base = E.session_options

    def profiled(threads=None):
        so = base(threads)
        so.enable_profiling = True
        so.profile_file_prefix = f"{tmp}/ort"
        so.optimized_model_filepath = f"{tmp}/optimized.onnx"
        return so
    E.session_options = profiled
    eng = E.OrtEngine(args.engine)
    E.session_options = base
    d = OrtDecoder(eng, 1)
    d(np.arange(100)[None] % eng.manifest.vocab_size)
    d.cache.commit(100)
    one = np.ones((1, 1), np.int64)
    for _ in range(args.steps):
        d(one)
    events = json.load(open(eng.session.end_profiling()))
    per_op, nodes = collections.defaultdict(float), collections.Counter()
    runs = [e["dur"] for e in events if e.get("name") == "model_run"]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    import onnx
    g = onnx.load(f"{tmp}/optimized.onnx", load_external_data=False).graph
    nodes.update(n.op_type for n in g.node)
    total = sum(per_op.values())
    report = {"command": "python bench/bench_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "engine": str(args.engine), "steps_profiled": len(runs), "context": 100,
              "model_run_us_median": float(np.median(runs)), "optimized_graph_nodes": int(sum(nodes.values())),
              "share_of_kernel_time": {k: v / total for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])},
              "nodes_by_op": dict(nodes.most_common())}
    mm = sum(v for k, v in report["share_of_kernel_time"].items() if "MatMul" in k)
    report["matmul_share"], report["non_matmul_share"] = mm, 1 - mm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['optimized_graph_nodes']} nodes; MatMul {100 * mm:.1f}% of kernel time, "
          f"everything else {100 * (1 - mm):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

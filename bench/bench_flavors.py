"""Plain greedy decoding of the two engine flavours (portable: standard ONNX ops; ort: GroupQueryAttention and
skip + simplified layer norm), interleaved in one run so a shared, noisy CPU slows both alike: tokens/s per
flavour, their ratio, and the nodes of each optimised graph (every node runs once per step).

    python bench/bench_flavors.py --checkpoint models/demo-target --rounds 7 --steps 64

Exports the checkpoint in both flavours into a temporary folder (or takes --ort DIR --portable DIR), prefills
a 100-token context, then alternates rounds of `--steps` single-token steps between the flavours (each from
the same committed context, rewound after the round). Prints JSON; --out FILE writes it.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgespec.backends import ort as E
from edgespec.contract import Manifest

CONTEXT = 100  # committed rows before the timed steps


def optimized_nodes(engine_dir: Path, tmp: str) -> dict:
    """op type -> count in ONNX Runtime's optimised graph of the folder's model (CPU, ORT_ENABLE_ALL)."""
    import onnx
    import onnxruntime as ort

    so = E.session_options()
    path = f"{tmp}/{engine_dir.name}.optimized.onnx"
    so.optimized_model_filepath = path
    ort.InferenceSession(str(engine_dir / Manifest.read(engine_dir).model_file), so,
                         providers=["CPUExecutionProvider"])
    return dict(collections.Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node))


def timed_round(dec, steps: int) -> float:
    """tokens/s of `steps` greedy single-token steps from the committed context (rewound afterwards)."""
    start = int(dec.cache.lengths[0])
    tok = np.array([[1]], np.int64)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = dec.ids(tok)[:, -1:]
        tok = np.where(tok < 0, 0, tok)
        dec.cache.commit(1)
    dt = time.perf_counter() - t0
    dec.cache.rewind_to(start)
    return steps / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path("models/demo-target"))
    ap.add_argument("--ort", type=Path, help="an ort-flavour engine folder (default: export --checkpoint)")
    ap.add_argument("--portable", type=Path, help="a portable engine folder (default: export --checkpoint)")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    dirs = {"portable": args.portable, "ort": args.ort}
    for flavor, d in dirs.items():
        if d is None:
            from edgespec.export.onnx_export import export_engine
            dirs[flavor] = Path(tmp) / flavor
            export_engine(args.checkpoint, dirs[flavor], max_context=args.max_context, flavor=flavor, progress=False)
    decs, report = {}, {"command": "python bench/bench_flavors.py " + " ".join(argv if argv is not None
                                                                             else sys.argv[1:]), "flavors": {}}
    for flavor, d in dirs.items():
        eng = E.OrtEngine(d, threads=args.threads)
        dec = decs[flavor] = eng.decoder(1)
        dec.ids(np.arange(CONTEXT)[None] % eng.manifest.vocab_size)
        dec.cache.commit(CONTEXT)
        timed_round(dec, 8)  # warm-up
        nodes = optimized_nodes(d, tmp)
        given = getattr(args, flavor)  # an engine folder the user named, or a temporary export of --checkpoint
        report["flavors"][flavor] = {"engine": str(given) if given else f"exported from {args.checkpoint}", "fusion": eng.manifest.fusion, "manifest_flavor":
                                     eng.manifest.flavor, "nodes_per_step": sum(nodes.values()), "node_types": nodes,
                                     "tokens_per_s": []}
    for _ in range(args.rounds):  # interleaved: both flavours see the same load
        for flavor, dec in decs.items():
            report["flavors"][flavor]["tokens_per_s"].append(round(timed_round(dec, args.steps), 1))
    for r in report["flavors"].values():
        r["tokens_per_s_median"] = float(np.median(r["tokens_per_s"]))
    f = report["flavors"]
    report["ort_over_portable"] = round(f["ort"]["tokens_per_s_median"] / f["portable"]["tokens_per_s_median"], 3)
    report["context"], report["steps_per_round"] = CONTEXT, args.steps
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

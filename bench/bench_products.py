"""The native step's matrix products alone, from DRAM: time and bandwidth by rows, weight kind and prefetch distance.

    python bench/bench_products.py --out bench/results/products.json [--rows 1,5,9] [--kinds float16,int8,int4]
        [--prefetch 0,2048] [--panels-row1 0] [--prefetch-rows 1] [--pf-next-pass 1] [--shape 8192x2048] [--gb 1.3]
        [--threads 2] [--repeats 3] [--marches native,x86-64] [--stream-split 0,1]

A decode step streams every weight once, so its matrix products run at the speed memory delivers the weights; a
verify pass of S rows does S times the arithmetic over the same bytes. This times `es_matmul` (native_step.c) over a
set of --shape matrices (out x in, default 8192 x 2048) of --gb GB in all (larger than the last-level cache, so
every pass reads DRAM), one call per matrix, for each weight kind and row count. Each --prefetch distance builds its
own variant of the library (`-DES_PREFETCH=bytes`, the bytes ahead each weight stream asks for; 0 asks for the line
being read, which leaves the hardware prefetcher alone), and so does each --panels-row1 value (`-DES_QPANELS_ROW1=n`:
the panels a one-row integer product computes per pass, each its own weight stream; 0 leaves the library's own
choice per kind and CPU, es_set_q4_row_panels; float16 products ignore it, and so do the AVX2 build's int8
products, which stream one panel), each --stream-split value (`-DES_STREAM_SPLIT`: 1, the default, gives each thread's
share kw weight streams that run through it chunk after chunk, a pass reading one panel of each; 0 makes chunks and
passes of consecutive panels), and each --marches target (`EDGESPEC_NATIVE_MARCH`: x86-64 is the
portable C kernels, haswell AVX2 without AVX-512); the variants, kinds and row counts are interleaved within
each repeat and the fastest repeat is kept. Writes JSON (ms per pass, GMAC/s, GB/s of weights) and a markdown table
beside --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lib"))  # the benches' shared helpers (bench/lib)

SHAPE = "8192x2048"  # out x in: a Llama-3.2-1B MLP matrix (gate, up)


def variant(distance: int, panels_row1: int = 0, march: str = "native", next_pass: int = 1, split: int = 1):
    """native_step.c built with ES_PREFETCH = distance, (panels_row1 > 0) ES_QPANELS_ROW1 = panels_row1,
    ES_PF_NEXT_PASS = next_pass, ES_STREAM_SPLIT = split and -march=`march`, each combination its own cached
    library."""
    from edgespec.backends import native_lib

    saved = {k: os.environ.get(k) for k in ("EDGESPEC_NATIVE_CFLAGS", "EDGESPEC_NATIVE_MARCH")}
    row1 = f" -DES_QPANELS_ROW1={panels_row1}" if panels_row1 else ""
    flags = (f"{saved['EDGESPEC_NATIVE_CFLAGS'] or ''} -DES_PREFETCH={distance}{row1} -DES_PF_NEXT_PASS={next_pass}"
             f" -DES_STREAM_SPLIT={split}")
    os.environ["EDGESPEC_NATIVE_CFLAGS"] = flags.strip()
    os.environ["EDGESPEC_NATIVE_MARCH"] = march
    try:
        return native_lib.library()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def matrices(kind: str, N: int, K: int, gb: float, rng) -> list[np.ndarray]:
    """Copies of one packed N x K matrix of `kind`, gb GB in all (distinct buffers, so no pass hits the cache)."""
    from edgespec.backends.native_format import pack, pack_blocks, quantize_blocks

    w = rng.normal(0, 0.1, (N, K)).astype(np.float32)
    packed = pack(w.astype(np.float16)) if kind == "float16" else pack_blocks(*quantize_blocks(w, kind), kind)
    return [packed.copy() for _ in range(max(1, int(gb * 1e9 // packed.nbytes)))]


def one_pass(lib, kind: str, mats: list[np.ndarray], N: int, x: np.ndarray, threads: int) -> float:
    """Seconds for x (rows, K) @ every N x K matrix, one es_matmul call each."""
    from edgespec.backends.native_format import WEIGHT_KINDS

    y = np.zeros((x.shape[0], N), np.float32)
    t0 = time.perf_counter()
    for w in mats:
        rc = lib.es_matmul(WEIGHT_KINDS[kind], x.ctypes.data, x.shape[0], w.ctypes.data, x.shape[1], N, y.ctypes.data, threads)
        if rc != 0:
            raise RuntimeError(f"es_matmul returned {rc} ({kind}, {x.shape[0]} rows)")
    return time.perf_counter() - t0


def markdown(report: dict) -> str:
    lines = [f"# Matrix products from DRAM ({report['threads']} threads)", "", f"`{report['command']}`", "",
             f"Machine load before: {report['load'].get('others_cpu_percent', '?')}% of a core used by other processes. Fastest of {report['repeats']} repeats; each pass reads "
             f"about {report['gb']} GB of {report['shape'][0]} x {report['shape'][1]} matrices. CPU: {report['machine']['cpu']}; prefetching from "
             f"{report['prefetch_rows']} rows (this CPU's default: {report['prefetch_rows_cpu_default']}).", "",
             "| kind | -march | prefetch bytes | past a panel's end | panels per pass, 1 row | a pass's panels | rows "
             "| ms per pass | GMAC/s | GB/s of weights |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        row1 = (r.get("panels_row1") or "default") if r["kind"] != "float16" else "–"
        ahead = "next pass" if r.get("pf_next_pass", 1) else "straight on"
        split = "split" if r.get("stream_split", 0) else "consecutive"
        lines.append(f"| {r['kind']} | {r.get('march', 'native')} | {r['prefetch']} | {ahead} | {row1} | {split} "
                     f"| {r['rows']} "
                     f"| {r['ms']:.1f} | {r['gmacs']:.1f} | "
                     f"{r['gbs']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,5,9", help="rows of x per call, comma-separated (1..12)")
    ap.add_argument("--kinds", default="float16,int8,int4", help="weight kinds, comma-separated")
    ap.add_argument("--prefetch", default="0,2048", help="ES_PREFETCH distances in bytes, comma-separated")
    ap.add_argument("--panels-row1", default="0",
                    help="panels per pass of one-row integer products (ES_QPANELS_ROW1: 1, 2 or 4; 0: the library's "
                         "choice per kind), comma-separated")
    ap.add_argument("--gb", type=float, default=1.3, help="GB of matrices per kind (more than the last-level cache)")
    ap.add_argument("--prefetch-rows", type=int, default=1,
                    help="the fewest rows a product prefetches for (es_set_prefetch_rows; default 1: every row count, "
                         "so each distance's effect shows at every row count)")
    ap.add_argument("--shape", default=SHAPE, help="one matrix's out x in (each a multiple of 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--marches", default="native", help="-march targets, comma-separated (x86-64: the portable C "
                                                         "kernels; haswell: AVX2)")
    ap.add_argument("--pf-next-pass", default="1",
                    help="where a stream's prefetch goes past its panel's end (ES_PF_NEXT_PASS): 1 the same stream's "
                         "panel of the next pass, 0 straight on into the next panel; comma-separated")
    ap.add_argument("--stream-split", default="1",
                    help="how a thread's share is read (ES_STREAM_SPLIT): 1 as a pass's kw streams, each through "
                         "a kw-th of the share (panels up to 16 KB); 0 in chunks and passes of consecutive panels; "
                         "comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from host import command_line, machine, machine_load, write_results

    from edgespec.backends.native_format import WEIGHT_KINDS

    rows = [int(x) for x in a.rows.split(",")]
    kinds = a.kinds.split(",")
    dists = [int(x) for x in a.prefetch.split(",")]
    row1s = [int(x) for x in a.panels_row1.split(",")]
    nexts = [int(x) for x in a.pf_next_pass.split(",")]
    if any(v not in (0, 1) for v in nexts):
        ap.error(f"--pf-next-pass: each 0 or 1, got {nexts}")
    splits = [int(x) for x in a.stream_split.split(",")]
    if any(v not in (0, 1) for v in splits):
        ap.error(f"--stream-split: each 0 or 1, got {splits}")
    if any(f not in (0, 1, 2, 4) for f in row1s):
        ap.error(f"--panels-row1: each 0 (the library's choice), 1, 2 or 4 (the kernel's one-row variants), got {row1s}")
    if any(not 1 <= r <= 12 for r in rows):
        ap.error(f"--rows: each between 1 and 12 (native_step.c's MAX_ROWS per pass), got {rows}")
    if any(k not in WEIGHT_KINDS for k in kinds):
        ap.error(f"--kinds: each one of {sorted(WEIGHT_KINDS)}, got {kinds}")
    if any(d < 0 for d in dists):
        ap.error(f"--prefetch: distances >= 0 bytes, got {dists}")
    try:
        N, K = (int(v) for v in a.shape.lower().split("x"))
    except ValueError:
        ap.error(f"--shape: expected OUTxIN, for example 8192x2048, got {a.shape!r}")
    if N < 32 or K < 32 or N % 32 or K % 32:
        ap.error(f"--shape: out and in each a multiple of 32 (the panels and the integer blocks), got {a.shape!r}")
    if a.prefetch_rows < 1:
        ap.error(f"--prefetch-rows: expected >= 1, got {a.prefetch_rows}")
    load = machine_load()
    rng = np.random.default_rng(0)
    keys = [(d, f, m, n, v) for d in dists for f in row1s for m in a.marches.split(",") for n in nexts
            for v in splits]
    libs = {k: variant(*k) for k in keys}
    cpu_default = libs[keys[0]].es_set_prefetch_rows(0)  # what the runtime would use on this CPU
    for lib in libs.values():
        lib.es_set_prefetch_rows(a.prefetch_rows)
    best: dict[tuple, float] = {}
    for kind in kinds:  # one kind's matrices in memory at a time
        mats = matrices(kind, N, K, a.gb, rng)
        xs = {r: rng.normal(0, 1, (r, K)).astype(np.float32) for r in rows}
        one_pass(libs[keys[0]], kind, mats, N, xs[rows[0]], a.threads)  # page the copies in
        for rep in range(a.repeats):
            for k in keys:
                for r in rows:
                    t = one_pass(libs[k], kind, mats, N, xs[r], a.threads)
                    best[(kind, k, r)] = min(best.get((kind, k, r), t), t)
            print(f"[products] {kind}: repeat {rep + 1}/{a.repeats}", file=sys.stderr, flush=True)
        nbytes = sum(m.nbytes for m in mats)
        for k in keys:
            for r in rows:
                t = best[(kind, k, r)]
                best[(kind, k, r)] = {"kind": kind, "march": k[2], "prefetch": k[0], "panels_row1": k[1],
                                      "pf_next_pass": k[3], "stream_split": k[4], "rows": r,
                                      "ms": t * 1e3,
                                      "matrices": len(mats), "gmacs": len(mats) * r * N * K / t / 1e9,
                                      "gbs": nbytes / t / 1e9}
        del mats
    report = {"command": command_line(__file__),
              "threads": a.threads, "repeats": a.repeats, "gb": a.gb, "load": load, "shape": [N, K],
              "prefetch_rows": a.prefetch_rows, "prefetch_rows_cpu_default": cpu_default, "machine": machine(),
              "results": [best[(kind, k, r)] for kind in kinds for k in keys for r in rows]}
    write_results(a.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

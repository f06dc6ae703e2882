"""Where a native step's time goes, by job kind, against the DRAM roofline.

    python bench/bench_native_profile.py --engine .cache/engines-realsize/qwen2.5-0.5b-int4 \\
        --out bench/results/native-profile-int4.json [--rows 1,2,5,8] [--threads 2] [--calls 48] [--hugepages 1] \
        [--int4-row-panels 0] [--cflags= --cflags=-DES_PF_NEXT_PASS=0]

For each call size S (--rows: S = 1 is a decode step, S = k + 1 a verify pass of k drafted tokens) this runs
--calls calls of S tokens on provider cpu-native from a 64-token prompt, the sizes interleaved, --repeats
times, and reports per call: the wall time, the time in each job kind of native_step.c (edgespec.backends.native_lib.profile:
norms, matrix products, the input quantization of integer products, the cache rows, attention, activation,
argmax; and of those, the caller's wait for helper threads), and the host's share (Python, ctypes, the cache's
bookkeeping). The weight bytes a call reads (engine.json's native weight_bytes_per_token) over the matrix
products' time and over the whole call give the bandwidth each reaches, beside the machine's read bandwidth
measured in the same run (bench/lib/membw.c, as bench_realsize.py measures it). --hugepages 0,1 opens the engine
once per setting (EDGESPEC_HUGEPAGES: its weights on 4 KiB pages, or in one arena advised for huge pages,
edgespec/backends/hugepages.py) and interleaves them within each repeat, with the huge-page bytes each got.
--int4-row-panels 1,4 does the same for the panels a one-row int4 product streams per pass (es_set_q4_row_panels;
0: this CPU's default), one setting of the library at a time, on the same engine. Each --cflags (repeatable) opens
the engine once more on the library built with those EDGESPEC_NATIVE_CFLAGS (native_step.c's switches, such as
-DES_PF_NEXT_PASS=0, -DES_ATTN_PF=0 or -DES_ATTN_GROUP=1: a change and the code before it, interleaved in one
process); without it the process's own flags. Writes JSON and a markdown table per setting beside --out, with the
command and the machine's load.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lib"))  # the benches' shared helpers (bench/lib)


def profile_calls(engine, rows: int, calls: int, prompt: int, seed: int) -> dict:
    """`calls` calls of `rows` tokens after a `prompt`-token prefill, on a fresh decoder: ms per call (wall)
    and the native profile's per-kind ms per call."""
    from edgespec.backends import native_lib as native

    rng = np.random.default_rng(seed)
    vocab = engine.manifest.vocab_size
    dec = engine.decoder()
    dec(rng.integers(0, vocab, (1, prompt)))
    dec.cache.commit(prompt)
    feeds = [rng.integers(0, vocab, (1, rows)) for _ in range(calls)]
    native.profile(reset=True, lib=engine.lib)
    t0 = time.perf_counter()
    for ids in feeds:
        dec(ids)
        dec.cache.commit(rows)
    wall = (time.perf_counter() - t0) * 1e3 / calls
    prof = native.profile(reset=True, lib=engine.lib)
    return {"ms": wall, "kinds": {k: {"ms": v["ms"] / calls, "wait_ms": v["wait_ms"] / calls,
                                      "jobs": v["jobs"] / calls} for k, v in prof.items()}}


def summarize(runs: list[dict], bytes_per_call: int, gbs: float | None) -> dict:
    """Medians over the repeats of one call size, with the bandwidth the products and the whole call reach."""
    med = lambda xs: float(np.median(xs))  # noqa: E731
    kinds = {k: {f: med([r["kinds"][k][f] for r in runs]) for f in ("ms", "wait_ms", "jobs")}
             for k in runs[0]["kinds"]}
    wall = med([r["ms"] for r in runs])
    native_ms = sum(v["ms"] for v in kinds.values())
    products = kinds["matmul"]["ms"]
    out = {"ms_per_call": wall, "kinds": kinds, "native_ms": native_ms, "host_ms": wall - native_ms,
           "products_gbs": bytes_per_call / products / 1e6 if products else None,
           "call_gbs": bytes_per_call / wall / 1e6}
    if gbs:
        out["products_share_of_read_bw"] = out["products_gbs"] / gbs if products else None
        out["call_share_of_read_bw"] = out["call_gbs"] / gbs
    return out


def markdown(r: dict) -> str:
    lines = [f"# Native step profile: {r['engine']} ({r['weights']} weights, {r['threads']} threads)", "",
             f"`{r['command']}`", "",
             f"Weight bytes per call: {r['bytes_per_call'] / 1e6:.1f} MB; read bandwidth measured in the run: "
             f"{r['read_gbs'] or float('nan'):.1f} GB/s ({r['threads']} threads). Machine load before: "
             f"{r['load'].get('others_cpu_percent', '?')}% of a core used by other processes. Prefetching from {r.get('prefetch_rows', '?')} rows. Medians of {r['repeats']} repeats, ms per call."]
    for name, v in r.get("variants", {"": {"calls": r["calls"]}}).items():
        if name:
            hb = v.get("huge_page_bytes")
            rp = f", int4 one-row panels per pass: {v['int4_row_panels']}" if "int4_row_panels" in v else ""
            rp += f", EDGESPEC_NATIVE_CFLAGS {v['cflags']!r}" if v.get("cflags") is not None else ""
            lines += ["", f"## {name} (weights on huge pages: "
                      f"{'unknown' if hb is None else f'{hb / 1e6:.0f} MB'}{rp})"]
        lines += table(v["calls"])
    return "\n".join(lines) + "\n"


def table(calls: dict) -> list[str]:
    kinds = list(next(iter(calls.values()))["kinds"])
    lines = ["", "| rows per call | wall | " + " | ".join(kinds) + " | host | products GB/s (share) | call GB/s (share) |",
             "|" + "---|" * (len(kinds) + 5)]
    for rows, c in calls.items():
        cells = [f"{c['kinds'][k]['ms']:.2f}" + (f" (wait {c['kinds'][k]['wait_ms']:.2f})"
                                                   if c["kinds"][k]["wait_ms"] >= 0.01 else "") for k in kinds]
        share = lambda g, s: f"{g:.1f}" + (f" ({s:.0%})" if s is not None else "")  # noqa: E731
        lines.append(f"| {rows} | {c['ms_per_call']:.2f} | " + " | ".join(cells) + f" | {c['host_ms']:.2f} | "
                     f"{share(c['products_gbs'] or 0, c.get('products_share_of_read_bw'))} | "
                     f"{share(c['call_gbs'], c.get('call_share_of_read_bw'))} |")
    return lines


def open_with(path: Path, threads: int, hugepages: str, cflags: str | None):
    """The engine at `path` on cpu-native, its weights read with EDGESPEC_HUGEPAGES=hugepages, on the library
    built with EDGESPEC_NATIVE_CFLAGS=cflags (None: the process's own)."""
    import os

    from edgespec.backends import open_engine

    env = {"EDGESPEC_HUGEPAGES": hugepages} | ({} if cflags is None else {"EDGESPEC_NATIVE_CFLAGS": cflags})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return open_engine(path, "cpu-native", threads=threads)
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="an engine folder with native weights")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,2,5,8", help="tokens per call, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--membw-mib", type=int, default=512)
    ap.add_argument("--hugepages", default="1", help="EDGESPEC_HUGEPAGES settings, interleaved (0, 1 or 0,1)")
    ap.add_argument("--int4-row-panels", default="0",
                    help="panels per pass of one-row int4 products (0: the CPU's default; 1, 2, 4), interleaved")
    ap.add_argument("--cflags", action="append", default=None,
                    help="EDGESPEC_NATIVE_CFLAGS of a library variant, as --cflags=FLAGS (repeat for several, "
                         "interleaved; --cflags= the default build)")
    a = ap.parse_args(argv)
    from host import command_line, machine_load, read_bandwidth, write_results

    from edgespec.backends.hugepages import huge_bytes
    from edgespec.contract import Manifest

    m = Manifest.read(a.engine)
    info = (m.extra or {}).get("native") or {}
    if not info.get("file"):
        print(f"error: {a.engine} has no native weights ({info.get('unavailable', 'engine.json names none')})",
              file=sys.stderr)
        return 2
    rows = [int(x) for x in a.rows.split(",")]
    settings = list(dict.fromkeys(x.strip() for x in a.hugepages.split(",")))
    if not settings or set(settings) - {"0", "1"}:
        print(f"error: --hugepages takes 0, 1 or 0,1, got {a.hugepages!r}", file=sys.stderr)
        return 2
    panels = list(dict.fromkeys(x.strip() for x in a.int4_row_panels.split(",")))
    if not panels or set(panels) - {"0", "1", "2", "4"}:
        print(f"error: --int4-row-panels takes 0 (the CPU's default), 1, 2 or 4, comma-separated; got "
              f"{a.int4_row_panels!r}", file=sys.stderr)
        return 2
    need = a.prompt + max(rows) * a.calls
    if need > m.max_context:
        print(f"error: {a.prompt} prompt tokens + {a.calls} calls of {max(rows)} rows = {need} positions; "
              f"{a.engine} holds {m.max_context} (lower --calls)", file=sys.stderr)
        return 2
    load = machine_load()
    bw = read_bandwidth([a.threads], a.membw_mib, 5)
    gbs = bw.get(str(a.threads), {}).get("gbs_best")
    from edgespec.backends.native_lib import library
    flags = list(dict.fromkeys(a.cflags)) if a.cflags else [None]
    engines = {(s, c): open_with(a.engine, a.threads, s, c) for s in settings for c in flags}
    for engine in engines.values():
        profile_calls(engine, 1, 8, a.prompt, 99)  # warm: the library built and loaded, the weights paged in
    # (EDGESPEC_HUGEPAGES, int4 one-row panels (0: default), EDGESPEC_NATIVE_CFLAGS (None: the process's))
    combos = [(s, p, c) for s in settings for p in panels for c in flags]
    name = lambda s, p, c: (f"hugepages={s}" + (f" int4_row_panels={p}" if len(panels) > 1 else "")  # noqa: E731
                            + (f" cflags={c!r}" if len(flags) > 1 else ""))
    in_force = {}
    runs = {k: {r: [] for r in rows} for k in combos}
    for rep in range(a.repeats):
        for r in rows:
            for s, p, c in (combos if rep % 2 == 0 else combos[::-1]):  # the order alternates each repeat
                eng = engines[s, c]
                in_force[p, c] = eng.lib.es_set_q4_row_panels(int(p))
                runs[s, p, c][r].append(profile_calls(eng, r, a.calls, a.prompt, rep))
    for eng in engines.values():
        eng.lib.es_set_q4_row_panels(0)
    bytes_per_call = int(info["weight_bytes_per_token"])
    largest = {k: max(e.arrays.values(), key=lambda x: x.nbytes) for k, e in engines.items()}
    variants = {name(s, p, c): {"hugepages": s, "huge_page_bytes": huge_bytes(largest[s, c]), "cflags": c,
                                "int4_row_panels": in_force[p, c],
                                "calls": {str(r): summarize(runs[s, p, c][r], bytes_per_call, gbs) for r in rows},
                                "raw": runs[s, p, c]} for s, p, c in combos}
    report = {"command": command_line(__file__),
              "engine": str(a.engine), "weights": info.get("weights"), "threads": a.threads,
              "repeats": a.repeats, "calls_per_repeat": a.calls, "prompt": a.prompt, "load": load,
              "prefetch_rows": library().es_prefetch_rows(), "read_bandwidth": bw, "read_gbs": gbs,
              "bytes_per_call": bytes_per_call, "hugepages": settings, "int4_row_panels": panels, "cflags": flags,
              "calls": variants[name(*combos[0])]["calls"], "variants": variants}
    write_results(a.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

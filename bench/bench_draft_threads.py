"""Speculative decoding on cpu-native with the draft on 1 thread and on the target's threads.

    python bench/bench_draft_threads.py --target .cache/engines-realsize/qwen2.5-0.5b-int4 \\
        --draft .cache/engines-realsize/qwen2.5-0.5b-draft-int8 --out bench/results/draft-threads.json

A cpu-native draft shares the target's pool of threads (one step runs at a time), so unlike an ONNX Runtime
draft it has no second pool to fight the target's. This decodes --prompts held-out code prompts x --tokens
tokens greedily with γ = --gamma at each --draft-threads value, and plainly, the configurations interleaved
within each of --repeats repeats; tok/s of each repeat and the medians, with the machine's load, to JSON and
markdown beside --out. (edgespec.load's default since this run: the target's threads for a cpu-native draft.)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lib"))  # the benches' shared helpers (bench/lib)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2, help="the target's threads")
    ap.add_argument("--draft-threads", default="1,2")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from host import command_line, machine_load, write_results
    from prompts import code_prompts

    import edgespec

    load = machine_load()
    gens = {f"draft, {d} draft thread(s)": edgespec.load(a.target, draft=a.draft, provider="cpu-native",
                                                         threads=a.threads, draft_threads=int(d), gamma=a.gamma)
            for d in a.draft_threads.split(",")}
    gens["plain"] = edgespec.load(a.target, provider="cpu-native", threads=a.threads)
    prompts = code_prompts(gens["plain"].tok, n=a.prompts)
    runs: dict[str, list[float]] = {k: [] for k in gens}
    ids: dict[str, list] = {}
    for _ in range(a.repeats):
        for name, gen in gens.items():
            t, n, out_ids = time.perf_counter(), 0, []
            for p in prompts:
                out = gen.generate(p, max_new_tokens=a.tokens)
                n += len(out.token_ids)
                out_ids.append(list(map(int, out.token_ids)))
            runs[name].append(n / (time.perf_counter() - t))
            ids[name] = out_ids
    same = {k: ids[k] == ids["plain"] for k in ids}
    report = {"command": command_line(__file__),
              "target": str(a.target), "draft": str(a.draft), "threads": a.threads, "gamma": a.gamma,
              "prompts": a.prompts, "tokens": a.tokens, "load_before": load, "load_after": machine_load(),
              "tokens_per_s": runs, "median_tokens_per_s": {k: float(np.median(v)) for k, v in runs.items()},
              "identical_to_plain": same}
    lines = [f"# Draft threads on cpu-native: {a.target} + {a.draft}", "", f"`{report['command']}`", "",
             f"γ = {a.gamma}, target threads {a.threads}, {a.prompts} prompts x {a.tokens} tokens, {a.repeats} repeats "
             f"interleaved; other processes used {load['others_cpu_percent']}% of a core before the run.", "",
             "| configuration | tok/s median | each repeat | identical to plain |", "|---|---|---|---|"]
    for k, v in runs.items():
        lines.append(f"| {k} | {np.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} | {'yes' if same[k] else 'NO'} |")
    write_results(a.out, report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

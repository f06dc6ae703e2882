"""The host's part of provider cuda-native: its decoder and the decode loop with the device stubbed out, so only the
Python around each call (checks, the parameter block, the graph lookup, the ids read back, the cache's lengths, the
round's bookkeeping) is timed. What a GPU adds to it is the launch and the kernels; this is the floor of the
"outside the kernels" share of issue 30, measurable on any machine.

    python bench/bench_cuda_host.py [--calls 20000] [--out bench/results/cuda-host.json]
    PYTHONPATH=OTHER_CHECKOUT python bench/bench_cuda_host.py      # another tree's runtime, for an A/B

The stub runtime answers every launch at once with the same id (7) for every row, so a speculative round
accepts every proposal of a draft that also says 7: γ = 4 rounds of 5 tokens, each a target call of S = 5 and four
draft calls of S = 1 (both cuda-native, the same in-memory folder: the bundled draft's weights, never read).
Reports per call (S = 1, S = 5) and per round the fastest and the median of repeated blocks, in microseconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "lib"))

from host import machine, machine_load  # noqa: E402

from edgespec.memory import HostMemory  # noqa: E402


ANSWER = 7  # the id every row "predicts" (not the bundled tokenizer's EOS, 0)


class StubRuntime:
    """cuda_lib.CudaRuntime's calls, each returning at once; host memory; every id ANSWER."""
    device = {"name": "stub (no device)"}

    def __init__(self):
        self.memory = HostMemory()

    def pinned(self, n, dtype):
        a = np.full(n, ANSWER, dtype)  # the ids block keeps saying ANSWER; the parameter block is overwritten
        return a, a

    def stream(self):
        return 1

    def event(self):
        return 1

    def release(self, stream, events, graphs):
        pass

    def enqueue(self, model, io, s):
        pass

    def capture(self, model, io, s):
        return s

    def launch(self, graph, io):
        pass

    def drop(self, graph):
        pass

    def sync(self, io):
        pass

    def kernel_ms(self, io):
        return 0.0


def blocks(fn, n: int, reps: int = 7) -> dict:
    """fn() n times per block, reps blocks: microseconds per call, fastest and median block."""
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
    return {"us_min": min(per), "us_median": float(np.median(per)), "calls_per_block": n, "blocks": reps}


def runtime_tree() -> str:
    """Which edgespec ran: its tree's commit (with "+changes" when the tree differs from it), not a path."""
    import subprocess

    import edgespec
    tree = Path(edgespec.__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "not a git tree"
    return head + ("+changes" if git("status", "--porcelain", "--", "edgespec").stdout.strip() else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cuda-host.json")
    a = ap.parse_args(argv)
    from edgespec.backends.cuda_native import CudaNativeEngine
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import in_memory_engine_folder
    from edgespec.generate import Generator

    load = machine_load(1.0)
    spec, w = load_checkpoint(ROOT / "models" / "demo-draft", dtype=None)
    folder = in_memory_engine_folder(spec, w, 4096)
    rt = StubRuntime()
    eng = CudaNativeEngine(None, rt=rt, folder=folder)
    out = {"command": " ".join(["python"] + sys.argv), "runtime": runtime_tree(), "machine": machine(),
           "load_before": load, "calls": {}}
    for s in (1, 5):
        dec = eng.decoder()
        tok = np.zeros((1, s), np.int64)

        def call(dec=dec, tok=tok, s=s):
            dec.ids(tok)
            if dec.cache.lengths[0] + 2 * s >= 4000:
                dec.cache.rewind_to(0)
            else:
                dec.cache.commit(s)
        call()
        out["calls"][f"S={s}"] = blocks(call, a.calls)
        print(f"S = {s}: {out['calls'][f'S={s}']['us_median']:.1f} us per call (median block)", flush=True)
    gen = Generator(eng, "model", eng, None, gamma=4)
    gen.generate([1, 2, 3], max_new_tokens=16)
    per = []
    for _ in range(7):
        r = gen.generate([1, 2, 3], max_new_tokens=1000)
        per.append(r.stats.time_s["decode"] / r.stats.rounds * 1e6)
        rounds, new = r.stats.rounds, r.stats.new_tokens
    out["round_gamma4"] = {"us_min": min(per), "us_median": float(np.median(per)), "rounds": rounds,
                           "new_tokens": new, "what": "one speculative round: 4 draft calls of S = 1, one target "
                                                      "call of S = 5, the loop's bookkeeping"}
    print(f"round (γ = 4): {out['round_gamma4']['us_median']:.1f} us (median of 7 decodes of {rounds} rounds)")
    out["load_after"] = machine_load(1.0)
    a.out.write_text(json.dumps(out, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

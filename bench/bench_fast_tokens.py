"""FAST action tokens on the reacher's expert chunks: tokens per chunk and the round-trip error, against the
256-bin tokenizer the bundled policy uses (issue 31, item 3: the tokenizer's half; a FAST policy's decode ms and
success need a policy trained on these tokens).

    python bench/bench_fast_tokens.py [--fit-episodes 200] [--held-out-episodes 60] [--out bench/results/fast_tokens.json]

Chunks: the scripted expert's clean chunks (H = 8 steps x D = 2 fingertip targets, metres) of episodes 0.. (fit) and
500000.. (held out, as robots/demos.py's validation seeds), normalised with the bundled policy's
action_stats.json (q01/q99 to [-1, 1], clipped there, as the 256-bin tokenizer does: both are judged against
the clipped chunk). Per (scale, vocabulary size): the
FastTokenizer fitted on the fit chunks; on the held-out chunks the tokens per chunk (+1 for the end token a
decoder emits) and the largest error, normalised and in the action's units. The 256-bin row: H x D tokens, and
the error of its bin centres on the same chunks.
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

from host import machine  # noqa: E402

from edgespec.actions import ActionStats, ActionTokenizer  # noqa: E402
from edgespec.fast_tokens import FastTokenizer  # noqa: E402


def chunks(seeds) -> np.ndarray:
    from edgespec.robots.demos import expert_episodes
    return expert_episodes(seeds)["chunk"].astype(np.float64)  # (N, 8, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit-episodes", type=int, default=200)
    ap.add_argument("--held-out-episodes", type=int, default=60)
    ap.add_argument("--scales", default="10,20,50,100")
    ap.add_argument("--vocab-sizes", default="256,1024")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fast_tokens.json")
    a = ap.parse_args(argv)
    t0 = time.time()
    stats = ActionStats.load(ROOT / "models" / "vla-reacher" / "action_stats.json")
    fit_raw = chunks(range(a.fit_episodes))
    held_raw = chunks(range(500_000, 500_000 + a.held_out_episodes))
    fit, held = stats.normalize(fit_raw), stats.normalize(held_raw)
    print(f"{len(fit)} fit chunks, {len(held)} held-out chunks ({time.time() - t0:.0f}s)", flush=True)
    span = (stats.q99 - stats.q01) / 2  # normalised unit -> action units (masked dims)
    rows = []
    bins = ActionTokenizer.native(256, stats)
    clipped = stats.unnormalize(held)  # the held-out chunks as both tokenizers see them
    err = np.abs(np.stack([bins.decode(bins.encode(c)) for c in held_raw]) - clipped).max()
    rows.append({"tokenizer": "256 bins (OpenVLA's)", "tokens_per_chunk_mean": float(fit.shape[1] * fit.shape[2]),
                 "tokens_per_chunk_max": int(fit.shape[1] * fit.shape[2]), "max_abs_error_action_units": float(err)})
    for scale in (float(s) for s in a.scales.split(",")):
        for vocab in (int(v) for v in a.vocab_sizes.split(",")):
            tok, rep = FastTokenizer.fit(fit, scale=scale, vocab_size=vocab)
            lengths, errs, outside = [], [], 0
            for c in held:
                try:
                    ids = tok.encode(c)
                except ValueError:  # a coefficient outside the fitted alphabet: counted, never clipped
                    outside += 1
                    continue
                lengths.append(len(ids) + 1)  # + the end token
                errs.append(np.abs(tok.decode(ids) - c).max(axis=0))
            e = np.max(errs, axis=0)  # (D,) normalised
            rows.append({"tokenizer": f"FAST scale {scale:g}, vocab {tok.vocab_size}", "scale": scale,
                         "vocab_size": tok.vocab_size, "tokens_per_chunk_mean": float(np.mean(lengths)),
                         "tokens_per_chunk_max": int(np.max(lengths)), "max_abs_error_normalised": float(e.max()),
                         "error_bound_normalised": tok.error_bound,
                         "max_abs_error_action_units": float((e * span).max()),
                         "held_out_outside_alphabet": outside, "fit_report": rep.__dict__})
            print(f"{rows[-1]['tokenizer']}: {rows[-1]['tokens_per_chunk_mean']:.2f} tokens/chunk (max "
                  f"{rows[-1]['tokens_per_chunk_max']}), max error {rows[-1]['max_abs_error_action_units']:.4f} "
                  f"(action units), {outside} held-out chunks outside the alphabet", flush=True)
    out = {"command": " ".join(["python"] + sys.argv), "machine": machine(), "fit_chunks": len(fit),
           "held_out_chunks": len(held), "horizon": fit.shape[1], "dims": fit.shape[2],
           "action_units": "metres (fingertip x, y targets)", "rows": rows, "seconds": round(time.time() - t0, 1)}
    a.out.write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(f"256 bins: {rows[0]['tokens_per_chunk_mean']:.0f} tokens/chunk, max error "
          f"{rows[0]['max_abs_error_action_units']:.4f}; written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

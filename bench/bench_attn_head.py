"""The attention feature head (edgespec/attn_head.py) against the draft model and plain decoding at real size.

    python bench/bench_attn_head.py --target .cache/engines-realsize/llama-3.2-1b-fp16-hidden \\
        --draft .cache/engines-realsize/llama-3.2-1b-draft-int4 --head .cache/attn-head/attn_head-1b.npz \\
        --out bench/results/attn-head/realsize-1b-fp16.json

The target: a stand-in exported with --hidden (`edgespec export .cache/standins/llama-3.2-1b/target --out ...
--dtype fp16 --hidden`); the head: the demo target's (export/training/train_attn_head.py) widened to the
stand-in's hidden size (export/standin.widen_attention_head), so it proposes exactly what it proposes on the demo
target. Held-out code prompts (bench/lib/prompts.py, as bench_realsize.py takes them) x --tokens new tokens,
greedy, every mode on one provider, the modes interleaved per prompt (the order alternating), --repeats passes.
Reports per mode the median tok/s (decoding after the prefill), the mean tokens per round and whether every output
equals plain decoding's. Writes JSON and a markdown table beside --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="a target engine folder exported with --hidden")
    ap.add_argument("--draft", type=Path, required=True, help="a draft engine folder")
    ap.add_argument("--head", type=Path, required=True, help="an attention head (.npz) for the target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--provider", default="cpu-native")
    ap.add_argument("--draft-gammas", default="6", help="γ of the draft model's rows, comma-separated")
    ap.add_argument("--head-gammas", default="4,6,8", help="γ of the head's rows, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if min(a.prompts, a.tokens, a.repeats) < 1:
        ap.error(f"--prompts, --tokens and --repeats must be >= 1, got {a.prompts}, {a.tokens}, {a.repeats}")
    import edgespec
    from host import run_record
    from prompts import code_prompts

    gens = {"plain": edgespec.load(a.target, provider=a.provider).plain()}
    for g in (int(x) for x in a.draft_gammas.split(",") if x):
        gens[f"draft model, γ {g}"] = edgespec.load(a.target, draft=a.draft, gamma=g, provider=a.provider)
    for g in (int(x) for x in a.head_gammas.split(",") if x):
        gens[f"attention head, γ {g}"] = edgespec.load(a.target, draft=a.head, gamma=g, provider=a.provider)
    prompts = code_prompts(gens["plain"].tok, a.prompts)
    for gen in gens.values():  # compile and warm each
        gen.generate(prompts[0], max_new_tokens=8)
    started, load_before = time.time(), os.getloadavg()
    runs = {k: [] for k in gens}
    for r in range(a.repeats):
        for i, p in enumerate(prompts):
            for k in (list(gens) if (i + r) % 2 == 0 else list(gens)[::-1]):
                out = gens[k].generate(p, max_new_tokens=a.tokens)
                runs[k].append({"prompt": i, "tok_s": out.stats.tokens_per_second, "ids": out.token_ids,
                                "tokens_per_round": out.stats.tokens_per_round if out.stats.rounds else 1.0})
        print(f"pass {r}: " + ", ".join(f"{k} {np.median([x['tok_s'] for x in v]):.1f}" for k, v in runs.items()),
              flush=True)
    plain = {x["prompt"]: x["ids"] for x in runs["plain"]}
    rows = {k: {"median_tok_s": round(float(np.median([x["tok_s"] for x in v])), 2),
                "tok_s": [round(x["tok_s"], 2) for x in v],
                "mean_tokens_per_round": round(float(np.mean([x["tokens_per_round"] for x in v])), 2),
                "identical_to_plain": f"{sum(x['ids'] == plain[x['prompt']] for x in v)}/{len(v)}"}
            for k, v in runs.items()}
    report = {"command": " ".join(shlex.quote(x) for x in ["python", *sys.argv]), "provider": a.provider,
              "prompts": a.prompts, "tokens": a.tokens, "repeats": a.repeats, "rows": rows,
              "machine": run_record(load_before),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "seconds": round(time.time() - started, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# The attention head at real size ({a.target.name}, {a.provider})", "", f"`{report['command']}`", "",
             f"{a.prompts} held-out code prompts x {a.tokens} new tokens, greedy, modes interleaved, {a.repeats} "
             f"passes.", "", "| mode | tok/s (median) | tokens per round | identical to plain |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['median_tok_s']:.1f} | {v['mean_tokens_per_round']:.2f} | {v['identical_to_plain']} |"
              for k, v in rows.items()]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for k, v in rows.items():
        print(f"{k}: {v['median_tok_s']:.1f} tok/s, {v['mean_tokens_per_round']:.2f} tokens per round, "
              f"identical {v['identical_to_plain']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Acceptance by position of the feature-level text draft head (edgespec/text_head.py) against the bundled
2.6M draft model and n-gram prompt lookup, greedy, on the held-out code prompts of bench_speculative.py.

    python bench/bench_text_head.py --head models/demo-target/text_head.npz --out bench/results/text-head.json
    python bench/bench_text_head.py --engine engines/demo-target-hidden --head engines/demo-target-hidden/text_head.npz \
        --gammas 4,6,8,auto --repeats 2 --out bench/results/text-head-timed.json

The head needs the target's final hidden state at the position that emitted the pending token. Without
--engine it comes from the torch reference of the same checkpoint (which the engine matches within its
parity gate), recomputed over the whole context each round: acceptance, tokens per target call and
exactness are measured, the head's speed is not (only its proposal cost, alone). With --engine (a target
exported with --hidden, which also copies the checkpoint's head into it) the head reads the engine's own
hidden-state output and is timed against plain decoding and the draft model, interleaved.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from edgespec.export.bundled import ensure_demo_engines  # noqa: E402
from edgespec.generate import Generator  # noqa: E402
from edgespec.text_head import TextHead, TextHeadDraft  # noqa: E402
from prompts import code_prompts  # noqa: E402


def reference_features(ckpt: Path):
    """features(ctx) -> the target's final hidden state (E,) at position len(ctx) - 2, from the torch reference."""
    import torch

    from edgespec.export.reference import ReferenceDecoder
    ref = ReferenceDecoder.from_pretrained(ckpt)

    def features(ctx: list[int]) -> np.ndarray:
        return ref.hidden(torch.tensor([ctx[:-1]]))[0, -1].numpy()
    return features


class Tally:
    """Acceptance by position, tokens per target call and exactness over generations."""

    def __init__(self, width: int = 16):
        self.acc, self.tried = np.zeros(width), np.zeros(width)
        self.new = self.calls = self.same = self.n = 0

    def add(self, out, want: list[int]) -> None:
        st, w = out.stats, len(self.acc)
        k = min(w, len(st.accepted_by_position))
        self.acc[:k] += st.accepted_by_position[:k]
        self.tried[:k] += st.tried_by_position[:k]
        self.new, self.calls = self.new + st.new_tokens, self.calls + st.target_calls
        self.same, self.n = self.same + (out.token_ids == want), self.n + 1

    def report(self) -> dict:
        g = int(np.max(np.nonzero(self.tried)[0]) + 1) if self.tried.any() else 0
        return {"acceptance_by_position": [round(float(a / t), 4) for a, t in zip(self.acc[:g], self.tried[:g])],
                "tried_by_position": self.tried[:g].astype(int).tolist(), "tokens_per_round": self.new / self.calls,
                "identical_to_plain": f"{self.same}/{self.n}"}


def run(gen, prompts, max_new: int, plain_ids) -> dict:
    tally = Tally()
    for p, want in zip(prompts, plain_ids):
        tally.add(gen.generate(p, max_new_tokens=max_new), want)
    return tally.report()


def timed(gens: dict, prompts, max_new: int, repeats: int, plain_ids) -> dict:
    """tokens/s of each generator over the prompts, interleaved (every prompt through every generator, the
    order rotated per repeat), with acceptance by position and exactness from the first repeat."""
    names = list(gens)
    for g in gens.values():
        g.generate(prompts[0], max_new_tokens=8)  # warm every shape
    tok = {n: [0, 0.0] for n in names}
    tallies = {n: Tally() for n in names}
    for r in range(repeats):
        for i, (p, want) in enumerate(zip(prompts, plain_ids)):
            for n in names[(r + i) % len(names):] + names[:(r + i) % len(names)]:
                t = time.perf_counter()
                out = gens[n].generate(p, max_new_tokens=max_new)
                tok[n][1] += time.perf_counter() - t
                tok[n][0] += out.stats.new_tokens
                if r == 0:
                    tallies[n].add(out, want)
    return {n: {"tokens_per_s": tok[n][0] / tok[n][1], **tallies[n].report()} for n in names}


def write(args, argv, out: dict) -> None:
    out = {"command": "python bench/bench_text_head.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           **out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="text_head.npz (python -m edgespec.export.training.train_text_head)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/text-head.json"))
    ap.add_argument("--engines", type=Path, default=Path("engines"))
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--engine", type=Path, default=None,
                    help="a target engine exported with --hidden: time the head from its own hidden-state output "
                         "against plain and the draft model (interleaved) instead of the torch-reference run")
    ap.add_argument("--gammas", default="4,6,8", help="with --engine: the head's γ values (and 'auto')")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    if args.engine is not None:
        return main_timed(args, argv)
    t0 = time.time()
    target, draft = ensure_demo_engines(args.models, args.engines)
    plain = edgespec.load(target)
    prompts = code_prompts(plain.tok, args.prompts)
    plain_ids = [plain.generate(p, max_new_tokens=args.max_new_tokens).token_ids for p in prompts]
    head = TextHead.load(args.head)
    features = reference_features(args.models / "demo-target")
    gens = {
        "draft model (2.6M)": edgespec.load(target, draft=draft, gamma=args.gamma),
        "n-gram": edgespec.load(target, draft="ngram", gamma=args.gamma),
        "text head": Generator(plain.target, "custom", tokenizer=plain.tok, gamma=args.gamma,
                               drafter_factory=lambda b: TextHeadDraft(head, features)),
    }
    results = {name: run(gen, prompts, args.max_new_tokens, plain_ids) for name, gen in gens.items()}
    h = features(plain.tok.encode(prompts[0]))  # a real hidden state: chains of 4 proposals from it
    n = 500
    t = time.perf_counter()
    for _ in range(n):
        tok, _ = head.first(h, 1)
        for _ in range(3):
            tok, _ = head.next(tok)
    proposal_ms = (time.perf_counter() - t) / (4 * n) * 1e3
    write(args, argv, {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                       "head": str(args.head), "head_proposal_ms": round(proposal_ms, 4), "results": results,
                       "wall_s": round(time.time() - t0, 1)})
    for name, r in results.items():
        print(f"{name:20s} tokens/round {r['tokens_per_round']:.2f} identical {r['identical_to_plain']} "
              f"acceptance by position {r['acceptance_by_position']}")
    print(f"head proposal {proposal_ms:.4f} ms (alone)")
    return 0


def main_timed(args, argv) -> int:
    t0 = time.time()
    target, draft = ensure_demo_engines(args.models, args.engines)
    plain = edgespec.load(args.engine)
    prompts = code_prompts(plain.tok, args.prompts)
    plain_ids = [plain.generate(p, max_new_tokens=args.max_new_tokens).token_ids for p in prompts]
    gens = {"plain": plain, "draft model γ=5": edgespec.load(args.engine, draft=draft, gamma=5)}
    for g in args.gammas.split(","):
        gens[f"text head γ={g}"] = edgespec.load(args.engine, draft=args.head, gamma=g if g == "auto" else int(g))
    results = timed(gens, prompts, args.max_new_tokens, args.repeats, plain_ids)
    base = results["plain"]["tokens_per_s"]
    for r in results.values():
        r["vs_plain"] = r["tokens_per_s"] / base
    write(args, argv, {"engine": str(args.engine), "head": str(args.head), "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "results": results,
                       "wall_s": round(time.time() - t0, 1)})
    for name, r in results.items():
        print(f"{name:18s} {r['tokens_per_s']:6.1f} tok/s {r['vs_plain']:.2f}x  tokens/round "
              f"{r['tokens_per_round']:.2f} identical {r['identical_to_plain']} acceptance {r['acceptance_by_position']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

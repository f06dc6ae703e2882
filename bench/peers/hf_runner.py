"""Peer runner: Hugging Face transformers `generate()` on torch CPU, fp32, greedy.

Runs inside .venv-hf (see bench/setup_peers.sh), as a subprocess of the benchmark harness:

    .venv-hf/bin/python bench/peers/hf_runner.py --target models/demo-target \
        --draft models/demo-draft --prompts prompts.json --max-new-tokens 128 --repeats 3 \
        --mode assisted --gamma 4

Modes: plain (greedy search), assisted (`generate(assistant_model=draft)`), prompt_lookup
(`generate(prompt_lookup_num_tokens=gamma)`).

Prints exactly ONE JSON object on stdout (everything else goes to stderr):

    {"system": "transformers <v> (torch <v>)", "mode": ..., "config": {...},
     "results": [{"prompt_index", "repeat", "prompt_token_ids", "token_ids", "new_tokens",
                  "tokens_per_s", "ttft_s", "decode_s", "total_s", "speculative_stats"}, ...],
     "speculative_stats": {...summed over the timed runs...} | null, "peak_rss_bytes": ...}

--gamma:
  * assisted: transformers reads the draft length from the *assistant's* generation_config (a
    `num_assistant_tokens=` argument to generate() does not reach the candidate generator), so
    the runner sets `draft.generation_config.num_assistant_tokens = gamma`,
    `num_assistant_tokens_schedule = "constant"` and `assistant_confidence_threshold = 0` (no
    early stop of the draft: a fixed gamma). Without --gamma transformers' defaults are kept
    (20 tokens, constant schedule, confidence threshold 0.4).
  * prompt_lookup: `prompt_lookup_num_tokens = gamma` (default 10 when omitted);
    `max_matching_ngram_size` from --ngram-size (transformers' default 2 when omitted).

Acceptance: the candidate generator is wrapped to count drafted tokens (candidate length per
round) and accepted tokens (`num_matches` passed to update_candidate_strategy) per generate().

Timing (same convention as edgespec's Stats): a streamer records when each token reaches the
host. t0 just before generate() (prompt already tokenized); ttft_s = until the first new token;
decode_s = first new token to the last; tokens_per_s = new_tokens / decode_s; total_s = t0 to the
end of generate().

Exit status: 0 with results; 0 with {"error": ...} when the installed transformers does not
support the requested mode (the exact exception text); 2 with {"error": ...} otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

MODES = ("plain", "assisted", "prompt_lookup")

# The one JSON object goes to the real stdout; anything else is sent to stderr.
_JSON_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def emit(obj: dict, code: int = 0):
    _JSON_OUT.write(json.dumps(obj) + "\n")
    _JSON_OUT.flush()
    sys.exit(code)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Recorder:
    """A transformers streamer: the first put() is the prompt, later ones are new tokens."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.seen_prompt = False
        self.tokens: list[int] = []
        self.t_first = None
        self.t_last = None

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        now = time.perf_counter()
        ids = [int(x) for x in value.reshape(-1).tolist()]
        if ids and self.t_first is None:
            self.t_first = now
        self.tokens.extend(ids)
        self.t_last = now

    def end(self):
        pass


class SpecCounter:
    """Counts drafted and accepted tokens by wrapping the model's candidate generator."""

    def __init__(self, model):
        self.reset()
        orig = model._get_candidate_generator
        counter = self

        def patched(*a, **kw):
            cg = orig(*a, **kw)
            get, upd = cg.get_candidates, cg.update_candidate_strategy

            def get_candidates(input_ids, *ga, **gkw):
                cand, logits = get(input_ids, *ga, **gkw)
                counter.drafted += int(cand.shape[1] - input_ids.shape[1])
                return cand, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                n = int(num_matches)
                counter.rounds += 1
                counter.accepted += n
                counter.hist[n] = counter.hist.get(n, 0) + 1
                return upd(input_ids, scores, num_matches)

            cg.get_candidates = get_candidates
            cg.update_candidate_strategy = update_candidate_strategy
            return cg

        model._get_candidate_generator = patched

    def reset(self):
        self.drafted = self.accepted = self.rounds = 0
        self.hist: dict[int, int] = {}

    def snapshot(self) -> dict:
        return {"rounds": self.rounds, "draft_tokens_proposed": self.drafted, "draft_tokens_accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "accepted_per_round_histogram": {str(k): v for k, v in sorted(self.hist.items())}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, default=None, help="required for --mode assisted")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list of strings (or of token-id lists)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="unused (same CLI shape as genai_runner)")
    ap.add_argument("--mode", choices=MODES, default="plain")
    ap.add_argument("--gamma", type=int, default=None,
                    help="assisted: num_assistant_tokens (constant schedule); prompt_lookup: prompt_lookup_num_tokens")
    ap.add_argument("--ngram-size", type=int, default=None, help="prompt_lookup: max_matching_ngram_size")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generations (16 tokens) before timing")
    args = ap.parse_args(argv)

    base = {"mode": args.mode}
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except Exception as e:  # noqa: BLE001
        emit({**base, "system": "transformers (not importable)", "error": f"{type(e).__name__}: {e}"}, 2)
    base = {"system": f"transformers {transformers.__version__} (torch {torch.__version__})", **base}
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    try:
        if args.max_new_tokens < 1 or args.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1")
        if args.mode == "assisted" and args.draft is None:
            raise ValueError("--mode assisted needs --draft")
        prompts = json.loads(args.prompts.read_text())
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"{args.prompts}: expected a non-empty JSON list of strings (or of token-id lists)")
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        draft = (AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
                 if args.mode == "assisted" else None)
        tok = AutoTokenizer.from_pretrained(args.target) if any(isinstance(p, str) for p in prompts) else None
        encoded = [tok(p).input_ids if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "error": f"{type(e).__name__}: {e}", "stage": "setup"}, 2)

    eos = target.generation_config.eos_token_id
    gen_kw = dict(do_sample=False, num_beams=1, temperature=None, top_k=None, top_p=None,
                  pad_token_id=eos if isinstance(eos, int) else (eos[0] if eos else 0))
    config = {"dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "warmup": args.warmup,
              "generate_kwargs": {k: v for k, v in gen_kw.items() if v is not None}}
    if args.mode == "assisted":
        gen_kw["assistant_model"] = draft
        if args.gamma is not None:
            draft.generation_config.num_assistant_tokens = args.gamma
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
        gc = draft.generation_config
        config["assistant_generation_config"] = {
            "num_assistant_tokens": getattr(gc, "num_assistant_tokens", None),
            "num_assistant_tokens_schedule": getattr(gc, "num_assistant_tokens_schedule", None),
            "assistant_confidence_threshold": getattr(gc, "assistant_confidence_threshold", None)}
    elif args.mode == "prompt_lookup":
        gen_kw["prompt_lookup_num_tokens"] = args.gamma if args.gamma is not None else 10
        if args.ngram_size is not None:
            gen_kw["max_matching_ngram_size"] = args.ngram_size
        config["generate_kwargs"].update(prompt_lookup_num_tokens=gen_kw["prompt_lookup_num_tokens"],
                                         max_matching_ngram_size=args.ngram_size)

    rec = Recorder()
    counter = SpecCounter(target) if args.mode != "plain" else None

    def run_one(ids, max_new):
        rec.reset()
        if counter:
            counter.reset()
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                  streamer=rec, **gen_kw)
            t_end = time.perf_counter()
        return [int(t) for t in out[0, len(ids):].tolist()], t0, t_end

    # Probe: an exception from the first generate() of a speculative mode means "unsupported".
    try:
        for _ in range(max(1, args.warmup)):
            run_one(encoded[0], min(16, args.max_new_tokens))
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "config": config, "error": str(e) or type(e).__name__, "stage": "warmup",
              "peak_rss_bytes": peak_rss_bytes()}, 0 if args.mode != "plain" else 2)

    results, totals = [], None
    try:
        for rep in range(args.repeats):
            for i, ids in enumerate(encoded):
                out, t0, t_end = run_one(ids, args.max_new_tokens)
                decode = (rec.t_last - rec.t_first) if rec.t_first is not None else 0.0
                r = {"prompt_index": i, "repeat": rep, "prompt_token_ids": list(ids), "token_ids": out,
                     "new_tokens": len(out), "tokens_per_s": len(out) / decode if decode > 0 else None,
                     "ttft_s": (rec.t_first - t0) if rec.t_first is not None else None, "decode_s": decode,
                     "total_s": t_end - t0}
                if rec.tokens != out:  # streamed vs returned: should never differ
                    r["streamed_token_ids"] = rec.tokens
                if counter:
                    s = counter.snapshot()
                    r["speculative_stats"] = s
                    if totals is None:
                        totals = {"rounds": 0, "draft_tokens_proposed": 0, "draft_tokens_accepted": 0,
                                  "accepted_per_round_histogram": {}}
                    for k in ("rounds", "draft_tokens_proposed", "draft_tokens_accepted"):
                        totals[k] += s[k]
                    for k, v in s["accepted_per_round_histogram"].items():
                        h = totals["accepted_per_round_histogram"]
                        h[k] = h.get(k, 0) + v
                results.append(r)
                log(f"[hf {args.mode}] rep {rep} prompt {i}: {len(out)} tok, ttft {r['ttft_s']:.4f}s, "
                    f"{r['tokens_per_s'] or 0:.1f} tok/s")
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "config": config, "error": str(e) or type(e).__name__, "stage": "generate",
              "results": results, "peak_rss_bytes": peak_rss_bytes()}, 2)

    if totals is not None:
        d = totals["draft_tokens_proposed"]
        totals["acceptance_rate"] = totals["draft_tokens_accepted"] / d if d else 0.0
        totals["runs"] = len(results)
        totals["note"] = ("counted by wrapping transformers' candidate generator: proposed = candidate length per "
                          "round, accepted = num_matches per round (after transformers' own length/EOS cropping); "
                          "summed over the timed runs")
    emit({**base, "config": config, "results": results, "speculative_stats": totals,
          "peak_rss_bytes": peak_rss_bytes()}, 0)


if __name__ == "__main__":
    main()

"""Peer runner: ONNX Runtime GenAI (plain, draft-model speculative, n-gram speculative), greedy.

Runs inside .venv-genai (see bench/setup_peers.sh), as a subprocess of the benchmark harness:

    .venv-genai/bin/python bench/peers/genai_runner.py --target models/demo-target \
        --draft models/demo-draft --prompts prompts.json --max-new-tokens 128 --repeats 3 \
        --work .cache/peers/genai --mode draft --gamma 4 --threads 2 --draft-threads 1 --draft-precision int8

Prints exactly ONE JSON object on stdout (everything else goes to stderr):

    {"system": "onnxruntime-genai 0.18.0", "mode": ..., "config": {...},
     "results": [{"prompt_index", "repeat", "prompt_token_ids", "token_ids", "new_tokens",
                  "tokens_per_s", "ttft_s", "decode_s", "total_s", "speculative_stats"}, ...],
     "speculative_stats": {...summed over the timed runs...} | null, "peak_rss_bytes": ...}

Models: each Hugging Face folder is converted once with GenAI's own model builder
(`python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu [--extra_options ...]`) into
--work, keyed by the folder's path, file sizes and mtimes, the GenAI version, the precision and the builder's
extra options; a finished build is reused. The target is built at --precision, the draft at --draft-precision
(default: the same), each separately: a draft's precision never changes the output (the target verifies every
token), only its speed and acceptance. An integer precision gets edgespec's weight-only recipe
(export/quantize.py WEIGHT_ONLY), as far as the builder takes it (QUANT_OPTIONS): every MatMul (lm_head
included) as MatMulNBits in blocks of 32 along K, accuracy level 4 (int8 activations in the kernel), asymmetric
(a zero point per block); int4 keeps the lm_head at 8 bits. The int8 build keeps the embedding Gather fp32,
as edgespec does (see QUANT_OPTIONS for int4). `config.builds` records each model's exact builder command.

Speculative API of onnxruntime-genai 0.18 (verified against the installed package):
  * the draft model is a `model.draft` section of the target's genai_config.json, shaped like
    `model.decoder` (filename, inputs, outputs, head/layer sizes). The builder has no flag for
    it, so it is added here with `og.Config(target).overlay(json)`, its `filename` pointing at the
    draft build relative to the target build;
  * `GeneratorParams.set_speculative_options(max_draft_tokens=K, ngram_size=N,
    ngram_chained_lookup=bool, min_adaptive_k=int, cooldown=bool)`; K in [1, 16] (default 4);
    `ngram_size` 0 or in [2, 16]: >= 2 turns on n-gram (prompt lookup) drafting from the target
    alone and cannot be combined with a draft; `min_adaptive_k` > 0 lets GenAI adapt k between it
    and K from the acceptance (`adaptive_k_increases/decreases` in the stats);
  * `Generator.get_speculative_stats()` -> dict of counters (rounds, draft_tokens_proposed,
    draft_tokens_accepted, acceptance_rate, acceptance_length_histogram, ...).
  The generator still hands out one token per `generate_next_token()` (verified tokens are
  queued), so the token loop is the same in every mode.

Threads: every model section of genai_config.json (`model.decoder`, `model.draft`) takes its own
`session_options` (https://onnxruntime.ai/docs/genai/reference/config.html, SessionOptions:
`intra_op_num_threads`, `inter_op_num_threads`). --threads sets the target's, --draft-threads the
draft's; 0 leaves the section alone (GenAI's default). The draft section does NOT inherit the
decoder's session options (verified: a draft without them starts no intra-op worker thread, like
intra_op_num_threads = 1, and so does GenAI's default on this 2-core CPU). `config.os_threads` records
the process's thread count after the model loaded, the evidence of what ORT actually started.

Timing (same convention as edgespec's Stats): t0 just before the Generator is created (prompt
already tokenized); ttft_s = until the first new token is returned by get_next_tokens();
decode_s = from that first token to the last; tokens_per_s = new_tokens / decode_s;
total_s = t0 to the last token.

Exit status: 0 with results; 0 with {"error": ...} when the installed GenAI does not support the
requested mode (the exact exception text); 2 with {"error": ...} for any other failure (bad
arguments, model build failure, ...).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

MODES = ("plain", "draft", "ngram")
PRECISIONS = ("fp32", "fp16", "int8", "int4")  # fp16: the builder's -p fp16 (tried on the CPU; a failure is recorded)
# The builder's --extra_options per integer precision: edgespec's recipe (export/quantize.py WEIGHT_ONLY). Given
# explicitly, not left to the builder's defaults (block 32 and accuracy level 4 on the CPU today, symmetric).
# int4: the lm_head at 8 bits needs algo_config=rtn (with the builder's default algorithm and
# matmul_mixed_precision, 0.18 writes a graph ORT refuses to load: "lm_head.MatMul.weight_Q8G32 is not a graph
# input"); with tied embeddings the builder then reads the embedding from that 8-bit lm_head weight
# (GatherBlockQuantized), where edgespec keeps an fp32 table.
QUANT_OPTIONS = {
    "fp32": (),
    "fp16": (),
    "int8": ("block_size=32", "accuracy_level=4", "is_symmetric=false"),
    "int4": ("block_size=32", "accuracy_level=4", "is_symmetric=false", "algo_config=rtn",
             "matmul_mixed_precision=last_matmul:int8"),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# The one JSON object goes to the real stdout; anything else (native libraries' prints included)
# is sent to stderr by pointing fd 1 there.
_JSON_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def emit(obj: dict, code: int = 0):
    _JSON_OUT.write(json.dumps(obj) + "\n")
    _JSON_OUT.flush()
    sys.exit(code)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class BuildError(RuntimeError):
    def __init__(self, msg: str, log_tail: list[str]):
        super().__init__(msg)
        self.log_tail = log_tail


def folder_key(hf_dir: Path, version: str, extra: tuple = ()) -> str:
    h = hashlib.sha1(f"{hf_dir.resolve()}|{version}".encode() + "".join(f"|{o}" for o in extra).encode())
    for p in sorted(hf_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def builder_command(hf_dir: Path, out: Path, work: Path, precision: str) -> list[str]:
    """The exact model-builder command for one HF folder at one precision."""
    extra = QUANT_OPTIONS[precision]
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
            "-p", precision, "-e", "cpu", "-c", str(work / "builder_cache")] + \
        (["--extra_options", *extra] if extra else [])


def build(hf_dir: Path, work: Path, version: str, precision: str) -> tuple[Path, dict]:
    """GenAI model builder on one HF folder; reuses a finished build. Returns the build and its record
    (precision, builder extra options, the exact command that made it, whether it was reused)."""
    extra = QUANT_OPTIONS[precision]
    out = work / f"{hf_dir.resolve().name}-{precision}-{folder_key(hf_dir, version, extra)}"
    tmp = out.with_name(out.name + ".partial")
    cmd = builder_command(hf_dir, tmp, work, precision)
    record = {"path": str(out), "precision": precision, "extra_options": list(extra),
              "builder_command": shlex.join(cmd), "note": "built into <path>.partial, renamed to <path> when done"}
    if (out / "genai_config.json").is_file():
        log(f"[genai] reusing build {out}")
        return out, dict(record, reused=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log("[genai] building: " + shlex.join(cmd))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    logf = work / f"{out.name}.build.log"
    with open(logf, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        lines = [ln for ln in logf.read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else "(no output)"
        raise BuildError(f"model builder failed (exit {r.returncode}) for {hf_dir}: {last} (full log: {logf})",
                         lines[-25:])
    os.replace(tmp, out)
    return out, dict(record, reused=False)


def draft_overlay(target_build: Path, draft_build: Path) -> dict:
    """The `model.draft` section: the draft build's decoder section, its file relative to the target."""
    dec = json.loads((draft_build / "genai_config.json").read_text())["model"]["decoder"]
    dec = dict(dec)
    dec["filename"] = os.path.relpath(draft_build / dec["filename"], target_build)
    return {"model": {"draft": dec}}


def threads_overlay(threads: dict) -> dict:
    """{section: intra-op threads} -> session_options per model section; 0 leaves a section alone."""
    return {"model": {s: {"session_options": {"intra_op_num_threads": n, "inter_op_num_threads": 1}}
                      for s, n in threads.items() if n > 0}}


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_prompts(path: Path) -> list:
    prompts = json.loads(path.read_text())
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{path}: expected a non-empty JSON list of strings (or of token-id lists)")
    return prompts


def sum_stats(all_stats: list[dict]) -> dict | None:
    if not all_stats:
        return None
    total: dict = {}
    for s in all_stats:
        for k, v in s.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
            elif isinstance(v, list) and all(isinstance(x, int) for x in v):
                cur = total.setdefault(k, [0] * len(v))
                if len(cur) < len(v):
                    cur.extend([0] * (len(v) - len(cur)))
                for i, x in enumerate(v):
                    cur[i] += x
    ev = total.get("draft_tokens_evaluated", 0)
    total["acceptance_rate"] = total.get("draft_tokens_accepted", 0) / ev if ev else 0.0
    total["runs"] = len(all_stats)
    total["note"] = ("integer counters and the histogram summed over the timed runs; "
                     "acceptance_rate = draft_tokens_accepted / draft_tokens_evaluated; per-run dicts in results")
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, default=None, help="required for --mode draft")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list of strings (or of token-id lists)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, required=True, help="cache of built ONNX models")
    ap.add_argument("--mode", choices=MODES, default="plain")
    ap.add_argument("--gamma", type=int, default=None,
                    help="speculative.max_draft_tokens (1..16); GenAI's default (4) when omitted")
    ap.add_argument("--ngram-size", type=int, default=3, help="speculative.ngram_size for --mode ngram (>= 2)")
    ap.add_argument("--ngram-chained", action="store_true", help="speculative.ngram_chained_lookup")
    ap.add_argument("--min-adaptive-k", type=int, default=0,
                    help="speculative.min_adaptive_k (> 0: GenAI adapts k between it and --gamma)")
    ap.add_argument("--threads", type=int, default=0,
                    help="target (model.decoder) intra-op threads; 0 = GenAI's default")
    ap.add_argument("--draft-threads", type=int, default=0,
                    help="draft (model.draft) intra-op threads; 0 = GenAI's default")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS, help="the target's build")
    ap.add_argument("--draft-precision", default=None, choices=PRECISIONS,
                    help="the draft's build (default: --precision); integer precisions: QUANT_OPTIONS")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generations (16 tokens) before timing")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = {"mode": args.mode}
    try:
        import onnxruntime_genai as og
        version = og.__version__
    except Exception as e:  # noqa: BLE001
        emit({**base, "system": "onnxruntime-genai (not importable)", "error": f"{type(e).__name__}: {e}"}, 2)
    base = {"system": f"onnxruntime-genai {version}", **base}

    # ---- inputs and model builds (failures here are not "unsupported mode": exit 2)
    try:
        if args.max_new_tokens < 1 or args.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1")
        if args.mode == "draft" and args.draft is None:
            raise ValueError("--mode draft needs --draft")
        prompts = load_prompts(args.prompts)
        args.work.mkdir(parents=True, exist_ok=True)
        draft_precision = args.draft_precision or args.precision
        target_build, target_rec = build(args.target, args.work, version, args.precision)
        draft_build, draft_rec = (build(args.draft, args.work, version, draft_precision) if args.mode == "draft"
                                  else (None, None))
    except BuildError as e:
        emit({**base, "error": str(e), "stage": "build", "build_log_tail": e.log_tail}, 2)
    except Exception as e:  # noqa: BLE001
        emit({**base, "error": f"{type(e).__name__}: {e}", "stage": "setup"}, 2)

    config = {"target_build": str(target_build), "draft_build": str(draft_build) if draft_build else None,
              "builds": {"target": target_rec, **({"draft": draft_rec} if draft_rec else {})},
              "precision": args.precision, "draft_precision": draft_precision if draft_build else None,
              "threads": args.threads or "GenAI default",
              "draft_threads": (args.draft_threads or "GenAI default") if draft_build else None,
              "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "warmup": args.warmup, "search": {"do_sample": False, "top_k": 1}}

    # ---- model + speculative options (an exception here means the mode is unsupported: exit 0)
    spec_opts: dict = {}
    if args.mode in ("draft", "ngram") and args.gamma is not None:
        spec_opts["max_draft_tokens"] = args.gamma
    if args.mode == "ngram":
        spec_opts["ngram_size"] = args.ngram_size
        if args.ngram_chained:
            spec_opts["ngram_chained_lookup"] = True
    if args.mode != "plain" and args.min_adaptive_k:
        spec_opts["min_adaptive_k"] = args.min_adaptive_k
    config["speculative_options"] = spec_opts
    try:
        cfg = og.Config(str(target_build))
        overlay = threads_overlay({"decoder": args.threads, **({"draft": args.draft_threads} if draft_build else {})})
        if draft_build:
            overlay = merge(overlay, draft_overlay(target_build, draft_build))
        if overlay["model"]:
            cfg.overlay(json.dumps(overlay))
        config["config_overlay"] = overlay
        model = og.Model(cfg)
        config["os_threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
        tokenizer = og.Tokenizer(model) if any(isinstance(p, str) for p in prompts) else None

        def new_params(max_length):
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, top_k=1, num_beams=1, max_length=max_length)
            if args.mode != "plain":
                params.set_speculative_options(**spec_opts)
                got = params.get_speculative_options()
                config["speculative_options_effective"] = got
            return params

        encoded = [list(map(int, tokenizer.encode(p))) if isinstance(p, str) else [int(t) for t in p]
                   for p in prompts]
        # Probe once: creating a generator is where GenAI validates the speculative setup.
        probe = og.Generator(model, new_params(len(encoded[0]) + 1))
        probe.append_tokens(encoded[0])
        probe.generate_next_token()
        del probe
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "config": config, "error": str(e) or f"{type(e).__name__}", "stage": "speculative setup",
              "peak_rss_bytes": peak_rss_bytes()}, 0)

    def run_one(ids: list[int], max_new: int):
        limit = len(ids) + max_new
        params = new_params(limit)
        t0 = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        out: list[int] = []
        t_first = None
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            if t_first is None:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        seq = [int(x) for x in gen.get_sequence(0)][len(ids):]
        stats = None
        if args.mode != "plain" and hasattr(gen, "get_speculative_stats"):
            stats = gen.get_speculative_stats()
        return out, seq, t0, t_first, t_end, stats

    results, all_stats = [], []
    try:
        for _ in range(args.warmup):
            run_one(encoded[0], min(16, args.max_new_tokens))
        for rep in range(args.repeats):
            for i, ids in enumerate(encoded):
                out, seq, t0, t_first, t_end, stats = run_one(ids, args.max_new_tokens)
                decode = t_end - t_first if t_first is not None else 0.0
                r = {"prompt_index": i, "repeat": rep, "prompt_token_ids": ids, "token_ids": out,
                     "new_tokens": len(out), "tokens_per_s": len(out) / decode if decode > 0 else None,
                     "ttft_s": (t_first - t0) if t_first is not None else None, "decode_s": decode,
                     "total_s": t_end - t0}
                if seq != out:  # tokens streamed vs final sequence: should never differ
                    r["sequence_token_ids"] = seq
                if stats is not None:
                    r["speculative_stats"] = stats
                    all_stats.append(stats)
                results.append(r)
                log(f"[genai {args.mode}] rep {rep} prompt {i}: {len(out)} tok, "
                    f"ttft {r['ttft_s']:.4f}s, {r['tokens_per_s'] or 0:.1f} tok/s")
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "config": config, "error": str(e) or type(e).__name__, "stage": "generate",
              "results": results, "peak_rss_bytes": peak_rss_bytes()}, 2)

    emit({**base, "config": config, "results": results,
          "speculative_stats": sum_stats(all_stats) if args.mode != "plain" else None,
          "peak_rss_bytes": peak_rss_bytes()}, 0)


if __name__ == "__main__":
    main()

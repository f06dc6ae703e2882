"""Peer runner: Hugging Face optimum's ORTModelForCausalLM (ONNX Runtime under transformers' generate), greedy.

Runs inside .venv-optimum (see bench/setup_peers.sh), as a subprocess of bench/bench_peers.py:

    .venv-optimum/bin/python bench/peers/optimum_runner.py --target models/demo-target \
        --prompts prompts.json --max-new-tokens 128 --repeats 2 --work .cache/peers/optimum

The HF folder is exported once with optimum's own exporter (ORTModelForCausalLM.from_pretrained(...,
export=True)) into --work and reused. Prints ONE JSON object (same shape as hf_runner.py).
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_runner as H  # noqa: E402  (redirects stdout: the JSON goes to the real one)


def main() -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, default=None, help="unused (optimum has no speculative mode)")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--mode", default="plain", choices=["plain"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    base = {"system": "optimum ORTModelForCausalLM", "mode": "plain"}
    try:
        from importlib.metadata import version

        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM
        from transformers import AutoTokenizer
        base["system"] = (f"optimum {version('optimum')} (optimum-onnx {version('optimum-onnx')}) ORTModelForCausalLM "
                          f"(onnxruntime {ort.__version__})")
        torch.set_num_threads(args.threads)
        out_dir = args.work / args.target.name
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        if (out_dir / "model.onnx").is_file():
            model = ORTModelForCausalLM.from_pretrained(out_dir, session_options=so, use_cache=True)
        else:
            model = ORTModelForCausalLM.from_pretrained(args.target, export=True, use_cache=True, session_options=so)
            model.save_pretrained(out_dir)
        tok = AutoTokenizer.from_pretrained(args.target)
        prompts = json.loads(args.prompts.read_text())
        encoded = [tok(p).input_ids if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    except Exception as e:  # noqa: BLE001
        H.log(traceback.format_exc())
        H.emit({**base, "error": f"{type(e).__name__}: {e}", "stage": "setup"}, 2)
    eos = tok.eos_token_id
    rec = H.Recorder()

    def run_one(ids, n):
        rec.reset()
        x = torch.tensor([ids], dtype=torch.long)
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=eos, streamer=rec)
        return [int(t) for t in out[0, len(ids):].tolist()], t0, time.perf_counter()

    run_one(encoded[0], 16)
    results = []
    for rep in range(args.repeats):
        for i, ids in enumerate(encoded):
            out, t0, t_end = run_one(ids, args.max_new_tokens)
            decode = rec.t_last - rec.t_first if rec.t_first is not None else 0.0
            results.append({"prompt_index": i, "repeat": rep, "token_ids": out, "new_tokens": len(out),
                            "tokens_per_s": len(out) / decode if decode > 0 else None,
                            "ttft_s": rec.t_first - t0 if rec.t_first else None, "decode_s": decode,
                            "total_s": t_end - t0})
    H.emit({**base, "results": results, "peak_rss_bytes": H.peak_rss_bytes()}, 0)


if __name__ == "__main__":
    main()

"""The `edgespec` command line.

    edgespec demo                                   # bundled pair: text, tokens/s, acceptance, speedup
    edgespec generate --target engines/demo-target --draft engines/demo-draft --prompt "def f(x):"
    edgespec export models/demo-target --out engines/demo-target --dtype fp32 --max-context 2048
    edgespec inspect engines/demo-target
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

from edgespec.speculation import from_args, speculation_flags
from edgespec.backends import ENGINE_PROVIDERS
from edgespec.backends.ort import ORT_ERROR_MODULE

# Packages that build on the runtime add their subcommands through this entry-point group (pyproject.toml):
# each entry is register(subparsers). The runtime never names them, so it imports neither.
COMMANDS_GROUP = "edgespec.commands"
DEMO_LOOKUP = 3  # edgespec demo: prompt lookup before the draft model (the fastest mode in bench_peers)
DEMO_LOOKUP_GAMMA = 12  # edgespec demo: lookup rounds propose up to 12 (bench_peers' draft+lookup sweep)


def provider_flag(p, draft: bool = False) -> None:
    p.add_argument("--provider", choices=ENGINE_PROVIDERS, default=None,
                   help="default: cuda where onnxruntime has it, else cpu (tensorrt: a folder's plan, else the EP)")
    if draft:
        p.add_argument("--draft-provider", choices=ENGINE_PROVIDERS, default=None,
                       help="where the draft engine runs (default: the target's provider; cpu for a draft without "
                            "native weights beside a native target), e.g. cpu-native beside cuda-native")


def _chat_template_source(folder: Path) -> str:
    """Where an engine folder's chat template comes from (edgespec/chat.py's order), or "none"."""
    from edgespec.chat import CONFIG_FILE, TEMPLATE_FILE, read_tokenizer_config
    if (folder / TEMPLATE_FILE).is_file():
        return TEMPLATE_FILE
    return f"{CONFIG_FILE}'s chat_template" if "chat_template" in read_tokenizer_config(folder) else "none"


def cmd_inspect(args) -> int:
    from edgespec.contract import EngineError, Manifest
    from edgespec.backends.ort import OrtEngine

    try:
        m = Manifest.read(args.engine_dir)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(m.to_json(), end="")
    else:
        print(f"{args.engine_dir}: {m.kind} engine, {m.architecture}, {m.precision}, inputs={m.input_mode}")
        print(f"  layers {m.num_layers}, heads {m.num_heads} (kv {m.num_kv_heads}), head dim {m.head_dim}, "
              f"hidden {m.hidden_size}, vocab {m.vocab_size}, max context {m.max_context}")
        print(f"  model {m.model_file} sha256 {str(m.model_sha256)[:16]}…  tokenizer {m.tokenizer_file}  "
              f"edgespec {m.edgespec_version}")
        print(f"  EOS ids {m.eos_token_ids}; chat template: {_chat_template_source(Path(args.engine_dir))}")
        for kind, specs in (("in ", m.inputs), ("out", m.outputs)):
            for t in specs[:5]:
                print(f"  {kind} {t.name:24s} {t.dtype:8s} {t.shape}")
            if len(specs) > 5:
                print(f"  {kind} … {len(specs) - 5} more (per-layer cache tensors)")
        lo, hi = m.argmax_range
        print(f"  KV cache {m.cache_dtype}, written in place; next_ids = argmax over ids {lo}..{hi - 1}")
        _print_weight_bytes(m, args.engine_dir)
        print(f"  flavor {m.flavor}" + ("" if m.flavor == "ort" else " (standard ONNX ops: CPU, CUDA, TensorRT)"))
        for op, how in m.fusion.items():  # ort: what each fusable op became, and why a fallback
            print(f"    {op}: {how}")
        trt = m.extra.get("tensorrt")
        if trt:
            print(f"  TensorRT plan {trt.get('plan')} (TensorRT {trt.get('tensorrt_version')}, fp16 {trt.get('fp16')}, "
                  f"profiles {[p.get('name') for p in trt.get('profiles', [])]}): provider tensorrt runs it")
        nat = m.extra.get("native")
        if nat and nat.get("file"):
            g = nat.get("gate", {})
            print(f"  providers cpu-native and cuda-native: {nat['file']}, {nat.get('weights', 'float16')} weights and "
                  f"float32 math"
                  + (f", {nat['weight_bytes_per_token'] / 1e6:.2f} MB of weights per token"
                     if nat.get("weight_bytes_per_token") else "")
                  + (f"; gate against ONNX Runtime: ids {g.get('ids_agree')}/{g.get('ids')}, max logit difference "
                     f"{g.get('max_logit_diff'):.1e}" if g.get("passed") else ""))
        elif nat:
            print(f"  providers cpu-native and cuda-native: not available ({nat.get('unavailable')})")
        if m.extra.get("validation"):
            print("  validation: " + json.dumps(m.extra["validation"]))
    try:
        OrtEngine(args.engine_dir, check_hashes=True)
    except Exception as e:  # the folder or graph disagrees with a readable manifest (or ORT cannot load it)
        if not (isinstance(e, EngineError) or expected_error(e)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("  files and graph match the manifest: OK")
    return 0


def _print_weight_bytes(m, engine_dir: Path) -> None:
    """inspect's precision and weight bytes per token lines (export records them: export/quantize.py)."""
    q, w = m.extra.get("quantization"), m.extra.get("weight_bytes_per_token")
    if q:
        print(f"  precision {m.precision}: {q.get('method')}"
              + (f", {q['bits']}-bit blocks of {q['block_size']}, accuracy level {q.get('accuracy_level')}"
                 if "block_size" in q else "")
              + (f", lm_head {q['head']} {q['head_bits']}-bit" if q.get("head") else ""))
    elif m.precision == "int8":
        print("  precision int8: no quantization record (exported when int8 meant dynamic int8, now int8-dynamic)")
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * (2 if m.cache_dtype == "float16" else 4)
    if w:
        parts = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in w["by_kind"].items() if v >= 1e3)
        print(f"  weight bytes per token: {w['total'] / 1e6:.2f} MB ({parts}); KV cache {kv} B per context token")
    else:
        print(f"  weight bytes per token: not recorded (exported before edgespec recorded it: re-export, or run "
              f"python -m edgespec.export.quantize {Path(engine_dir) / m.model_file}); "
              f"KV cache {kv} B per context token")


def _read_batch_file(path: Path) -> list[str]:
    """One prompt per line; a line that is a JSON string (\"...\") may hold newlines as \\n."""
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: expected UTF-8 text, got byte {e.object[e.start]:#04x} "
                         f"at offset {e.start}") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: line starts with a quote but is not a JSON string ({e})") from None
        prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one per line)")
    return prompts


def _check_text_args(args) -> None:
    """--prompt and --stop as UTF-8, before any engine loads: argv holds undecodable bytes as lone
    surrogates (os.fsdecode), which no tokenizer can encode."""
    from edgespec.generate import check_text
    if getattr(args, "prompt", None) is not None:
        check_text(args.prompt, "--prompt")
    if getattr(args, "system", None) is not None:
        check_text(args.system, "--system")
    for stop in getattr(args, "stop", None) or []:
        check_text(stop, "--stop")


def _stats_line(st) -> str:
    t = st.time_s
    line = (f"{st.new_tokens} tokens, {st.tokens_per_second:.1f} tok/s, prefill {t['prefill'] * 1e3:.0f} ms")
    if st.drafted:
        line += (f", acceptance {st.acceptance_rate:.2f}, {st.tokens_per_round:.2f} tokens/round "
                 f"over {st.rounds} rounds")
    dec = t["decode"] or 1.0
    line += (f" | draft {100 * t['draft'] / dec:.0f}% verify {100 * t['verify'] / dec:.0f}% "
             f"sampling {100 * t['sampling'] / dec:.0f}% other {100 * t['other'] / dec:.0f}%")
    return line


def cmd_generate(args) -> int:
    import edgespec

    if (args.prompt is None) == (args.batch_file is None):
        raise ValueError("give exactly one of --prompt TEXT or --batch-file FILE")
    if args.system is not None and not args.chat:
        raise ValueError("--system goes with --chat (it is the conversation's system message)")
    _check_text_args(args)
    from .remote import RemoteConfig, is_url
    if (args.deadline is not None or args.local is not None) and not is_url(args.target):
        raise ValueError(f"--deadline and --local go with a server target (--target http://HOST:PORT), got "
                         f"--target {args.target}")
    remote = RemoteConfig(args.target, deadline_s=args.deadline) if args.deadline is not None else None
    gen = edgespec.load(args.target, draft=args.draft, provider=args.provider, spec=from_args(args),
                        local=args.local, remote=remote, draft_provider=args.draft_provider)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, acceptance=args.acceptance, stop=args.stop or None)

    def prompt_of(text):  # --chat: the text is the user's turn, through the checkpoint's chat template
        if not args.chat:
            return text
        system = [{"role": "system", "content": args.system}] if args.system else []
        return gen.chat_ids(system + [{"role": "user", "content": text}])

    if args.batch_file is not None:
        outs = gen.generate([prompt_of(p) for p in _read_batch_file(args.batch_file)], **kw)
        if args.json:
            print(json.dumps({"results": [{"text": o.text, "token_ids": o.token_ids,
                                           "finish_reason": o.finish_reason} for o in outs],
                              "stats": outs[0].stats.to_dict()}))
        else:
            for i, o in enumerate(outs):
                print(f"--- [{i}] ({o.finish_reason})\n{o.text}")
            print(_stats_line(outs[0].stats), file=sys.stderr)
        return 0
    if args.json:
        o = gen.generate(prompt_of(args.prompt), **kw)
        print(json.dumps({"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                          "stats": o.stats.to_dict()}))
        return 0
    pieces = gen.stream(prompt_of(args.prompt), **kw)  # checks the prompt and settings before anything is printed
    if not args.chat:  # a completion continues the prompt; a chat prints the reply alone
        sys.stdout.write(args.prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    print(_stats_line(gen.last_stats), file=sys.stderr)
    return 0


def cmd_serve_target(args) -> int:
    from . import serve
    if args.setup:
        py = serve.setup_env()
        print(f"vLLM and the edgespec plugin are ready in {py}")
        return 0
    if args.model is None:
        raise ValueError("give the model folder to serve (e.g. models/demo-target), or --setup")
    argv, plain = serve.command(args.model, args.host, args.port, args.name, args.max_model_len, args.device,
                                args.memory_fraction, args.python)
    print(f"edgespec: serving {args.model} at http://{args.host}:{args.port} (model name "
          f"{args.name or args.model.name!r}); the same server with plain vLLM:\n  {plain}", flush=True)
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    serve.check_env(argv[0])
    os.execv(argv[0], argv)  # the server replaces this process: signals and exit codes are vLLM's


def cmd_profile(args) -> int:
    import edgespec
    from edgespec.profiling import profile

    _check_text_args(args)
    gen = edgespec.load(args.target, draft=args.draft, provider=args.provider, spec=from_args(args),
                        draft_provider=args.draft_provider)
    prompts = _read_batch_file(args.prompts_file) if args.prompts_file else [args.prompt or DEMO_PROMPTS[0]]
    gen.generate(prompts[0], max_new_tokens=8)  # warm-up
    kw = dict(temperature=args.temperature, seed=args.seed, acceptance=args.acceptance)
    report, trace = profile(gen, prompts, args.max_new_tokens, args.lossless_check, **kw)
    report["command"] = "edgespec " + " ".join(sys.argv[1:])
    if args.trace:
        args.trace.write_text(json.dumps(trace))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['tokens']} tokens from {report['prompts']} prompts, {report['tokens_per_s']:.1f} tok/s")
    print(f"{'ms':>14s} {'p50':>8s} {'p95':>8s} {'p99':>8s}")
    rows = [("per token", report["token_ms"]), ("TTFT", report["ttft_ms"])]
    rows += [(f"round {k}", v) for k, v in report["round_ms"].items()]
    for name, p in rows:
        if p["n"]:
            print(f"{name:>14s} {p['p50']:8.3f} {p['p95']:8.3f} {p['p99']:8.3f}")
    share = report["round_time_share"]
    print("round time: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in share.items()))
    tg = report["tegrastats"]
    if tg["available"]:
        print(f"tegrastats: EMC {tg['emc_pct_mean']}%, power {tg['power_mw_mean']}, "
              f"{tg.get('joules_per_token')} J/token")
    else:
        print(f"tegrastats: {tg['reason']}")
    if "lossless_check" in report:
        lc = report["lossless_check"]
        print(f"lossless check: {lc.get('diverged', 0)}/{lc['checked']} prompts diverged from plain decoding"
              + (f" ({lc['reason']})" if "reason" in lc else ""))
    if args.trace:
        print(f"trace: {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


DEMO_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def read_config(path):\n    with open(path) as f:\n",
]


def cmd_demo(args) -> int:
    import edgespec

    from edgespec.export.bundled import ensure_demo_engines  # only re-exports (torch) when a folder is stale

    _check_text_args(args)
    target, draft = ensure_demo_engines(args.models, args.engines)
    prompts = [args.prompt] if args.prompt else DEMO_PROMPTS
    plain = edgespec.load(target, provider=args.provider)
    spec = edgespec.load(target, draft=draft, provider=args.provider, spec=from_args(args),
                         draft_provider=args.draft_provider)
    kw = dict(max_new_tokens=args.max_new_tokens)
    spec.generate(prompts[0], max_new_tokens=8)  # warm-up (and auto-gamma's cost measurement)
    plain.generate(prompts[0], max_new_tokens=8)
    tp = ts = n = 0.0
    for prompt in prompts:
        a = plain.generate(prompt, **kw)
        b = spec.generate(prompt, **kw)
        same = "identical to plain decoding" if a.token_ids == b.token_ids else "DIFFERS from plain decoding"
        print(f"\033[2m{prompt}\033[0m{b.text}\n")
        print(f"  plain       : {_stats_line(a.stats)}")
        print(f"  speculative : {_stats_line(b.stats)}  [{same}]\n")
        tp += a.stats.time_s["decode"]
        ts += b.stats.time_s["decode"]
        n += b.stats.new_tokens
    print(f"speedup over plain decoding (same engines, same run): {tp / ts:.2f}x "
          f"({n / tp:.1f} -> {n / ts:.1f} tok/s, greedy, {len(prompts)} prompts)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec", description="Speculative decoding on edge devices.")
    sub = ap.add_subparsers(dest="command", required=True)

    def sampling_flags(p):
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; sampling needs >= 1e-4")
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--acceptance", choices=["greedy", "rejection", "coupled"], default=None,
                       help="default: greedy at temperature 0, else rejection")
        p.add_argument("--stop", action="append", help="stop string (repeatable)")

    p = sub.add_parser("generate", help="generate text with a target engine and an optional draft")
    p.add_argument("--target", required=True,
                   help="target engine folder, or http://HOST:PORT of a vLLM server (edgespec serve-target)")
    p.add_argument("--local", type=Path, default=None,
                   help="with a server target: a local target engine folder for the calls the server misses")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="with a server target: seconds a verify may take before it falls back (default 2)")
    p.add_argument("--draft", default=None, help="draft engine folder, or 'ngram' (prompt lookup)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--batch-file", type=Path, default=None, help="one prompt per line, decoded as one batch")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered with the engine's chat template (instruct models)")
    p.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    speculation_flags(p)
    provider_flag(p, draft=True)
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and stats")
    sampling_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="speculative vs plain decoding on the bundled demo pair")
    p.add_argument("--engines", type=Path, default=Path("engines"))
    p.add_argument("--models", type=Path, default=Path("models"))
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    speculation_flags(p, lookup=DEMO_LOOKUP, lookup_gamma=DEMO_LOOKUP_GAMMA)
    provider_flag(p, draft=True)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("profile", help="latency profile: per-round timeline, percentiles, Perfetto trace")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", default=None, help="draft engine folder, or 'ngram'")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompts-file", type=Path, default=None, help="one prompt per line (JSON strings allowed)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    speculation_flags(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; sampling needs >= 1e-4")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--acceptance", choices=["greedy", "rejection", "coupled"], default=None)
    provider_flag(p, draft=True)
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace JSON (Perfetto)")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    p.add_argument("--lossless-check", type=int, default=0, metavar="N",
                   help="shadow-decode N prompts without speculation and report the divergence rate")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("serve-target", help="start a vLLM server with the flags remote targets need")
    p.add_argument("model", type=Path, nargs="?", help="Hugging Face model folder, e.g. models/demo-target")
    p.add_argument("--setup", action="store_true",
                   help="make .venv-vllm: vLLM's CPU build (the fleet extra) and edgespec's plugin, then exit")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", default=None, help="served model name (default: the folder's name)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="vLLM's --gpu-memory-utilization (on the CPU: the share of RAM for its cache; default 0.2)")
    p.add_argument("--python", default=None, help="the interpreter with vllm (default: this one, else .venv-vllm)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not start it")
    p.set_defaults(func=cmd_serve_target)

    p = sub.add_parser("inspect", help="print an engine's manifest and check its files against it")
    p.add_argument("engine_dir", type=Path)
    p.add_argument("--json", action="store_true", help="print engine.json only")
    p.set_defaults(func=cmd_inspect)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        ep.load()(sub)  # `export`, `export-policy` (edgespec.export), `robot` (edgespec.robots)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `edgespec inspect ... | head`
        sys.stderr.close()
        return 0
    except Exception as e:  # expected failures (bad input, bad files, the runtime's errors): one line, exit 2
        if not expected_error(e):
            raise  # a bug: keep its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


# What a command may fail with for reasons outside the code: arguments, files, engines (EngineError is a
# ValueError), numerics, and ONNX Runtime's own errors (Fail, InvalidArgument, RuntimeException, ...),
# which share no base class but Exception, so they are recognised by their module.
EXPECTED_ERRORS = (ValueError, FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                   PermissionError, RuntimeError, FloatingPointError)


def expected_error(e: BaseException) -> bool:
    return isinstance(e, EXPECTED_ERRORS) or type(e).__module__ == ORT_ERROR_MODULE


if __name__ == "__main__":
    raise SystemExit(main())

"""The `edgespec` command line.

    edgespec export models/demo-target --out engines/demo-target --dtype fp32 --max-context 2048
    edgespec inspect engines/demo-target
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _need_export_extra():
    try:
        import torch  # noqa: F401
        import onnx  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"`edgespec export` needs the export extra ({e.name} is missing): "
                         f"pip install 'edgespec[export]' (on x86 CPU machines: pip install torch==2.13.0 first)")


def cmd_export(args) -> int:
    _need_export_extra()
    from edgespec.export.onnx_export import export_engine

    m = export_engine(args.checkpoint, args.out, dtype=args.dtype, max_context=args.max_context,
                      input_mode=args.inputs, force=args.force, progress=not args.quiet)
    v = m.extra["validation"]
    print(f"wrote {args.out} ({m.precision}, max context {m.max_context}, {m.architecture}, "
          f"{m.num_layers} layers, vocab {m.vocab_size})")
    print(f"  parity vs reference: max |diff| {v['parity']['max_abs_diff']:.2e} (tolerance 1e-4)")
    print(f"  verify pass vs single steps: max |diff| {v['verify']['max_abs_diff']:.2e} (tolerance 1e-4)")
    if "agreement_vs_fp32" in v:
        a = v["agreement_vs_fp32"]
        print(f"  {m.precision} vs fp32 over {a['tokens']} tokens of {a['text']}: "
              f"top-1 agreement {a['top1_agreement']:.4f}, mean KL {a['mean_kl']:.2e}")
    return 0


def cmd_inspect(args) -> int:
    from edgespec.contract import EngineError, Manifest
    from edgespec.engine import OrtEngine

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
        for kind, specs in (("in ", m.inputs), ("out", m.outputs)):
            for t in specs[:5]:
                print(f"  {kind} {t.name:24s} {t.dtype:8s} {t.shape}")
            if len(specs) > 5:
                print(f"  {kind} … {len(specs) - 5} more (per-layer cache tensors)")
        if m.extra.get("validation"):
            print("  validation: " + json.dumps(m.extra["validation"]))
    try:
        OrtEngine(args.engine_dir, check_hashes=True)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("  files and graph match the manifest: OK")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec", description="Speculative decoding on edge devices.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="checkpoint folder -> validated engine folder")
    p.add_argument("checkpoint", type=Path, help="Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("--out", type=Path, required=True, help="engine folder to write")
    p.add_argument("--dtype", choices=["fp32", "fp16", "int8"], default="fp32")
    p.add_argument("--max-context", type=int, default=None, help="KV capacity (default min(model limit, 2048))")
    p.add_argument("--inputs", choices=["ids", "embeds"], default="ids",
                   help="first graph input: input_ids, or inputs_embeds for VLA/VLM prefixes")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("inspect", help="print an engine's manifest and check its files against it")
    p.add_argument("engine_dir", type=Path)
    p.add_argument("--json", action="store_true", help="print engine.json only")
    p.set_defaults(func=cmd_inspect)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

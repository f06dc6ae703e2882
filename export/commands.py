"""`edgespec export` and `edgespec export-policy`: registered on the runtime's command line through the
"edgespec.commands" entry point (pyproject.toml), so the runtime never imports the exporter. Nothing here
imports torch until a command runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from edgespec.export.bundled import need_export_extra

DTYPES = ["fp32", "fp16", "int8", "int4", "int8-dynamic"]  # contract.PRECISIONS; integer ones: export/quantize.py
DTYPE_HELP = ("int8 / int4: weight-only blocks of the MatMul weights (ONNX Runtime MatMulNBits, CPU and CUDA); "
              "int8-dynamic: int8 weights + activations quantized at run time (standard ONNX ops)")


def cmd_export(args) -> int:
    need_export_extra()
    from edgespec.export.onnx_export import export_engine

    m = export_engine(args.checkpoint, args.out, dtype=args.dtype, max_context=args.max_context,
                      input_mode=args.inputs, force=args.force, progress=not args.quiet,
                      role=args.role, allow_lossy=args.allow_lossy, flavor=args.flavor, hidden=args.hidden,
                      max_memory=None if args.max_memory is None else int(args.max_memory * 2**30))
    v = m.extra["validation"]
    print(f"wrote {args.out} ({m.precision}, max context {m.max_context}, {m.architecture}, "
          f"{m.num_layers} layers, vocab {m.vocab_size})")
    for key, what in (("parity", "parity vs reference"), ("verify", "verify pass vs single steps")):
        r = v[key]
        print(f"  {what}: max |diff| {r['max_abs_diff']:.2e} (tolerance {r['tolerance']:.2e} = 1e-4 x max(1, "
              f"max |logit| {r['max_abs_logit']:.3g}); top-1 equal on {r['top1']['decisive_tokens'] - r['top1']['disagree']}"
              f" of {r['top1']['decisive_tokens']} decisive tokens)")
    em = m.extra.get("export_memory") or {}
    if em:
        est = em.get("estimate_bytes") or {}
        print(f"  peak RSS {em['peak_rss_bytes'] / 2**30:.2f} GiB (estimated {est.get('total_bytes', 0) / 2**30:.2f} "
              f"GiB), {m.extra.get('parameters', 0) / 1e6:.1f}M parameters, {m.extra.get('export_seconds')} s")
    if "agreement_vs_fp32" in v:
        a = v["agreement_vs_fp32"]
        print(f"  {m.precision} vs fp32 over {a['tokens']} tokens of {a['text']}: "
              f"top-1 agreement {a['top1_agreement']:.4f}, mean KL {a['mean_kl']:.2e}")
    if "precision_gate" in v:
        g = v["precision_gate"]
        verdict = ("passed" if g["passed"] else "overridden (--allow-lossy)" if g["overridden"]
                   else "not enforced (a draft: the target verifies every token)")
        print(f"  precision gate (top-1 >= {g['threshold']} for a target): {verdict}")
    if args.tensorrt:  # a native plan for this GPU and TensorRT version (provider="tensorrt" runs it)
        from edgespec.export.tensorrt import main as build_plan
        return build_plan([str(args.out)] + (["--fp32"] if m.precision == "fp32" else []))
    return 0


def cmd_export_policy(args) -> int:
    need_export_extra()
    from edgespec.export.llava import is_llava_folder
    from edgespec.export.prismatic import is_openvla_folder
    vlm_flags = ("unnorm_key", "draft", "draft_head", "feature_head", "prompt_template", "action_names", "action_units",
                 "action_kind", "max_context", "horizon", "action_stats", "n_bins")
    if is_openvla_folder(args.model) or is_llava_folder(args.model):
        split = (lambda v: None if v is None else [x.strip() for x in v.split(",")])
        kw = dict(unnorm_key=args.unnorm_key, dtype=args.dtype, draft=args.draft, prompt_template=args.prompt_template,
                  action_names=split(args.action_names), action_units=split(args.action_units),
                  action_kind=args.action_kind, horizon=args.horizon or 1, force=args.force, progress=not args.quiet,
                  allow_lossy=args.allow_lossy, max_context=args.max_context, draft_head=args.draft_head,
                  feature_head=args.feature_head)
        if is_openvla_folder(args.model):
            if args.action_stats is not None or args.n_bins is not None:
                raise SystemExit("--action-stats, --n-bins: an OpenVLA checkpoint carries its own (norm_stats, "
                                 "n_action_bins)")
            from edgespec.export.openvla import export_openvla
            meta, kind = export_openvla(args.model, args.out, **kw), "OpenVLA"
        else:
            from edgespec.export.llava import export_llava
            meta, kind = export_llava(args.model, args.out, action_stats=args.action_stats, n_bins=args.n_bins or 256,
                                      **kw), "Llava"
        print(f"wrote {args.out}: {kind} checkpoint, statistics {meta['source']['unnorm_key']!r}, "
              f"{meta['horizon']} x {meta['dims']} action tokens, encoder gate max |diff| "
              f"{meta['encoder_gate']['max_abs_diff']:.2g}, end-to-end gate passed on "
              f"{meta['end_to_end_gate']['cases']} cases")
        return 0
    vlm_only = [f"--{k.replace('_', '-')}" for k in vlm_flags if getattr(args, k) is not None]
    if vlm_only:
        raise SystemExit(f"{' '.join(vlm_only)}: only for OpenVLA and Llava checkpoints; {args.model} is neither (its "
                         f"config.json names no vision_backbone_id, and its model_type is not llava)")
    from edgespec.export.vla import export_policy
    meta = export_policy(args.model, args.out, dtype=args.dtype, force=args.force, progress=not args.quiet,
                         allow_lossy=args.allow_lossy)
    tokens = (f"FAST tokens (vocabulary {meta['n_bins']}, at most {meta['fast']['max_tokens']} per chunk with END)"
              if meta.get("fast") else f"action tokens, {meta['n_bins']} bins")
    print(f"wrote {args.out}: encoder gate max |diff| {meta['encoder_gate']['max_abs_diff']:.2g}, "
          f"H={meta['horizon']} x D={meta['dims']} {tokens}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's subcommands to `edgespec`'s parser."""
    p = sub.add_parser("export", help="checkpoint folder -> validated engine folder")
    p.add_argument("checkpoint", type=Path, help="Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("--out", type=Path, required=True, help="engine folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help=DTYPE_HELP)
    p.add_argument("--role", choices=["target", "draft"], default="target",
                   help="what the engine is for: the precision gate binds targets (a draft's tokens are all "
                        "verified, so a lossy draft costs speed, not output)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="export a fp16/int8/int4 engine below 0.99 top-1 agreement with fp32 anyway (engine.json "
                        "records the override); for a draft this costs speed only, for a target it changes output")
    p.add_argument("--max-context", type=int, default=None, help="KV capacity (default min(model limit, 2048))")
    p.add_argument("--flavor", choices=["auto", "ort", "portable"], default="auto",
                   help="ort: ONNX Runtime contrib ops (GroupQueryAttention, cache in place; CPU and CUDA), with a "
                        "per-op fallback to standard ops; portable: standard ONNX ops only (TensorRT); auto "
                        "(default): ort where its attention is fused, else portable")
    p.add_argument("--inputs", choices=["ids", "embeds"], default="ids",
                   help="first graph input: input_ids, or inputs_embeds for VLA/VLM prefixes")
    p.add_argument("--hidden", action="store_true",
                   help="also output the final hidden state (what the feature-level text draft head reads)")
    p.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                   help="memory the export may use, GiB (default: what the machine has available); an export "
                        "whose estimated peak is larger is refused before any work")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tensorrt", action="store_true",
                   help="also build model.plan for this GPU (needs an NVIDIA GPU and the trt extra)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("export-policy", help="VLA policy model folder or OpenVLA checkpoint -> encoder + decoder "
                                             "engines")
    p.add_argument("model", type=Path, help="policy folder from edgespec.export.training.train_vla, or a checkpoint "
                                            "folder in OpenVLA's layout (config.json with vision_backbone_id) or a transformers Llava "
                                            "checkpoint (model_type llava)")
    p.add_argument("--unnorm-key", default=None,
                   help="OpenVLA, Llava: the dataset whose action statistics un-normalise the actions (config.json's "
                        "norm_stats; needed when it has more than one)")
    p.add_argument("--draft", type=Path, default=None,
                   help="OpenVLA, Llava: a causal LM checkpoint of the target's width and vocabulary, exported as "
                        "draft/")
    p.add_argument("--draft-head", type=Path, default=None,
                   help="OpenVLA, Llava: a draft_head.npz reading the target's hidden state (train_openvla.py writes "
                        "one); the target is exported with its hidden-state output")
    p.add_argument("--feature-head", type=Path, default=None,
                   help="OpenVLA, Llava: a feature_head.npz (train_feature_head.py), drafting from the target's hidden "
                        "state each round (draft='feature-head'; draft='head' when there is no --draft-head); the "
                        "target is exported with its hidden-state output")
    p.add_argument("--prompt-template", default=None,
                   help="OpenVLA, Llava: the prompt, with {instruction} (default: OpenVLA's for the checkpoint's "
                        "language model; Llava: 'USER: <image>\\nWhat action should the robot take to "
                        "{instruction}? ASSISTANT:', the image token once)")
    p.add_argument("--action-names", default=None,
                   help="OpenVLA, Llava: comma-separated names of the action dimensions (default for 7: ee.dx, ee.dy, "
                        "ee.dz, ee.droll, ee.dpitch, ee.dyaw, gripper)")
    p.add_argument("--action-units", default=None,
                   help="OpenVLA, Llava: comma-separated units of the action dimensions")
    p.add_argument("--action-kind", default=None,
                   help="OpenVLA, Llava: what an action commands (default cartesian_delta)")
    p.add_argument("--max-context", type=int, default=None, help="OpenVLA, Llava: KV capacity of the decoders")
    p.add_argument("--horizon", type=int, default=None,
                   help="OpenVLA, Llava: action steps the statistics' dimensions hold, time-major (default 1)")
    p.add_argument("--action-stats", type=Path, default=None,
                   help="Llava: action statistics JSON ({q01, q99, mask} or OpenVLA's dataset_statistics.json), when "
                        "config.json has no norm_stats")
    p.add_argument("--n-bins", type=int, default=None, help="Llava: action bins, the last ids of the text "
                                                            "vocabulary (default 256)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help=DTYPE_HELP)
    p.add_argument("--allow-lossy", action="store_true",
                   help="export a fp16/int8/int4 target decoder below 0.99 top-1 agreement with fp32 anyway (recorded)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_export_policy)

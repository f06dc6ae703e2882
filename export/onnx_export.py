"""Checkpoint folder -> engine folder (model.onnx + engine.json + tokenizer), through the validation gates.

    edgespec export models/demo-target --out engines/demo-target [--dtype fp32|fp16|int4|int8] [--allow-lossy]
        [--max-context N] [--flavor auto|ort|portable] [--max-memory GIB]

Flavours (engine.json `flavor`, contract.py), both emitted by graph.py from the checkpoint weights: `portable`
is standard ONNX ops (CPU, CUDA, TensorRT); `ort` is built around ONNX Runtime contrib ops (GroupQueryAttention
with the cache updated in place, skip + simplified layer norm), with a per-op fallback to standard ops where
this ONNX Runtime cannot run a shape (engine.json `fusion` says which and why). `auto` (the default) is `ort`
when its attention is fused, else `portable`. TensorRT needs `portable`.

What `export_engine` writes, in order, into a hidden staging folder beside OUT (renamed to OUT only when
every gate passed, so a failed or interrupted export never leaves a folder that loads):
  0) nothing, when memory.py's estimate of the export's peak exceeds the memory it may use (refused)
  1) model.onnx (fp32; model.fp32.onnx while a variant is made), its weights streamed layer by layer into
     model.onnx.data beside it when they exceed EXTERNAL_DATA_BYTES (ONNX's protobuf stops at 2 GB)
  2) tokenizer.json / tokenizer_config.json / chat_template.jinja copied from the checkpoint (if present), and
     with --hidden its text draft head (text_head.npz, export/training/train_text_head.py), if present
  3) embedding.npy (inputs_embeds engines only: the token table, to embed ids on the host)
  4) gates on the fp32 graph: parity vs the reference, verify vs single steps (validate.py: 1e-4 of the
     logits' scale, top-1 beside it); the reference's logits are taken first and the checkpoint is then let
     go, so the fp32 session holds the only copy of the weights
  5) the precision variant (fp16; int8, int4 or int8-dynamic from quantize.py) replacing the fp32 graph, made
     one weight at a time (external.py), with its agreement report vs fp32 (the fp32 logits taken first, so
     the two sessions are never both held) and the precision gate: a target below 0.99 top-1 agreement is
     refused unless --allow-lossy (recorded); then native.npz from the checkpoint, read again
  6) engine.json (the manifest, with hashes, the gate reports, the quantization settings, the weight bytes
     read per token, the parameter count and the export's peak RSS after each stage)
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from edgespec import contract as C

from .checkpoint import CheckpointError, ModelSpec, hash_files, load_weights, read_config, weight_files
from .manifest import build_manifest
from .validate import (ROLES, agreement, calibration_rows, parity_gate, parity_reference, precision_gate, require,
                       teacher_forced, verify_gate)

DEFAULT_MAX_CONTEXT = 2048
FLAVOR_CHOICES = ("auto",) + C.FLAVORS  # auto: ort where GroupQueryAttention runs the shape, else portable
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")  # an instruct checkpoint's conversation format (edgespec/chat.py)


def resolve_max_context(spec: ModelSpec, max_context: int | None) -> int:
    limit = spec.context_limit()  # dynamic NTK and longrope change beyond their original limit; the graph is static
    if max_context is None:
        return min(limit, DEFAULT_MAX_CONTEXT)
    if max_context <= 8:
        raise ValueError(f"--max-context must be > 8, got {max_context}")
    if max_context > limit:
        why = ("max_position_embeddings in config.json" if limit == spec.max_position_embeddings else
               "original_max_position_embeddings of its dynamic or longrope rotary: beyond it the rotary changes")
        raise ValueError(f"--max-context {max_context} exceeds the model's position limit {limit} ({why})")
    return max_context




def choose_flavor(spec: ModelSpec, flavor: str, input_mode: str = "ids") -> tuple[str, dict]:
    """(flavor, engine.json `fusion`) for `flavor` in FLAVOR_CHOICES: ort's per-op plan (graph.plan_fusion);
    auto takes ort only when its attention is fused, else portable with the reason recorded."""
    if flavor not in FLAVOR_CHOICES:
        raise ValueError(f"--flavor must be one of {FLAVOR_CHOICES}, got {flavor!r}")
    if flavor == "portable":
        return flavor, {}
    from .graph import FUSED, plan_fusion
    fusion = plan_fusion(spec)
    if flavor == "auto" and fusion["attention"] != FUSED:
        return "portable", {"attention": "--flavor auto chose portable: " + fusion["attention"]}
    return "ort", fusion


EXTERNAL_DATA_BYTES = 1 << 30  # weights beyond this go to an external data file (ONNX's protobuf stops at 2 GB)


def to_fp16(src: Path, dst: Path, num_layers: int, external: bool = False) -> str | None:
    """fp16 weights, compute and KV cache; the other inputs and outputs stay as the contract has them. The
    weights are converted one at a time (external.fp16_graph). -> the external data file's name, or None."""
    import onnx

    from .external import fp16_graph

    skeleton = onnx.load(str(src), load_external_data=False)
    cache = {n for pair in C.cache_names(num_layers) for n in pair}
    keep = [t.name for t in list(skeleton.graph.input) + list(skeleton.graph.output) if t.name not in cache]
    del skeleton
    return fp16_graph(src, dst, keep, external)


def to_integer(src: Path, dst: Path, precision: str, external: bool = False) -> dict:
    """int4 / int8 (weight-only MatMulNBits) or int8-dynamic: export/quantize.py; returns its record."""
    from .quantize import quantize

    return quantize(precision, src, dst, external=external)


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, from /proc/self/status (0, 0 where there is none)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0, 0
    val = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines()
           if line.startswith(("VmRSS:", "VmHWM:"))}
    return val.get("VmRSS", 0), val.get("VmHWM", 0)


class MemoryLog:
    """The process's peak RSS after each stage of an export (engine.json extra["export_memory"])."""

    def __init__(self):
        self.start = rss_bytes()[0]
        self.stages: dict[str, int] = {}

    def mark(self, stage: str) -> None:
        self.stages[stage] = rss_bytes()[1]

    def record(self) -> dict:
        peak = max([rss_bytes()[1], *self.stages.values()])
        return {"peak_rss_bytes": peak, "rss_at_start_bytes": self.start, "peak_rss_after_stage": dict(self.stages)}


def export_engine(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "fp32", max_context: int | None = None,
                  input_mode: str = "ids", force: bool = False, progress: bool = True,
                  agreement_tokens: int = 1024, argmax_ids: tuple[int, int] | None = None,
                  calibration: tuple[list, str] | None = None,
                  role: str = "target", allow_lossy: bool = False, flavor: str = "auto",
                  hidden: bool = False, external_data: bool | None = None,
                  max_memory: int | None = None) -> C.Manifest:
    """Export `ckpt_dir` to `out_dir` through the gates (module docstring). `role` is "target" or "draft":
    a fp16 / int8 target must keep top-1 agreement >= 0.99 with fp32 (validate.precision_gate) unless
    `allow_lossy`; a draft's agreement is recorded but never refused (the target verifies its tokens).
    `flavor`: FLAVOR_CHOICES (module docstring). external_data: weights in a file beside the graph (None: when
    the fp32 weights exceed EXTERNAL_DATA_BYTES). max_memory: bytes the export may use (None: what the
    machine has available); an export whose estimate (memory.py) exceeds it is refused before any work."""
    import gc

    from tqdm import tqdm

    from edgespec.backends.ort import OrtEngine

    from .graph import build_graph
    from .memory import check_memory
    from .reference import ReferenceDecoder
    from .staging import check_out_dir, prepare, publish

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if dtype not in C.PRECISIONS:
        raise ValueError(f"--dtype must be one of {C.PRECISIONS}, got {dtype!r}")
    if role not in ROLES:  # before any work, like --dtype
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_out_dir(out_dir, [ckpt_dir], force)  # before any work: --force replaces only an edgespec folder
    t0 = time.time()
    mem = MemoryLog()
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a folder; expected a Hugging Face checkpoint folder")
    spec = ModelSpec.from_config(read_config(ckpt_dir), source=str(ckpt_dir / "config.json"))
    max_context = resolve_max_context(spec, max_context)
    params = sum(int(np.prod(shape)) for shape in spec.checkpoint_shapes().values())
    if external_data is None:
        external_data = 4 * params > EXTERNAL_DATA_BYTES
    files = weight_files(ckpt_dir)
    estimate = check_memory(spec, sum(f.stat().st_size for f in files), dtype, max_memory, ckpt_dir)  # or refuse
    weights = load_weights(ckpt_dir, spec, dtype=None)  # the checkpoint's own dtype, widened per tensor
    mem.mark("load checkpoint")
    flavor, fusion = choose_flavor(spec, flavor, input_mode)
    manifest = build_manifest(spec, max_context, "fp32", input_mode, argmax_ids, flavor, hidden)
    manifest.fusion = fusion
    fp32_name = "model.onnx" if dtype == "fp32" else "model.fp32.onnx"
    manifest.model_file = fp32_name
    steps = spec.num_layers + 6
    bar = tqdm(total=steps, desc="export", disable=not progress,
               bar_format="{desc}: {n}/{total} {bar} {elapsed}<{remaining} {postfix}")

    def stage_done(name: str, n: int = 1):
        mem.mark(name)
        rss, peak = rss_bytes()
        bar.set_postfix_str(f"RSS {rss / 2**30:.1f} GiB, peak {peak / 2**30:.1f} GiB", refresh=False)
        bar.update(n)

    stage = prepare(out_dir, [ckpt_dir], force)  # .NAME.partial-PID beside OUT; dead ones there removed
    try:
        # 1) the fp32 graph, its weights streamed to the data file layer by layer
        bar.set_description(f"export: {flavor} graph, layer by layer")
        data = stage / (fp32_name + ".data") if external_data else None
        model = build_graph(spec, weights, manifest, data=data, progress=lambda: stage_done("graph", 1))
        import onnx
        onnx.save(model, str(stage / fp32_name))
        del model
        if data is not None:
            manifest.model_data_file = data.name
            manifest.model_data_bytes = data.stat().st_size
            manifest.model_data_sha256 = C.file_sha256(data)
        stage_done("graph written")
        # 2) tokenizer
        for name in TOKENIZER_FILES:
            if (ckpt_dir / name).is_file():
                shutil.copy2(ckpt_dir / name, stage / name)
        if (stage / "tokenizer.json").is_file():
            manifest.tokenizer_sha256 = C.file_sha256(stage / "tokenizer.json")
        else:
            manifest.tokenizer_file = None
        if hidden and (ckpt_dir / C.TEXT_HEAD_FILE).is_file():  # the checkpoint's text draft head reads this output
            shutil.copy2(ckpt_dir / C.TEXT_HEAD_FILE, stage / C.TEXT_HEAD_FILE)
        # 3) embedding table for inputs_embeds engines
        embed = None
        if input_mode == "embeds":
            # what the graph takes for a token: its row times the family's embedding scale (Gemma: sqrt(E))
            embed = (np.asarray(weights["model.embed_tokens.weight"], np.float32) * np.float32(spec.embed_scale))
            np.save(stage / "embedding.npy", embed)
            manifest.embedding_file = "embedding.npy"
        manifest.source_sha256 = hash_files(weight_files(ckpt_dir) + [ckpt_dir / "config.json"])
        manifest.model_sha256 = C.file_sha256(stage / fp32_name)
        manifest.write(stage)
        # 4) gates on the fp32 graph: the reference's logits first; then the checkpoint is let go, so that the
        #    fp32 session is the only copy of the weights in memory (read again for the native weights)
        bar.set_description("export: reference logits")
        cases = parity_reference(ReferenceDecoder(spec, weights), spec.vocab_size, max_context)
        del weights
        gc.collect()
        stage_done("reference logits", 0)
        bar.set_description("export: parity gate vs reference")
        engine = OrtEngine(stage)
        parity = parity_gate(engine, cases, max_context, embed=embed)
        del cases
        require("parity vs reference", parity)
        stage_done("parity gate")
        bar.set_description("export: verify-pass gate")
        verify = verify_gate(engine, max_context, embed=embed)
        require("verify pass vs single steps", verify)
        validation = {"parity": parity, "verify": verify}
        quantization = None  # int4 / int8 / int8-dynamic: the settings (quantize.py)
        native_info = None  # extra["native"]: the native step's weights, or why there are none
        stage_done("verify gate")
        # 5) precision variant: the fp32 engine's teacher-forced logits first, then the variant alone in memory
        bar.set_description(f"export: {dtype} variant")
        if dtype != "fp32":
            # the caller's rows (a policy: prefixes + the actions decoded from them), or held-out text
            rows, source = calibration or calibration_rows(ckpt_dir, spec.vocab_size, agreement_tokens)
            base_logits = teacher_forced(engine, rows, embed)
            del engine
            gc.collect()
            fp32_path = stage / fp32_name
            variant_data = None
            if dtype == "fp16":
                variant_data = to_fp16(fp32_path, stage / "model.onnx", spec.num_layers, external_data)
            else:
                quantization = to_integer(fp32_path, stage / "model.onnx", dtype, external_data)
                variant_data = quantization.pop("external_data", None)
            fp32_path.unlink()
            if data is not None:
                data.unlink()
            manifest.model_file, manifest.precision = "model.onnx", dtype
            variant_io = build_manifest(spec, max_context, dtype, input_mode, flavor=flavor, hidden=hidden)
            manifest.inputs, manifest.outputs = variant_io.inputs, variant_io.outputs
            manifest.model_sha256 = C.file_sha256(stage / "model.onnx")
            manifest.model_data_file = variant_data
            manifest.model_data_bytes = (stage / variant_data).stat().st_size if variant_data else None
            manifest.model_data_sha256 = C.file_sha256(stage / variant_data) if variant_data else None
            manifest.write(stage)
            stage_done(f"{dtype} variant written")
            variant = OrtEngine(stage)
            agree = agreement(base_logits, variant, rows, embed, embed)
            agree["text"] = source
            validation["agreement_vs_fp32"] = agree
            validation["precision_gate"] = precision_gate(agree, dtype, role, allow_lossy)  # raises for a lossy target
            del variant
            gc.collect()
            from .native import add_native  # native weights of this precision, gated against the same fp32 logits
            bar.set_description(f"export: native {dtype} weights")
            native_info = add_native(stage, spec, load_weights(ckpt_dir, spec, dtype=None), None,
                                     base=(rows, base_logits), role=role, allow_lossy=allow_lossy, consume=True)
            del base_logits
            gc.collect()
        else:
            del engine
            gc.collect()
        stage_done("precision gate")
        # 6) manifest, then the atomic rename
        bar.set_description("export: writing manifest")
        from .quantize import weight_bytes_per_token
        manifest.extra = {"validation": validation, "export_seconds": round(time.time() - t0, 2),
                          "source_checkpoint": ckpt_dir.name, "quantization": quantization,
                          "weight_bytes_per_token": weight_bytes_per_token(stage / manifest.model_file),
                          "parameters": params}
        if native_info is not None:
            manifest.extra["native"] = native_info
        manifest.write(stage)
        if dtype == "fp32":  # float16 weights for providers cpu-native and cuda-native, where exact
            from .native import add_native
            rows, _ = calibration_rows(ckpt_dir, spec.vocab_size, 64, seq=64)
            manifest.extra["native"] = add_native(stage, spec, load_weights(ckpt_dir, spec, dtype=None),
                                                  np.asarray(rows[0])[:max_context], consume=True)
        mem.mark("native weights")
        manifest.extra["export_memory"] = {**mem.record(), "estimate_bytes": estimate}
        manifest.extra["export_seconds"] = round(time.time() - t0, 2)
        manifest.write(stage)
        publish(stage, out_dir)
        bar.set_description("export: done")
        stage_done("done")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        bar.close()
    return manifest


__all__ = ["export_engine"]

"""What an export will hold in memory, estimated before any work, and the refusal when it cannot fit.

An export goes through stages one after another (onnx_export.py); its peak is the largest of them (N
parameters, the checkpoint's weights in their stored dtype of b bytes each):

    graph       the checkpoint's tensors, b N, while the fp32 graph streams to its data file one matrix at a
                time and the reference computes the parity gate's logits
    gates       the fp32 graph's ONNX Runtime session, SESSION_BYTES_PER_PARAM N (the checkpoint let go)
    variant     fp16 / int8 / int4: made one weight at a time (external.py, quantize.weight_only), then its
                session for the agreement report: VARIANT_BYTES_PER_PARAM[dtype] N
    native      the checkpoint read again, b N, and the native weights made from it, which take its tensors
                over as they go (the embedding and head first, then a layer at a time: native.native_arrays
                with consume): b N + NATIVE_BYTES_PER_PARAM[dtype] (the parameters outside the layers + one
                layer's); then the native weights alone, loaded for their gate: NATIVE_BYTES_PER_PARAM[dtype] N,
                and an fp32 folder's exact float16 copy is gated against the fp32 session, which adds
                SESSION_BYTES_PER_PARAM N

bench/results/export-realsize.json holds measured peaks beside these estimates.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SESSION_BYTES_PER_PARAM = 4.0  # an fp32 session holds the weights once (ONNX Runtime's CPU MatMul reads them in place)
VARIANT_BYTES_PER_PARAM = {"fp32": 0.0, "fp16": 4.6, "int4": 1.2, "int8": 1.6, "int8-dynamic": 2.0}
#   the variant's session (fp16: ONNX Runtime's CPU session holds float32 copies beside the float16 weights,
#   4.6 bytes per parameter measured on the 2.8B stand-in; int8 / int4: the MatMulNBits blocks and the float32
#   embedding), and while quantizing, the quantized weights beside one chunk of float32 ones
NATIVE_BYTES_PER_PARAM = {"fp32": 2.0, "fp16": 2.0, "int8": 1.06, "int4": 0.6, "int8-dynamic": 1.06}
MARGIN_BYTES = 1 << 30  # the interpreter, torch, ONNX Runtime and the gates' activations


class ExportMemoryError(ValueError):
    """An export that would not fit in the memory it may use (refused before any work: bad input, not a
    failure of the machine)."""


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate(spec, checkpoint_bytes: int, dtype: str) -> dict:
    """The export's peak by stage (module docstring), bytes; checkpoint_bytes: its weight files' size."""
    shapes = spec.checkpoint_shapes()
    n = sum(int(np.prod(s)) for s in shapes.values())
    held = checkpoint_bytes if checkpoint_bytes <= 3 * n else 4 * n  # bf16 files are widened to float32
    outside = sum(int(np.prod(s)) for k, s in shapes.items() if not k.startswith("model.layers."))
    per_layer = (n - outside) / max(spec.num_layers, 1)
    built = held + NATIVE_BYTES_PER_PARAM[dtype] * (outside + per_layer)  # while the arrays take the tensors over
    gated = NATIVE_BYTES_PER_PARAM[dtype] * n + (SESSION_BYTES_PER_PARAM * n if dtype == "fp32" else 0)
    native = max(built, gated)
    stages = {"graph": held, "gates": SESSION_BYTES_PER_PARAM * n, "variant": VARIANT_BYTES_PER_PARAM[dtype] * n,
              "native": native}
    largest = max(stages, key=stages.get)
    return {"parameters": n, "checkpoint_bytes": int(held), "stages_bytes": {k: int(v) for k, v in stages.items()},
            "largest_stage": largest, "largest_stage_bytes": int(stages[largest]),
            "total_bytes": int(stages[largest] + MARGIN_BYTES)}


def check_memory(spec, checkpoint_bytes: int, dtype: str, max_memory: int | None, ckpt_dir: Path) -> dict:
    """The estimate; ExportMemoryError (one line: the checkpoint, what it needs, what may be used) when the
    total exceeds max_memory (None: what the machine has available now)."""
    est = estimate(spec, checkpoint_bytes, dtype)
    limit = max_memory if max_memory is not None else available_bytes()
    est["limit_bytes"] = limit
    if limit is not None and est["total_bytes"] > limit:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        source = "--max-memory" if max_memory is not None else "MemAvailable in /proc/meminfo"
        raise ExportMemoryError(
            f"{ckpt_dir}: exporting {est['parameters'] / 1e9:.2f}B parameters at {dtype} needs about "
            f"{gib(est['total_bytes'])} (its largest stage, {est['largest_stage']}: "
            f"{gib(est['largest_stage_bytes'])}, + 1 GiB), expected at most {gib(limit)} ({source}); free memory, "
            f"or raise --max-memory if the estimate is too cautious for this machine")
    return est

"""What an export will hold in memory, estimated before any work, and the refusal when it cannot fit.

An export holds, at its peak (N parameters, the checkpoint's weights in their stored dtype of b bytes each):

    the checkpoint's tensors                      b N        (held for the reference and the native weights)
    one stage at a time, the largest of:
      the fp32 graph's ONNX Runtime session       SESSION_BYTES_PER_PARAM N   (the parity and verify gates)
      fp16: the fp32 graph loaded + converted     (4 + 2) N and the converter's copies: 6.3 N
      int4 / int8: the fp32 graph loaded + out    (4 + 1) N
      the native gate: fp32 session + fp16 copy   SESSION_BYTES_PER_PARAM N + 2 N
      a variant's native weights: made, then loaded for their gate: at most 2 x 2 N (fp16), below the
      variant's own stage, so they add nothing to the peak

The builder streams each weight matrix to the external data file as it is made, so the graph itself adds one
matrix at a time. bench/results/export-realsize.json holds measured peaks beside these estimates.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SESSION_BYTES_PER_PARAM = 4.0  # an fp32 session holds the weights once (ONNX Runtime's CPU MatMul reads them in place)
VARIANT_BYTES_PER_PARAM = {"fp32": 0.0, "fp16": 6.3, "int4": 5.0, "int8": 5.0, "int8-dynamic": 5.0}
#   measured (bench/results/export-realsize.json, the 2.8B stand-in): fp16 6.2, int4 4.75 bytes per parameter
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
    """The export's peak by part (module docstring), bytes; checkpoint_bytes: its weight files' size."""
    n = sum(int(np.prod(s)) for s in spec.checkpoint_shapes().values())
    held = checkpoint_bytes if checkpoint_bytes <= 3 * n else 4 * n  # bf16 files are widened to float32
    native = (SESSION_BYTES_PER_PARAM + 2) * n if dtype == "fp32" else 0
    stage = max(SESSION_BYTES_PER_PARAM * n, VARIANT_BYTES_PER_PARAM[dtype] * n, native)
    return {"parameters": n, "checkpoint_bytes": int(held), "largest_stage_bytes": int(stage),
            "total_bytes": int(held + stage + MARGIN_BYTES)}


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
            f"{gib(est['total_bytes'])} (the checkpoint {gib(est['checkpoint_bytes'])} + its largest stage "
            f"{gib(est['largest_stage_bytes'])} + 1 GiB), expected at most {gib(limit)} ({source}); free memory, "
            f"or raise --max-memory if the estimate is too cautious for this machine")
    return est

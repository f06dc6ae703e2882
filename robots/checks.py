"""What the robot side refuses before it reaches the engine or the robot: inputs the engine cannot take and
chunks no robot should be sent. Shared by the control loop, the DDS node and the chunk queue.

    bad = not_finite_as_engine_input(state)   # indices of entries NaN / inf once cast to float32
    actions = check_chunk(policy(obs), dims=2)  # (H, D) float64, or ValueError saying what is wrong
"""
from __future__ import annotations

import numpy as np

ENGINE_DTYPE = np.float32  # the engines' input dtype: a value is only as finite as it is there
ENGINE_MAX = float(np.finfo(ENGINE_DTYPE).max)


def not_finite_as_engine_input(values) -> np.ndarray:
    """Indices of the entries of the 1-D `values` that are NaN or inf once cast to float32 (1e39 is finite
    in float64 and inf there), as an int array (empty when all are fine)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.flatnonzero(~np.isfinite(np.asarray(values, dtype=np.float64).astype(ENGINE_DTYPE)))


def check_chunk(actions, dims: int | None = None, names=()) -> np.ndarray:
    """`actions` as an (H >= 1, D) float64 array of finite values, D == `dims` when given (`names`: the
    action names, for the message). Raises ValueError saying what was expected and what came."""
    try:
        chunk = np.asarray(actions, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a numeric array ({e})") from None
    if chunk.ndim != 2 or chunk.shape[0] == 0:
        raise ValueError(f"a chunk is (H >= 1 steps, D dims), got shape {chunk.shape}")
    if dims is not None and chunk.shape[1] != dims:
        named = f" [{', '.join(names)}]" if len(names) else ""
        raise ValueError(f"chunk has {chunk.shape[1]} action dims, robot takes {dims}{named}")
    if not np.isfinite(chunk).all():
        raise ValueError("NaN or inf in its chunk; refusing it")
    return chunk

"""An export's engine.json before its graph is written: the manifest of a checkpoint's spec at a context, precision
and input mode (onnx_export.py's export and native.py's in-memory folders both start from it)."""
from __future__ import annotations

import edgespec
from edgespec import contract as C

from .checkpoint import ModelSpec

CACHE_DTYPE = {"fp32": "float32", "fp16": "float16", "int4": "float32", "int8": "float32",  # KV cache I/O dtype
               "int8-dynamic": "float32"}  # per precision (integer precisions: quantize.py)


def build_manifest(spec: ModelSpec, max_context: int, precision: str, input_mode: str,
                   argmax_ids: tuple[int, int] | None = None, flavor: str = "portable",
                   hidden: bool = False) -> C.Manifest:
    inputs, outputs = C.decoder_io(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size,
                                   spec.hidden_size, input_mode, CACHE_DTYPE[precision], flavor, hidden)
    eos = spec.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return C.Manifest(model_file="model.onnx", architecture=spec.model_type, num_layers=spec.num_layers,
                      num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                      hidden_size=spec.hidden_size, vocab_size=spec.vocab_size, max_context=max_context,
                      precision=precision, input_mode=input_mode, inputs=inputs, outputs=outputs,
                      layer_windows=spec.windows if spec.has_window else None, bos_token_id=spec.bos_token_id, eos_token_ids=eos,
                      argmax_ids=list(argmax_ids) if argmax_ids else None, flavor=flavor,
                      edgespec_version=edgespec.__version__)

"""Compatibility: a decoder exported by Hugging Face optimum (`optimum-cli export onnx --task
text-generation-with-past`) loads as an engine, with its manifest derived from the graph and config.json.

Its cache is concat-style (`present` = past + the S new rows, with an int64 `attention_mask`), so each
step copies the cache inside the graph; `CompatDecoder` keeps the runtime's rule (one buffer, committed
lengths, stale rows masked) on top of it. Re-export with `edgespec export` for the lean contract graph.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np

from . import contract as C

_PAST = re.compile(r"^past_key_values\.(\d+)\.key$")


def looks_like_optimum(engine_dir: Path) -> bool:
    d = Path(engine_dir)
    return not (d / C.MANIFEST_FILE).exists() and (d / "model.onnx").is_file()


def derive_manifest(engine_dir: Path, session) -> C.Manifest:
    """Build a manifest from the session's graph I/O and the folder's config.json (if any)."""
    d = Path(engine_dir)
    ins = {i.name: i for i in session.get_inputs()}
    outs = {o.name: o for o in session.get_outputs()}
    layers = sorted(int(m.group(1)) for n in ins if (m := _PAST.match(n)))
    if not layers or C.OPTIMUM_ATTENTION_MASK not in ins or C.LOGITS not in outs:
        raise C.EngineError(f"{d}: no engine.json, and model.onnx is not an optimum text-generation-with-past "
                            f"export (inputs {sorted(ins)}); export it with `edgespec export`")
    if C.POSITION_IDS not in ins:
        raise C.EngineError(f"{d}/model.onnx has no position_ids input; re-export it with a newer optimum "
                            f"(position_ids are needed to decode with a rolled-back cache)")
    kv_shape = ins[C.optimum_past_key(0)].shape  # [B, Hkv, P, D]
    vocab = outs[C.LOGITS].shape[-1]
    if not (isinstance(kv_shape[1], int) and isinstance(kv_shape[3], int) and isinstance(vocab, int)):
        raise C.EngineError(f"{d}/model.onnx: cache heads/head dim/vocab must be static, got {kv_shape}, {vocab}")
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    inputs, outputs = C.optimum_io(len(layers), kv_shape[1], kv_shape[3], vocab)
    tok = d / "tokenizer.json"
    return C.Manifest(model_file="model.onnx", architecture=cfg.get("model_type", "unknown"),
                      num_layers=len(layers), num_heads=int(cfg.get("num_attention_heads", kv_shape[1])),
                      num_kv_heads=kv_shape[1], head_dim=kv_shape[3],
                      hidden_size=int(cfg.get("hidden_size", 0)), vocab_size=vocab,
                      max_context=int(cfg.get("max_position_embeddings", 2048)), kind="optimum",
                      inputs=inputs, outputs=outputs, sliding_window=cfg.get("sliding_window"),
                      bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos,
                      tokenizer_file="tokenizer.json" if tok.is_file() else None,
                      extra={"derived_from": "optimum graph + config.json"})


def compat_call(dec, tokens: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """`Decoder.__call__` for optimum engines: tokens (B, S) -> logits (B, S, V); new rows into the cache
    (the graph returns past + new rows; the new ones are copied into the cache's buffers)."""
    b, s = tokens.shape
    cache, m = dec.cache, dec.m
    cache.reserve(int(cache.lengths.max()) + s)
    p = cache.capacity
    mask = np.zeros((b, p + s), dtype=np.int64)  # committed rows and valid new tokens attend
    mask[:, :p] = np.arange(p)[None, :] < cache.lengths[:, None]
    mask[:, p:] = 1 if valid is None else valid
    feeds = {C.INPUT_IDS: np.ascontiguousarray(tokens, dtype=np.int64), C.OPTIMUM_ATTENTION_MASK: mask,
             C.POSITION_IDS: cache.lengths[:, None] + np.arange(s, dtype=np.int64)[None, :]}
    names = [(C.optimum_past_key(i), C.optimum_past_value(i), C.present_key(i), C.present_value(i))
             for i in range(m.num_layers)]
    for i, (pk, pv, _, _) in enumerate(names):
        feeds[pk], feeds[pv] = cache.host(2 * i), cache.host(2 * i + 1)
    t0 = time.perf_counter()
    out = dec.engine.run(feeds)
    t1 = time.perf_counter()
    for i, (_, _, nk, nv) in enumerate(names):
        for j, name in ((2 * i, nk), (2 * i + 1, nv)):
            host = cache.host(j)
            for row, at in enumerate(cache.lengths.tolist()):
                host[row, :, at:at + s] = out[name][row, :, p:]
            dec.memory.write(cache.out_buffers[j], host)
    cache.wrote(s)
    dec.engine_s += t1 - t0
    if dec.trace is not None:  # this engine's new rows are copied on the host (contract engines write in place)
        dec.trace.append((f"{dec.trace_name}.run S={s}", t0, t1))
        dec.trace.append((f"{dec.trace_name}.kv_write", t1, time.perf_counter()))
    dec.calls += 1
    return out[C.LOGITS]

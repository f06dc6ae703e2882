"""Native CPU weights for an engine folder (edgespec/backends/native.py): `native.npz` plus engine.json's extra["native"].

    python -m edgespec.export.native ENGINE_DIR --checkpoint CHECKPOINT_DIR [--weights float16|int8|int4]

The weights follow the folder's precision (WEIGHTS_FOR), or --weights:

  fp32 folder   float16 matrices, written only when every weight matrix is exactly a float16 (a checkpoint
                stored in float16 or rounded to it), so the native engine computes the fp32 engine's function:
                nothing is rounded. The gate runs it against the folder's ONNX Runtime engine on held-out
                tokens: the same greedy ids, and logits within 1e-3 (they differ in summation order only).
  fp16 folder   float16 matrices, rounded to nearest where the checkpoint's are not float16;
  int8, int4    blocks of 32 values with one float16 scale each (edgespec.backends.native_format.quantize_blocks); int4 keeps
                the lm_head at int8, as the ONNX int4 variant does (quantize.WEIGHT_ONLY).
                These compute a function of their own (the ONNX variant's weights are rounded another way and
                its int8 / int4 products quantize the activations too), so their gate is the precision gate's:
                top-1 agreement with the fp32 logits on the held-out tokens >= 0.99 for a target, or the
                override (allow_lossy) recorded; a draft's agreement is recorded, never refused.

`edgespec export` calls `add_native` for every export (ids or inputs_embeds input), family and precision; engine.json's
extra["native"] records which family options the folder uses (`features`), the npz layout (`format`), the
weights, and the gate.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgespec import contract as C
from edgespec.backends.native_format import (ACTIVATIONS, FEATURES, FORMAT, NATIVE_FILE, PANEL, QB, WEIGHT_KINDS,
                                              head_rows, pack, pack_blocks, quantize_blocks)

from .checkpoint import CheckpointError, ModelSpec, load_checkpoint

LOGIT_TOLERANCE = 1e-3
# a folder's precision -> the native weights written beside its graph (None: none)
WEIGHTS_FOR = {"fp32": "float16", "fp16": "float16", "int8": "int8", "int4": "int4", "int8-dynamic": "int8"}
HEAD_WEIGHTS = {"float16": "float16", "int8": "int8", "int4": "int8"}  # the lm_head's: int4 keeps it at int8


def native_features(spec: ModelSpec) -> list[str]:
    """What this model uses beyond a plain Llama decoder (edgespec.backends.native_format.FEATURES' names, in that order):
    engine.json's extra["native"]["features"]; the loader expects each one's arrays in native.npz."""
    ropes = spec.ropes()
    used = {"qkv_bias": spec.qkv_bias, "o_bias": spec.o_bias, "qk_norm": spec.qk_norm,
            "sandwich_norm": spec.sandwich_norm, "gelu_tanh": spec.hidden_act == "gelu_tanh",
            "embed_scale": spec.embed_scale != 1.0,
            "attn_scale": abs(spec.attn_scale - spec.head_dim ** -0.5) > 1e-12,
            "partial_rotary": spec.rotary_dim != spec.head_dim, "several_rotaries": len(ropes) > 1,
            "layers_without_rotary": any(layer.rope is None for layer in spec.layers), "windows": spec.has_window}
    return [f for f in FEATURES if used[f]]


def _padded_rows(w: np.ndarray, rows: int) -> np.ndarray:
    """(V, E) -> (rows, E): zero rows appended (the lm_head's last panel, native_format.head_rows)."""
    if rows == w.shape[0]:
        return w
    return np.concatenate([w, np.zeros((rows - w.shape[0], w.shape[1]), w.dtype)], 0)


def native_record(spec: ModelSpec) -> dict:
    """The model's part of engine.json's extra["native"] (the loader reads native.npz's shapes from it)."""
    rows = head_rows(spec.vocab_size)
    return {"format": FORMAT, "intermediate_size": spec.intermediate_size, "rotary_dim": spec.rotary_dim,
            "ropes": len(spec.ropes()), "activation": spec.hidden_act, "features": native_features(spec),
            **({"head_rows": rows} if rows != spec.vocab_size else {})}


def native_arrays(spec: ModelSpec, weights: dict[str, np.ndarray], kind: str = "float16",
                  exact: bool = True, consume: bool = False) -> dict[str, np.ndarray]:
    """The native engine's arrays (edgespec.backends.native_format.expected_shapes names them), the matrices as `kind`
    (float16, int8, int4; the lm_head as HEAD_WEIGHTS[kind]); CheckpointError naming the first matrix that is
    not exactly a float16 when `exact` (float16 only: else they are rounded), or what the native step does not
    compute (native_unsupported). Norms, biases and rotary tables stay float32, as the ONNX graphs hold them.
    consume: each tensor is deleted from `weights` once its arrays are built (the embedding, head and final norm
    first, then layer by layer), so a float32 checkpoint and its packed copy are never both whole in memory."""
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"native weights must be one of {sorted(WEIGHT_KINDS)}, got {kind!r}")
    sizes = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
             "num_heads x head_dim": spec.num_heads * spec.head_dim}  # the vocabulary: head_rows pads the lm_head
    odd = {k: v for k, v in sizes.items() if v % PANEL} | ({"head_dim": spec.head_dim} if spec.head_dim % 8 else {})
    if odd:
        raise CheckpointError(f"the native step needs multiples of {PANEL} (head_dim: of 8); got {odd}")
    if kind != "float16":
        odd = {k: v for k, v in sizes.items() if v % QB}
        if odd:
            raise CheckpointError(f"native {kind} weights need inputs in multiples of {QB} (blocks); got {odd}")
    unsupported = native_unsupported(spec)
    if unsupported:
        raise CheckpointError(f"the native step does not compute this {spec.model_type}: it has "
                              f"{', '.join(unsupported)}")

    def f16(name: str, w: np.ndarray) -> np.ndarray:
        h = w.astype(np.float16)
        if exact and not np.array_equal(h.astype(np.float32), w, equal_nan=True):
            bad = int(np.sum(h.astype(np.float32) != w))
            raise CheckpointError(f"{name}: {bad} of {w.size} weights are not exactly float16 values; the native "
                                  f"engine would round them (it keeps weights as float16), so it is not built")
        return h

    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    ropes = [rope.inv_freq_and_scale(spec.rotary_dim) for rope in spec.ropes()]  # as the graphs compute them
    layer_rope = [spec.rope_index(i) for i in range(spec.num_layers)]
    def packed(name: str, w: np.ndarray, as_kind: str = kind) -> np.ndarray:
        if as_kind == "float16":
            return pack(f16(name, w))
        return pack_blocks(*quantize_blocks(w, as_kind), as_kind)

    out = {"embed": f16("model.embed_tokens.weight", weights["model.embed_tokens.weight"]),
           "lm_head": packed("lm_head.weight", _padded_rows(weights["lm_head.weight"], head_rows(spec.vocab_size)),
                             HEAD_WEIGHTS[kind]),
           "norm": f32(weights["model.norm.weight"]),
           "inv_freq": np.array([inv for inv, _ in ropes], np.float32).reshape(len(ropes), spec.rotary_dim // 2),
           "rope_scale": np.array([scale for _, scale in ropes], np.float32),
           "layer_rope": np.array([-1 if j is None else j for j in layer_rope], np.int64),
           "layer_window": np.array([w or 0 for w in spec.windows], np.int64),
           "scalars": np.array([spec.rms_norm_eps, spec.embed_scale, spec.attn_scale], np.float32)}

    def done(*names: str) -> None:  # consume: drop what has been built from (a prefix ending in "." drops a layer)
        if consume:
            for k in [k for k in weights if any(k == n or (n.endswith(".") and k.startswith(n)) for n in names)]:
                del weights[k]

    done("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w = lambda n: weights[p + n]  # noqa: E731
        out[f"layers.{i}.ln1"] = f32(w("input_layernorm.weight"))
        out[f"layers.{i}.ln2"] = f32(weights[spec.mlp_norm(i)])
        out[f"layers.{i}.wqkv"] = packed(p + "self_attn.{q,k,v}_proj.weight", np.concatenate(
            [w(f"self_attn.{n}_proj.weight") for n in "qkv"], 0))
        out[f"layers.{i}.wo"] = packed(p + "self_attn.o_proj.weight", w("self_attn.o_proj.weight"))
        out[f"layers.{i}.wgu"] = packed(p + "mlp.{gate,up}_proj.weight", np.concatenate(
            [w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], 0))
        out[f"layers.{i}.wd"] = packed(p + "mlp.down_proj.weight", w("mlp.down_proj.weight"))
        if spec.qkv_bias:
            out[f"layers.{i}.bqkv"] = f32(np.concatenate([w(f"self_attn.{n}_proj.bias") for n in "qkv"], 0))
        if spec.o_bias:
            out[f"layers.{i}.bo"] = f32(w("self_attn.o_proj.bias"))
        if spec.qk_norm:
            out[f"layers.{i}.qn"], out[f"layers.{i}.kn"] = f32(w("self_attn.q_norm.weight")), f32(w("self_attn.k_norm.weight"))
        if spec.sandwich_norm:
            out[f"layers.{i}.post_attn"] = f32(w("post_attention_layernorm.weight"))
            out[f"layers.{i}.post_mlp"] = f32(w("post_feedforward_layernorm.weight"))
        done(p)
    return out


def in_memory_engine_folder(spec: ModelSpec, weights: dict[str, np.ndarray], max_context: int,
                            kind: str = "float16"):
    """A checkpoint's native weights as an engine folder that exists only in memory (no ONNX graph, nothing
    written): what the device check decodes on cuda-native and cpu-native when it makes its models where it runs
    (NativeEngine(None, folder=...), CudaNativeEngine(None, folder=...)). float16 weights must be exactly
    float16 values (CheckpointError names the first that is not)."""
    from edgespec.backends.native_folder import in_memory

    from .manifest import build_manifest
    manifest = build_manifest(spec, max_context, "fp32", "ids")
    arrays = native_arrays(spec, weights, kind, exact=kind == "float16")
    info = {**native_record(spec), "weights": kind, "head_weights": HEAD_WEIGHTS[kind], "arithmetic": "float32"}
    manifest.extra["native"] = info
    return in_memory(manifest, info, arrays)


def native_unsupported(spec: ModelSpec) -> list[str]:
    """What this checkpoint has that native_step.c does not compute (empty: the step runs it). Every family
    option of checkpoint.ModelSpec is computed now; what remains is a size limit of the step."""
    out = []
    for flag, what in ((spec.head_dim > 512, f"head_dim {spec.head_dim} (the step holds a query head in 512 floats)"),
                       (spec.hidden_act not in ACTIVATIONS, f"activation {spec.hidden_act}")):
        if flag:
            out.append(what)
    return out


def native_gate(engine_dir: Path, rows: np.ndarray) -> dict:
    """The native engine against the folder's ONNX Runtime engine (CPU) on `rows` (tokens): one prefill of
    half, then single steps, then one verify-sized call. -> max logit difference, greedy id agreement."""
    from edgespec.backends.ort import OrtEngine
    from edgespec.backends.native import NativeEngine

    ref, nat = OrtEngine(engine_dir).decoder(), NativeEngine(engine_dir).decoder()
    rows = np.asarray(rows, np.int64).reshape(1, -1)
    half = rows.shape[1] // 2
    diff, agree, total = 0.0, 0, 0
    calls = [rows[:, :half]] + [rows[:, i:i + 1] for i in range(half, rows.shape[1] - 6)] + [rows[:, -6:]]
    for chunk in calls:
        a, b = np.array(ref(chunk)), np.array(nat(chunk))
        ref.cache.commit(chunk.shape[1])
        nat.cache.commit(chunk.shape[1])
        diff = max(diff, float(np.abs(a - b).max()))
        agree += int((ref.last_ids() == nat.last_ids()).sum())
        total += chunk.size
    return {"max_logit_diff": diff, "ids_agree": agree, "ids": total, "tolerance": LOGIT_TOLERANCE,
            "passed": bool(diff <= LOGIT_TOLERANCE and agree == total)}


def native_logits(engine_dir: Path, token_rows: list) -> list[np.ndarray]:
    """Each row (token ids (S,), or an inputs_embeds engine's rows (S, E)) through the folder's native engine from
    an empty cache: its logits (S, V)."""
    from edgespec.backends.native import NativeEngine

    dec = NativeEngine(engine_dir).decoder()
    out = []
    for row in token_rows:  # a row: ids (S,) or rows (S, E), or (that, start) (validate.teacher_forced's rows)
        x = np.asarray(row[0] if isinstance(row, tuple) else row)
        if x.ndim == 2:  # embeddings (the policy calibration's rows)
            out.append(np.array(dec(None, embeds=x[None].astype(np.float32)))[0])
        else:
            out.append(np.array(dec(x.astype(np.int64).reshape(1, -1)))[0])
        dec.cache.rewind_to(0)
    return out


def native_agreement_gate(engine_dir: Path, token_rows: list, base: list[np.ndarray], kind: str, role: str,
                          allow_lossy: bool) -> dict:
    """The precision gate (validate.precision_gate's rule) on the native engine's teacher-forced logits
    against `base`, the fp32 logits of the same rows: the record, with "passed" False for a target below the
    threshold unless allow_lossy (then "overridden")."""
    from .validate import GateError, compare_logits, precision_gate

    m = C.Manifest.read(engine_dir)
    cap = m.max_context  # the native decoder's cache holds no more; a longer row is judged on its first rows
    cut = lambda r: (np.asarray(r[0])[:cap], r[1]) if isinstance(r, tuple) else np.asarray(r)[:cap]  # noqa: E731
    token_rows, base = [cut(r) for r in token_rows], [np.asarray(b)[:cap] for b in base]
    agree = compare_logits(base, native_logits(engine_dir, token_rows), token_rows, *m.argmax_range)
    try:
        gate = precision_gate(agree, f"native {kind}", role, allow_lossy)
    except GateError as e:
        return {**agree, "passed": False, "error": str(e)}
    return {**agree, **gate, "passed": gate["passed"] or gate["overridden"] or not gate["enforced"]}


def add_native(engine_dir: str | Path, spec: ModelSpec, weights: dict[str, np.ndarray], rows: np.ndarray,
               kind: str | None = None, base: tuple[list, list] | None = None, role: str = "target",
               allow_lossy: bool = False, consume: bool = False) -> dict:
    """Write native.npz into engine_dir and record it (or why not) in its engine.json; -> the record.
    consume: `weights` is emptied as native.npz is built (native_arrays), so that the gate, which loads the
    engine, runs without the checkpoint's copy in memory (an export passes the weights it loaded for this).
    kind: the matrices' weights (None: WEIGHTS_FOR the folder's precision). An exact float16 copy of an fp32
    folder is gated against the folder's ONNX Runtime engine on `rows`; any other against fp32 logits:
    base = (token rows, their fp32 logits), the precision gate's rule (module docstring)."""
    engine_dir = Path(engine_dir)
    m = C.Manifest.read(engine_dir)
    kind = kind or WEIGHTS_FOR.get(m.precision)
    exact = kind == "float16" and m.precision == "fp32"
    try:
        if kind is None:
            raise CheckpointError(f"native weights go with engines of precision {sorted(WEIGHTS_FOR)}; "
                                  f"this one is {m.precision}")
        if not exact and base is None:
            raise CheckpointError(f"native {kind} weights need the fp32 logits of held-out rows for their gate "
                                  f"(`base`); none were given")
        arrays = native_arrays(spec, weights, kind, exact=exact, consume=consume)
    except CheckpointError as e:
        info = {"unavailable": str(e)}
    else:
        fd, tmp = tempfile.mkstemp(suffix=".npz", dir=engine_dir)
        os.close(fd)
        np.savez(tmp, **arrays)
        os.replace(tmp, engine_dir / NATIVE_FILE)
        info = {"file": NATIVE_FILE, "sha256": C.file_sha256(engine_dir / NATIVE_FILE), **native_record(spec),
                "weights": kind, "head_weights": HEAD_WEIGHTS[kind], "arithmetic": "float32",
                # what a token reads: every array but the embedding table, of which it reads one row
                "weight_bytes_per_token": int(sum(a.nbytes for k, a in arrays.items() if k != "embed")
                                              + arrays["embed"].nbytes // arrays["embed"].shape[0])}
        del arrays
        m.extra["native"] = info
        m.write(engine_dir)
        try:
            if exact:
                info["gate"] = native_gate(engine_dir, rows)
            else:
                info["gate"] = native_agreement_gate(engine_dir, base[0], base[1], kind, role, allow_lossy)
        except C.EngineError as e:  # no C compiler here: the folder still works on every other provider
            info["gate"] = {"passed": False, "error": str(e)}
        if not info["gate"]["passed"]:
            (engine_dir / NATIVE_FILE).unlink()
            against = "ONNX Runtime" if exact else "fp32 (the precision gate)"
            info = {"unavailable": f"the native {kind} engine failed its gate against {against}: {info['gate']}"}
    m.extra["native"] = info
    m.write(engine_dir)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgespec.export.native", description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir", type=Path)
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint the folder was exported from")
    p.add_argument("--weights", choices=sorted(WEIGHT_KINDS), default=None,
                   help="the matrices' storage (default: the folder's precision: fp32/fp16 float16, int8 int8, "
                        "int4 int4)")
    p.add_argument("--role", choices=("target", "draft"), default="target",
                   help="a draft's precision gate is recorded, never refused")
    p.add_argument("--allow-lossy", action="store_true", help="keep a target below the precision gate (recorded)")
    a = p.parse_args(argv)
    from .checkpoint import hash_files, weight_files
    from .validate import calibration_rows
    try:
        m = C.Manifest.read(a.engine_dir)
        spec, weights = load_checkpoint(a.checkpoint)
        if m.source_sha256 and hash_files(weight_files(a.checkpoint) + [a.checkpoint / "config.json"]) != m.source_sha256:
            raise CheckpointError(f"{a.engine_dir} was exported from another checkpoint than {a.checkpoint} "
                                  f"(engine.json's source_sha256 differs); give the checkpoint it was exported from")
    except (C.EngineError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, _ = calibration_rows(a.checkpoint, spec.vocab_size, 64, seq=64)
    kind = a.weights or WEIGHTS_FOR.get(m.precision)
    base = None
    if not (kind == "float16" and m.precision == "fp32"):  # the precision gate: fp32 logits from the reference
        import torch

        from .reference import ReferenceDecoder
        held, _ = calibration_rows(a.checkpoint, spec.vocab_size, 1024)
        ref = ReferenceDecoder(spec, weights)
        base = (held, [ref(torch.as_tensor(np.asarray(r, np.int64))[None]).numpy()[0] for r in held])
    info = add_native(a.engine_dir, spec, weights, np.asarray(rows[0][:64]), kind, base, a.role, a.allow_lossy)
    if "unavailable" in info:
        print(f"{a.engine_dir}: no native weights: {info['unavailable']}", file=sys.stderr)
        return 1
    print(f"{a.engine_dir}: {NATIVE_FILE} written ({info['weights']} weights); gate: {info['gate']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

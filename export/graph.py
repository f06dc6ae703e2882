"""The contract decoder graph of either flavour, emitted from the checkpoint weights with onnx.helper, its
weights streamed to an external data file as each is made (edgespec/contract.py names every graph input and
output; its docstring says what each flavour's inputs mean).

    edgespec export models/demo-target --out engines/demo-target [--flavor ort|portable]

One builder, two op sets:
  portable  standard ONNX ops only (CPU, CUDA, TensorRT): position_ids and attention_bias say where the new rows
            go and what each query sees; norms, attention and activations as standard ops.
  ort       ONNX Runtime contrib ops: GroupQueryAttention with the cache updated in place (its seqlens inputs),
            SkipSimplifiedLayerNormalization, FastGelu; per-op fallback to the standard ops where this ONNX
            Runtime cannot run a shape (engine.json `fusion` says which and why).

One layer, with x the residual stream (B, S, E) (the norm before layer i's attention also adds layer i-1's MLP
output to x, the norm before its MLP adds the attention output: one SkipSimplifiedLayerNormalization in ort):

    mlp(i-1) ─┐
    x ────────┴─ skip + norm(ln1) ─┬─ x (sum)
                                   └─ h ─ MatMul(Wqkv) (+ b) ─ qkv (B, S, (H + 2 Hkv) D) ──────────────┐
    past.i.key / past.i.value (B, Hkv, P, D) and the call's rows (positions, visibility) ──────────────┴─┐
        attention: q/k norms, the layer's rotary, the new K/V rows written into the bound buffer in place,  │
        q·Kᵀ·scale, the layer's visible rows selected (window included), softmax, ·V ─▶ o (B, S, H D) ◀─────┘
    o ─ MatMul(Wo) (+ bo) (─ norm: sandwich) ─┐
    x ────────────────────────────────────────┴─ skip + norm(ln2) ─┬─ x (sum)
                                                                   └─ h ─ MatMul(Wgu) ─ Split ─ act(gate) · up
                                                                      ─ MatMul(Wd) (─ norm: sandwich) ─ mlp(i)

    mlp(last) + x ─ skip + norm(final) ─ MatMul(lm_head) ─ logits ─ ArgMax over argmax_ids ─ next_ids
                                                                └─ ReduceSum finite? (else NONFINITE_ID)

Stale rows never count, whatever they hold: visibility is a select (Where) on the scores, never only an
additive bias. Standard attention, per call (once, before layer 0):

    pos (B, S): position_ids (portable), or L + arange(S) with L = seqlens_k + 1 - query_seqlens (ort)
    ok[b, s, r]: attention_bias > MASKED/2 (portable), or r <= pos[b, s] (ort); a windowed layer also needs
                 pos[b, s] - r < window (so one attention_bias serves windowed and global layers alike)

Weights: each initializer of at least EXTERNAL_MIN bytes is written to `<model>.data` beside the graph as it is
made, so the graph proto holds only its structure (no 2 GB protobuf limit) and the exporter holds one weight
matrix at a time beyond the checkpoint's own tensors.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec import contract as C

from .checkpoint import ModelSpec
from .external import DataWriter

OPSET = 17
MS_DOMAIN = "com.microsoft"
FUSED = "fused"
ROPE_ROWS_MIN = 1024  # rotary table rows at least: the precision gate teacher-forces rows longer than max_context


class _Graph:
    """Nodes and initializers in the order they are added; every op returns its output names. With `data`
    (a path), initializers of EXTERNAL_MIN bytes or more are appended to that file as they are made."""

    def __init__(self, data: Path | None = None):
        self.nodes, self.inits, self._n = [], [], 0
        self._writer = DataWriter(Path(data)) if data else None

    def const(self, name: str, arr) -> str:
        from onnx import numpy_helper
        arr = np.asarray(arr)
        self.inits.append(self._writer.tensor(name, arr) if self._writer else numpy_helper.from_array(arr, name))
        return name

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def op(self, op_type: str, inputs: list, outputs=1, domain: str = "", **attrs):
        from onnx import helper
        self._n += 1
        names = outputs if isinstance(outputs, list) else [f"{op_type.lower()}_{self._n}_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=f"{op_type}_{self._n}", domain=domain,
                                           **attrs))
        return names[0] if len(names) == 1 else names

    def i64(self, v) -> str:
        return self.const(f"c{len(self.inits)}", np.array(v, np.int64))

    def f32(self, v) -> str:
        return self.const(f"c{len(self.inits)}", np.array(v, np.float32))


def gqa_problem(num_heads: int, kv_heads: int, head_dim: int, sliding_window: int | None = None,
                dtype=np.float32, rotary_dim: int | None = None) -> str | None:
    """None when this ONNX Runtime's CPU GroupQueryAttention runs the shape (one small call with a cache and
    two new tokens), else its error: the kernel checks some shapes only when it runs (ORT 1.32's CPU kernel
    needs head_size % 16 == 0, and partial rotary dims / 2 a multiple of 8)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    t = TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT
    hidden = (num_heads + 2 * kv_heads) * head_dim
    half = (rotary_dim or head_dim) // 2
    vi = helper.make_tensor_value_info
    ins = [vi("qkv", t, [1, 2, hidden]), vi("k", t, [1, kv_heads, 4, head_dim]), vi("v", t, [1, kv_heads, 4, head_dim]),
           vi("sk", TensorProto.INT32, [1]), vi("tot", TensorProto.INT32, []), vi("cos", t, [4, half]),
           vi("sin", t, [4, half]), vi("qs", TensorProto.INT32, [1])]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "k", "v", "sk", "tot", "cos", "sin"] + [""] * 7
                            + ["qs"], ["o", "pk", "pv"], domain=MS_DOMAIN, num_heads=num_heads, kv_num_heads=kv_heads,
                            do_rotary=1, local_window_size=sliding_window or -1)
    outs = [vi("o", t, None), vi("pk", t, None), vi("pv", t, None)]
    model = helper.make_model(helper.make_graph([node], "probe", ins, outs),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    feeds = {"qkv": np.zeros((1, 2, hidden), dtype), "k": np.zeros((1, kv_heads, 4, head_dim), dtype),
             "v": np.zeros((1, kv_heads, 4, head_dim), dtype), "sk": np.array([2], np.int32),
             "tot": np.array(3, np.int32), "cos": np.ones((4, half), dtype),
             "sin": np.zeros((4, half), dtype), "qs": np.array([2], np.int32)}
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception as e:  # ORT's pybind errors share no base class
        msg = str(e).split("Status Message:")[-1].strip()
        rot = f" rotary dims {rotary_dim}" if rotary_dim and rotary_dim != head_dim else ""
        return f"ONNX Runtime {ort.__version__} CPU GroupQueryAttention refuses H={num_heads} Hkv={kv_heads} " \
               f"D={head_dim}{rot}: {msg}"
    return None


def plan_fusion(spec: ModelSpec) -> dict:
    """engine.json `fusion` of an ort-flavour graph for this checkpoint on this ONNX Runtime: FUSABLE_OPS ->
    "fused" or why not."""
    for window in sorted({w or 0 for w in spec.windows}):
        problem = gqa_problem(spec.num_heads, spec.num_kv_heads, spec.head_dim, window or None,
                              rotary_dim=spec.rotary_dim)
        if problem:
            return {"attention": "standard ops: " + problem, "rotary": "standard ops: attention is not fused",
                    "norm": FUSED}
    return {"attention": FUSED, "rotary": FUSED, "norm": FUSED}


def rope_tables(spec: ModelSpec, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per distinct rotary (spec.ropes()): cos, sin (rows, R/2) float32 of positions 0..rows-1 over the
    rotary dims R, with the rope's attention scaling folded in."""
    out = []
    for rope in spec.ropes():
        inv, scale = rope.inv_freq_and_scale(spec.rotary_dim)
        f = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :].astype(np.float32).astype(np.float64)
        f = f.astype(np.float32)  # the reference multiplies in fp32
        out.append(((np.cos(f) * scale).astype(np.float32), (np.sin(f) * scale).astype(np.float32)))
    return out


def build_graph(spec: ModelSpec, weights: dict[str, np.ndarray], manifest: C.Manifest, data: Path | None = None,
                progress=None):
    """-> onnx.ModelProto of manifest.flavor for `manifest` (its inputs, outputs, argmax range, max_context and,
    for ort, `fusion` from plan_fusion). With `data`, weights go to that file as they are made (the model must
    then be saved beside it). progress: called once per layer, or None."""
    from onnx import TensorProto, helper

    m, s = manifest, spec
    ort = m.flavor == "ort"
    g = _Graph(data)
    hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
    fused_attention = ort and m.fusion.get("attention") == FUSED
    w = lambda name: np.asarray(weights[name], dtype=np.float32)  # noqa: E731  (one tensor widened at a time)
    eps = float(s.rms_norm_eps)
    ops = _Ops(g, eps, ort)

    # embeddings (B, S, E)
    if m.input_mode == "ids":
        x = g.op("Gather", [g.const("embed_tokens", w("model.embed_tokens.weight")), C.INPUT_IDS], axis=0)
        if s.embed_scale != 1.0:
            x = g.op("Mul", [x, g.const("embed_scale", np.array(s.embed_scale, np.float32))])
    else:
        x = C.INPUTS_EMBEDS
    first = C.INPUT_IDS if m.input_mode == "ids" else C.INPUTS_EMBEDS
    tables = rope_tables(s, max(m.max_context, ROPE_ROWS_MIN))
    if fused_attention:
        caches = [(g.const(f"cos_cache{j}", c), g.const(f"sin_cache{j}", sn)) for j, (c, sn) in enumerate(tables)]
    else:
        at = _StandardAttention(g, s, tables, first, ort)

    h = ops.norm(x, "l0.ln1", w("model.layers.0.input_layernorm.weight"))
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        layer = s.layers[i]
        wqkv = np.concatenate([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)  # ((H + 2 Hkv) D, E)
        qkv = g.op("MatMul", [h, g.const(f"l{i}.wqkv", wqkv.T.copy())])  # (B, S, (H + 2 Hkv) D)
        del wqkv
        if s.qkv_bias:
            bias = np.concatenate([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
            qkv = g.op("Add", [qkv, g.const(f"l{i}.bqkv", bias)])
        past = [C.past_key(i), C.past_value(i)]
        present = [C.present_key(i), C.present_value(i)]
        if fused_attention:
            if s.qk_norm:  # each head's q and k normed over D before GroupQueryAttention's rotary
                q, k, v = g.op("Split", [qkv, g.i64([hq * d, hk * d, hk * d])], 3, axis=-1)
                qkv_in = [ops.head_norm(q, hq, d, f"l{i}.qn", w(p + "self_attn.q_norm.weight")),
                          ops.head_norm(k, hk, d, f"l{i}.kn", w(p + "self_attn.k_norm.weight")), v]
            else:
                qkv_in = [qkv, "", ""]
            j = s.rope_index(i)
            rot = list(caches[j]) if j is not None else ["", ""]
            o = g.op("GroupQueryAttention", [*qkv_in, *past, C.SEQLENS_K, C.TOTAL_SEQUENCE_LENGTH, *rot]
                     + [""] * 7 + [C.QUERY_SEQLENS], [f"l{i}.attn"] + present, domain=MS_DOMAIN, num_heads=hq,
                     kv_num_heads=hk, do_rotary=int(j is not None), scale=float(s.attn_scale),
                     local_window_size=layer.window or -1)[0]  # (B, S, H D)
        else:
            o = at.layer(i, qkv, past, present, weights)
        o = g.op("MatMul", [o, g.const(f"l{i}.wo", w(p + "self_attn.o_proj.weight").T.copy())])  # (B, S, E)
        if s.o_bias:
            o = g.op("Add", [o, g.const(f"l{i}.bo", w(p + "self_attn.o_proj.bias"))])
        if s.sandwich_norm:
            o = ops.norm(o, f"l{i}.post_attn", w(p + "post_attention_layernorm.weight"))
        h, x = ops.skip_norm(o, x, f"l{i}.ln2", w(s.mlp_norm(i)))
        wgu = np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0)  # (2 I, E)
        gu = g.op("MatMul", [h, g.const(f"l{i}.wgu", wgu.T.copy())])
        del wgu
        gate, up = g.op("Split", [gu, g.const(f"l{i}.split", np.array([s.intermediate_size] * 2, np.int64))], 2,
                        axis=-1)
        mlp = g.op("MatMul", [g.op("Mul", [ops.act(gate, s.hidden_act), up]),
                              g.const(f"l{i}.wd", w(p + "mlp.down_proj.weight").T.copy())])
        if s.sandwich_norm:
            mlp = ops.norm(mlp, f"l{i}.post_mlp", w(p + "post_feedforward_layernorm.weight"))
        last = i == s.num_layers - 1
        gamma = w("model.norm.weight") if last else w(f"model.layers.{i + 1}.input_layernorm.weight")
        h, x = ops.skip_norm(mlp, x, f"l{i + 1}.ln1", gamma)
        if progress:
            progress()
    g.op("MatMul", [h, g.const("lm_head", w("lm_head.weight").T.copy())], [C.LOGITS])  # (B, S, V)
    if m.has_hidden:
        g.op("Identity", [h], [C.HIDDEN])  # (B, S, E): the LM head's input

    # next_ids: argmax over [lo, hi), NONFINITE_ID where a row's logits are not all finite
    lo, hi = m.argmax_range
    scores = C.LOGITS if (lo, hi) == (0, s.vocab_size) else g.op(
        "Slice", [C.LOGITS, g.const("argmax_lo", np.array([lo], np.int64)),
                  g.const("argmax_hi", np.array([hi], np.int64)), g.const("last_axis", np.array([-1], np.int64))])
    ids = g.op("ArgMax", [scores], axis=-1, keepdims=0)  # (B, S)
    if lo:
        ids = g.op("Add", [ids, g.const("argmax_offset", np.array(lo, np.int64))])
    total = g.op("ReduceSum", [C.LOGITS, g.const("vocab_axis", np.array([-1], np.int64))], keepdims=0)  # (B, S)
    finite = g.op("Equal", [g.op("Sub", [total, total]), g.const("zero", np.array(0.0, np.float32))])  # inf-inf: NaN
    g.op("Where", [finite, ids, g.const("nonfinite_id", np.array(C.NONFINITE_ID, np.int64))], [C.NEXT_IDS])
    g.close()

    types = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "float32": TensorProto.FLOAT,
             "float16": TensorProto.FLOAT16}
    vi = lambda t: helper.make_tensor_value_info(t.name, types[t.dtype], t.shape)  # noqa: E731
    graph = helper.make_graph(g.nodes, f"edgespec_decoder_{m.flavor}", [vi(t) for t in m.inputs],
                              [vi(t) for t in m.outputs], g.inits)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if ort else [])
    return helper.make_model(graph, opset_imports=opsets, producer_name="edgespec")


class _Ops:
    """Norms and activations: ONNX Runtime's fused ops (ort) or standard ops (portable)."""

    def __init__(self, g: _Graph, eps: float, ort: bool):
        self.g, self.eps, self.ort = g, eps, ort

    def norm(self, x: str, name: str, gamma: np.ndarray) -> str:
        """RMSNorm over the last axis: gamma * x / sqrt(mean(x²) + eps)."""
        g = self.g
        if self.ort:
            return g.op("SimplifiedLayerNormalization", [x, g.const(name, gamma)], epsilon=self.eps, axis=-1)
        ms = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.f32(self.eps)])])])
        return g.op("Mul", [g.op("Mul", [x, inv]), g.const(name, gamma)])

    def skip_norm(self, a: str, x: str, name: str, gamma: np.ndarray) -> tuple[str, str]:
        """(norm(x + a), x + a)."""
        g = self.g
        if self.ort:
            h, _, _, total = g.op("SkipSimplifiedLayerNormalization", [a, x, g.const(name, gamma)], 4,
                                  domain=MS_DOMAIN, epsilon=self.eps)
            return h, total
        total = g.op("Add", [x, a])
        return self.norm(total, name, gamma), total

    def head_norm(self, t: str, heads: int, d: int, name: str, gamma: np.ndarray) -> str:
        """(B, S, heads D) normed over each head's D dims."""
        g = self.g
        split = g.op("Reshape", [t, g.i64([0, 0, heads, d])])
        return g.op("Reshape", [self.norm(split, name, gamma), g.i64([0, 0, heads * d])])

    def act(self, x: str, kind: str) -> str:
        g = self.g
        if kind == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])])
        # tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        if self.ort:
            return g.op("FastGelu", [x], domain=MS_DOMAIN)
        cube = g.op("Mul", [g.op("Mul", [x, x]), x])
        inner = g.op("Mul", [g.op("Add", [x, g.op("Mul", [cube, g.f32(0.044715)])]), g.f32(np.sqrt(2 / np.pi))])
        return g.op("Mul", [g.op("Mul", [x, g.f32(0.5)]), g.op("Add", [g.op("Tanh", [inner]), g.f32(1.0)])])


class _StandardAttention:
    """Attention in standard ops: the portable flavour's, and the ort flavour's fallback where
    GroupQueryAttention cannot run the shape. The per-call tensors (positions, scatter indices, rotary rows, one
    visibility mask per distinct window) are built once, before layer 0 (module docstring)."""

    def __init__(self, g: _Graph, spec: ModelSpec, tables: list, first: str, ort: bool):
        self.g, self.s, self.first, self.ort = g, spec, first, ort
        self._tables = tables

    def setup(self, past_key0: str) -> None:
        g, s = self.g, self.s
        i64 = g.i64
        shape = g.op("Shape", [self.first])
        b = g.op("Gather", [shape, i64(0)], axis=0)
        n = g.op("Gather", [shape, i64(1)], axis=0)
        rows = g.op("Gather", [g.op("Shape", [past_key0]), i64(2)], axis=0)
        keys = g.op("Range", [i64(0), rows, i64(1)])  # (P,): row r holds position r
        if self.ort:
            start = g.op("Sub", [g.op("Add", [C.SEQLENS_K, g.const("sa.one32", np.array(1, np.int32))]),
                                 C.QUERY_SEQLENS])
            start = g.op("Cast", [start], to=7)  # (B,) int64: the committed rows L
            pos = g.op("Add", [g.op("Unsqueeze", [start, i64([1])]), g.op("Range", [i64(0), n, i64(1)])])  # (B, S)
            ok = g.op("LessOrEqual", [keys, g.op("Unsqueeze", [pos, i64([-1])])])  # (B, S, P)
            base = g.op("Unsqueeze", [ok, i64([1, 2])])  # (B, 1, 1, S, P)
        else:
            pos = C.POSITION_IDS
            ok = g.op("Greater", [C.ATTENTION_BIAS, g.f32(C.MASKED / 2)])  # (B, 1, S, P)
            base = g.op("Unsqueeze", [ok, i64([1])])  # (B, 1, 1, S, P)
        self.ok = {None: base}  # window -> visibility (B, 1, 1, S, P)
        for win in sorted({w for w in s.windows if w is not None}):
            near = g.op("Less", [g.op("Sub", [g.op("Unsqueeze", [pos, i64([-1])]), keys]), i64(win)])  # (B, S, P)
            self.ok[win] = g.op("And", [base, g.op("Unsqueeze", [near, i64([1, 2])])])
        full = lambda t: np.concatenate([t, t], -1)  # noqa: E731  (rows, R): rotate-half layout
        self.rot = [(g.op("Unsqueeze", [g.op("Gather", [g.const(f"sa.cos{j}", full(c)), pos], axis=0), i64([1])]),
                     g.op("Unsqueeze", [g.op("Gather", [g.const(f"sa.sin{j}", full(sn)), pos], axis=0), i64([1])]))
                    for j, (c, sn) in enumerate(self._tables)]  # (B, 1, S, R) each
        hk = s.num_kv_heads
        target = g.op("Concat", [g.op("Unsqueeze", [b, i64([0])]), i64([hk]), g.op("Unsqueeze", [n, i64([0])]),
                                 i64([1])], axis=0)  # (4,) = (B, Hkv, S, 1)
        bi = g.op("Expand", [g.op("Reshape", [g.op("Range", [i64(0), b, i64(1)]), i64([-1, 1, 1, 1])]), target])
        hi = g.op("Expand", [g.const("sa.heads", np.arange(hk, dtype=np.int64).reshape(1, hk, 1, 1)), target])
        ri = g.op("Expand", [g.op("Reshape", [pos, i64([0, 1, -1, 1])]), target])
        self.idx = g.op("Concat", [bi, hi, ri], axis=-1)  # (B, Hkv, S, 3) = (b, h, row) of each new row

    def _rope(self, x: str, j: int) -> str:
        """x (B, H, S, D): its first R dims rotate (rotate-half) with rotary j's rows, the rest pass."""
        g = self.g
        i64 = g.i64
        r, d = self.s.rotary_dim, self.s.head_dim
        half = r // 2
        cos, sin = self.rot[j]
        xr = x if r == d else g.op("Slice", [x, i64([0]), i64([r]), i64([-1])])
        x1 = g.op("Slice", [xr, i64([0]), i64([half]), i64([-1])])
        x2 = g.op("Slice", [xr, i64([half]), i64([r]), i64([-1])])
        rot = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        out = g.op("Add", [g.op("Mul", [xr, cos]), g.op("Mul", [rot, sin])])
        if r == d:
            return out
        return g.op("Concat", [out, g.op("Slice", [x, i64([r]), i64([d]), i64([-1])])], axis=-1)

    def layer(self, i: int, qkv: str, past: list, present: list, weights: dict) -> str:
        """qkv (B, S, (H + 2 Hkv) D) -> o (B, S, H D); present = past with the S new rows scattered in."""
        g, s = self.g, self.s
        i64 = g.i64
        hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
        if i == 0:
            self.setup(past[0])
        q, k, v = g.op("Split", [qkv, i64([hq * d, hk * d, hk * d])], 3, axis=-1)
        heads = lambda t, n: g.op("Transpose", [g.op("Reshape", [t, i64([0, 0, n, d])])], perm=[0, 2, 1, 3])  # noqa
        q, k, v = heads(q, hq), heads(k, hk), heads(v, hk)  # (B, H|Hkv, S, D)
        if s.qk_norm:
            p = f"model.layers.{i}.self_attn."
            ops = _Ops(g, float(s.rms_norm_eps), self.ort)
            q = ops.norm(q, f"sa.qn{i}", np.asarray(weights[p + "q_norm.weight"], np.float32))
            k = ops.norm(k, f"sa.kn{i}", np.asarray(weights[p + "k_norm.weight"], np.float32))
        j = s.rope_index(i)
        if j is not None:
            q, k = self._rope(q, j), self._rope(k, j)
        kc = g.op("ScatterND", [past[0], self.idx, k], [present[0]])  # (B, Hkv, P, D), in place
        vc = g.op("ScatterND", [past[1], self.idx, v], [present[1]])
        q = g.op("Reshape", [g.op("Mul", [q, g.f32(s.attn_scale)]), i64([0, hk, hq // hk, -1, d])])  # (B, Hkv, g, S, D)
        kt = g.op("Unsqueeze", [g.op("Transpose", [kc], perm=[0, 1, 3, 2]), i64([2])])  # (B, Hkv, 1, D, P)
        sc = g.op("MatMul", [q, kt])  # (B, Hkv, g, S, P)
        sc = g.op("Where", [self.ok[s.layers[i].window], sc, g.f32(C.MASKED)])  # what a stale row holds never counts
        pr = g.op("Softmax", [sc], axis=-1)
        o = g.op("MatMul", [pr, g.op("Unsqueeze", [vc, i64([2])])])  # (B, Hkv, g, S, D); masked rows weigh 0
        o = g.op("Transpose", [g.op("Reshape", [o, i64([0, hq, -1, d])])], perm=[0, 2, 1, 3])  # (B, S, H, D)
        return g.op("Reshape", [o, i64([0, 0, hq * d])])

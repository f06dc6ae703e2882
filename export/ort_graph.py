"""The `ort` flavour: a contract decoder emitted directly from the checkpoint weights with onnx.helper, around
ONNX Runtime contrib ops (edgespec/contract.py names every graph input and output; its docstring says what the
ort flavour's small inputs mean).

    edgespec export models/demo-target --out engines/demo-target --flavor ort

One layer, with x the residual stream (B, S, E); the norm before layer i's attention also adds layer i-1's MLP
output to x, the norm before its MLP adds the attention output (SkipSimplifiedLayerNormalization: one node):

    mlp(i-1) ─┐
    x ────────┴─ SkipSimplifiedLayerNorm(ln1) ─┬─ x (sum)
                                               └─ h ─ MatMul(Wqkv) ─ qkv (B, S, (H + 2 Hkv) D) ─────────────┐
    past.i.key / past.i.value (B, Hkv, P, D), seqlens_k, query_seqlens, total_sequence_length, cos, sin ───┴─┐
        GroupQueryAttention(do_rotary, in place: present.i.* is past.i.*'s own buffer) ─▶ o (B, S, H D) ◀─────┘
    o ─ MatMul(Wo) ─┐
    x ──────────────┴─ SkipSimplifiedLayerNorm(ln2) ─┬─ x (sum)
                                                     └─ h ─ MatMul(Wgu) ─ Split ─ silu(gate) · up ─ MatMul(Wd) ─ mlp(i)

    mlp(last) + x ─ SkipSimplifiedLayerNorm(norm) ─ MatMul(lm_head) ─ logits ─ ArgMax over argmax_ids ─ next_ids
                                                                            └─ ReduceSum finite? (else NONFINITE_ID)

Family options (checkpoint.ModelSpec): q/k norms (q, k, v go to GroupQueryAttention separately, each of q and k
normed per head first); attention and output biases (Add); a window, a rotary table (or none: do_rotary 0), the
rotary dims and the attention scale per layer as GroupQueryAttention attributes and inputs; sandwich norms
(SimplifiedLayerNormalization on the attention and MLP outputs before their skip); tanh GELU (FastGelu); the
embedding scale (Mul after the Gather).

Per-op fallback (engine.json `fusion` records which, and why):
  attention  GroupQueryAttention where ONNX Runtime's kernel takes the shape (`gqa_problem` runs it once: ORT
             1.32's CPU kernel needs head_size % 16 == 0, and partial rotary dims / 2 a multiple of 8); else standard ops over the same inputs, as the
             portable graph computes it: the new rows ScatterND'ed into the bound buffer, QKᵀ, a select of
             the visible rows, Softmax, ·V (stale rows never count, whatever they hold).
  rotary     inside GroupQueryAttention; with the standard attention, standard ops (Gather cos/sin, rotate-half).
  norm       SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (any shape, CPU and CUDA).
"""
from __future__ import annotations

import numpy as np

from edgespec import contract as C

from .checkpoint import ModelSpec

OPSET = 17
MS_DOMAIN = "com.microsoft"
FUSED = "fused"
ROPE_ROWS_MIN = 1024  # rotary table rows at least: the precision gate teacher-forces rows longer than max_context


class _Graph:
    """Nodes and initializers in the order they are added; every op returns its output names."""

    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

    def const(self, name: str, arr) -> str:
        from onnx import numpy_helper
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list, outputs=1, domain: str = "", **attrs):
        from onnx import helper
        self._n += 1
        names = outputs if isinstance(outputs, list) else [f"{op_type.lower()}_{self._n}_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=f"{op_type}_{self._n}", domain=domain,
                                           **attrs))
        return names[0] if len(names) == 1 else names


def gqa_problem(num_heads: int, kv_heads: int, head_dim: int, sliding_window: int | None = None,
                dtype=np.float32, rotary_dim: int | None = None) -> str | None:
    """None when this ONNX Runtime's CPU GroupQueryAttention runs the shape (one small call with a cache and
    two new tokens), else its error: the kernel checks some shapes only when it runs."""
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
    """engine.json `fusion` for this checkpoint on this ONNX Runtime: FUSABLE_OPS -> "fused" or why not."""
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


def build_ort_graph(spec: ModelSpec, weights: dict[str, np.ndarray], manifest: C.Manifest):
    """-> onnx.ModelProto of the ort flavour for `manifest` (its inputs, outputs, argmax range, max_context and
    `fusion`, from plan_fusion)."""
    from onnx import TensorProto, helper

    m, s = manifest, spec
    g = _Graph()
    hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
    fused_attention = m.fusion.get("attention") == FUSED
    w = lambda name: np.ascontiguousarray(weights[name], dtype=np.float32)  # noqa: E731
    eps = float(s.rms_norm_eps)
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731

    # embeddings (B, S, E)
    if m.input_mode == "ids":
        x = g.op("Gather", [g.const("embed_tokens", w("model.embed_tokens.weight")), C.INPUT_IDS], axis=0)
        if s.embed_scale != 1.0:
            x = g.op("Mul", [x, g.const("embed_scale", np.array(s.embed_scale, np.float32))])
    else:
        x = C.INPUTS_EMBEDS
    tables = rope_tables(s, max(m.max_context, ROPE_ROWS_MIN))
    if fused_attention:
        caches = [(g.const(f"cos_cache{j}", c), g.const(f"sin_cache{j}", sn)) for j, (c, sn) in enumerate(tables)]
    else:
        at = _StandardAttention(g, s, tables, x if m.input_mode == "embeds" else C.INPUT_IDS)

    def norm(t: str, name: str, gamma: np.ndarray) -> str:  # RMSNorm over the last axis
        return g.op("SimplifiedLayerNormalization", [t, g.const(name, gamma)], epsilon=eps, axis=-1)

    h = norm(x, "l0.ln1", w("model.layers.0.input_layernorm.weight"))
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        layer = s.layers[i]
        wqkv = np.concatenate([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)  # ((H + 2 Hkv) D, E)
        qkv = g.op("MatMul", [h, g.const(f"l{i}.wqkv", wqkv.T.copy())])  # (B, S, (H + 2 Hkv) D)
        if s.qkv_bias:
            bias = np.concatenate([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
            qkv = g.op("Add", [qkv, g.const(f"l{i}.bqkv", bias)])
        past = [C.past_key(i), C.past_value(i)]
        present = [C.present_key(i), C.present_value(i)]
        if fused_attention:
            if s.qk_norm:  # each head's q and k normed over D before GroupQueryAttention's rotary
                q, k, v = g.op("Split", [qkv, i64(f"l{i}.qkv_split", [hq * d, hk * d, hk * d])], 3, axis=-1)
                heads = lambda t, n, nm: g.op("Reshape", [norm(g.op("Reshape", [t, i64(f"l{i}.{nm}_heads", [0, 0, n, d])]), f"l{i}.{nm}_norm", w(p + f"self_attn.{nm}_norm.weight")), i64(f"l{i}.{nm}_flat", [0, 0, n * d])])  # noqa: E731,E501
                qkv_in = [heads(q, hq, "q"), heads(k, hk, "k"), v]
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
            o = norm(o, f"l{i}.post_attn", w(p + "post_attention_layernorm.weight"))
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [o, x, g.const(f"l{i}.ln2", w(s.mlp_norm(i)))], 4,
                          domain=MS_DOMAIN, epsilon=eps)
        wgu = np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0)  # (2 I, E)
        gu = g.op("MatMul", [h, g.const(f"l{i}.wgu", wgu.T.copy())])
        gate, up = g.op("Split", [gu, g.const(f"l{i}.split", np.array([s.intermediate_size] * 2, np.int64))], 2,
                        axis=-1)
        if s.hidden_act == "silu":
            a = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        else:  # tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            a = g.op("FastGelu", [gate], domain=MS_DOMAIN)
        mlp = g.op("MatMul", [g.op("Mul", [a, up]), g.const(f"l{i}.wd", w(p + "mlp.down_proj.weight").T.copy())])
        if s.sandwich_norm:
            mlp = norm(mlp, f"l{i}.post_mlp", w(p + "post_feedforward_layernorm.weight"))
        last = i == s.num_layers - 1
        gamma = w("model.norm.weight") if last else w(f"model.layers.{i + 1}.input_layernorm.weight")
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [mlp, x, g.const(f"l{i + 1}.ln1", gamma)], 4,
                          domain=MS_DOMAIN, epsilon=eps)
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

    types = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "float32": TensorProto.FLOAT,
             "float16": TensorProto.FLOAT16}
    vi = lambda t: helper.make_tensor_value_info(t.name, types[t.dtype], t.shape)  # noqa: E731
    graph = helper.make_graph(g.nodes, "edgespec_decoder_ort", [vi(t) for t in m.inputs], [vi(t) for t in m.outputs],
                              g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                             producer_name="edgespec")


class _StandardAttention:
    """Attention in standard ops over the ort flavour's inputs (the fallback when GroupQueryAttention cannot
    run the shape). Positions, scatter indices, rotary tables and the visibility masks are built once per call:

        L = seqlens_k + 1 - query_seqlens (B,);  pos = L + arange(S) (B, S)
        ok[b, s, r] = r <= pos[b, s] (and pos[b, s] - r < window, per distinct window)   (B, 1, 1, S, P)
    """

    def __init__(self, g: _Graph, spec: ModelSpec, tables: list, first: str):
        self.g, self.s, self.first = g, spec, first
        self._tables = tables
        self.i64 = lambda v: g.const(f"sa.c{len(g.inits)}", np.array(v, np.int64))

    def setup(self, past_key0: str) -> None:
        """The per-call tensors (once, before layer 0)."""
        g, i64, s = self.g, self.i64, self.s
        start = g.op("Sub", [g.op("Add", [C.SEQLENS_K, g.const("sa.one32", np.array(1, np.int32))]), C.QUERY_SEQLENS])
        start = g.op("Cast", [start], to=7)  # (B,) int64: the committed rows L
        shape = g.op("Shape", [self.first])
        b = g.op("Gather", [shape, i64(0)], axis=0)
        n = g.op("Gather", [shape, i64(1)], axis=0)
        rows = g.op("Gather", [g.op("Shape", [past_key0]), i64(2)], axis=0)
        ar = g.op("Range", [i64(0), n, i64(1)])  # (S,)
        pos = g.op("Add", [g.op("Unsqueeze", [start, i64([1])]), ar])  # (B, S)
        keys = g.op("Range", [i64(0), rows, i64(1)])  # (P,)
        ok = g.op("LessOrEqual", [keys, g.op("Unsqueeze", [pos, i64([-1])])])  # (B, S, P)
        self.ok = {None: g.op("Unsqueeze", [ok, i64([1, 2])])}  # window -> (B, 1, 1, S, P)
        for win in sorted({w for w in s.windows if w is not None}):
            near = g.op("Less", [g.op("Sub", [g.op("Unsqueeze", [pos, i64([-1])]), keys]), i64(win)])
            self.ok[win] = g.op("Unsqueeze", [g.op("And", [ok, near]), i64([1, 2])])
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
        """x (B, H, S, D): its first R dims rotate (rotate-half) with rotary j's tables, the rest pass."""
        g, i64 = self.g, self.i64
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
        g, i64, s = self.g, self.i64, self.s
        hq, hk, d = s.num_heads, s.num_kv_heads, s.head_dim
        if i == 0:
            self.setup(past[0])
        q, k, v = g.op("Split", [qkv, i64([hq * d, hk * d, hk * d])], 3, axis=-1)
        heads = lambda t, n: g.op("Transpose", [g.op("Reshape", [t, i64([0, 0, n, d])])], perm=[0, 2, 1, 3])  # noqa
        q, k, v = heads(q, hq), heads(k, hk), heads(v, hk)  # (B, H|Hkv, S, D)
        if s.qk_norm:
            p = f"model.layers.{i}.self_attn."
            q, k = (g.op("SimplifiedLayerNormalization", [t, g.const(f"sa.{nm}n{i}", np.asarray(
                weights[p + f"{nm}_norm.weight"], np.float32))], epsilon=float(s.rms_norm_eps), axis=-1)
                for t, nm in ((q, "q"), (k, "k")))
        j = s.rope_index(i)
        if j is not None:
            q, k = self._rope(q, j), self._rope(k, j)
        kc = g.op("ScatterND", [past[0], self.idx, k], [present[0]])  # (B, Hkv, P, D), in place
        vc = g.op("ScatterND", [past[1], self.idx, v], [present[1]])
        q = g.op("Reshape", [g.op("Mul", [q, g.const(f"sa.scale{i}", np.array(s.attn_scale, np.float32))]),
                             i64([0, hk, hq // hk, -1, d])])  # (B, Hkv, g, S, D)
        kt = g.op("Unsqueeze", [g.op("Transpose", [kc], perm=[0, 1, 3, 2]), i64([2])])  # (B, Hkv, 1, D, P)
        sc = g.op("MatMul", [q, kt])  # (B, Hkv, g, S, P)
        sc = g.op("Where", [self.ok[s.layers[i].window], sc, g.const(f"sa.masked{i}", np.array(C.MASKED, np.float32))])
        pr = g.op("Softmax", [sc], axis=-1)
        o = g.op("MatMul", [pr, g.op("Unsqueeze", [vc, i64([2])])])  # (B, Hkv, g, S, D)
        o = g.op("Transpose", [g.op("Reshape", [o, i64([0, hq, -1, d])])], perm=[0, 2, 1, 3])  # (B, S, H, D)
        return g.op("Reshape", [o, i64([0, 0, hq * d])])

"""The engine I/O contract: every tensor name, shape and dtype, and the `engine.json` manifest.

This module (and policy_contract.py, for a policy folder's encoder) is the only one that spells a tensor
name. The exporter writes `engine.json` from it and every runtime backend binds from it.

Decoder graph (one call = S new tokens of B sequences, over P bound cache rows per sequence):

    input_ids        int64   [B, S]            (or inputs_embeds float32 [B, S, E])
    position_ids     int64   [B, S]            absolute positions of the new tokens = the cache rows they go to
    attention_bias   float32 [B, 1, S, P]      additive over the P bound rows: 0 = attend, MASKED = do not
    past.{i}.key     cache   [B, Hkv, P, D]    the runtime's buffer of layer i (P >= max position + 1)
    past.{i}.value   cache   [B, Hkv, P, D]
      ──▶
    logits           float32 [B, S, V]
    next_ids         int64   [B, S]            argmax of logits over the manifest's argmax_ids [lo, hi);
                                               NONFINITE_ID where that row's logits hold NaN or inf
    present.{i}.key  cache   [B, Hkv, P, D]    past with row position_ids[b, s] set to the new key (RoPE applied)
    present.{i}.value cache  [B, Hkv, P, D]

`cache` is float32, or float16 for fp16 engines. The runtime binds each `present` output to the buffer
it binds as `past`, so the graph's ScatterND writes the S new rows in place at their positions and
nothing is copied afterwards (ONNX Runtime skips ScatterND's input copy when its output is its input).
Rows past the committed length L are stale: masked in `attention_bias` with a select in the graph (so
NaN or inf in a stale row never reaches the output), overwritten by later calls, never cleared.
Rolling back is lowering L. Every query row of `attention_bias` must leave at least one row unmasked
(a padded query attends to itself).

Flavours (engine.json `flavor`): the graph above is the `portable` flavour (standard ONNX ops only: CPU, CUDA,
TensorRT). The `ort` flavour is the same decoder built around ONNX Runtime contrib ops (com.microsoft
GroupQueryAttention with the cache buffer shared between past and present, SkipSimplifiedLayerNormalization);
its small inputs say where the new rows go instead of position_ids and attention_bias:

    seqlens_k              int32 [B]   L[b] + Q[b] - 1: rows of sequence b after the call, minus one
    query_seqlens          int32 [B]   Q[b]: real (not padding) tokens among the S new ones (right padding)
    total_sequence_length  int32 []    max over b of L[b] + Q[b]

Query s of sequence b sits at position L[b] + s and sees rows 0 .. L[b] + s (and only the last
sliding_window of them); rows past seqlens_k[b] are never read, so stale rows need no mask. Padding rows are
not written. engine.json `fusion` records, per fusable op, what the graph holds ("fused" or why not).
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

from .files import file_sha256, read_json_object  # noqa: F401 (C.file_sha256: the contract's checks)

CONTRACT_VERSION = 2  # 2: cache written in place (ScatterND into the bound buffer), next_ids output
MANIFEST_FILE = "engine.json"
TEXT_HEAD_FILE = "text_head.npz"  # draft="head": a text draft head in the target's engine folder (--hidden)
NONFINITE_ID = -1  # next_ids where a row's logits are not all finite (argmax of NaN means nothing)
MASKED = -1e30  # additive bias of a masked key: exp underflows to 0 in fp32; becomes -inf in fp16

INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"
POSITION_IDS = "position_ids"
ATTENTION_BIAS = "attention_bias"
SEQLENS_K, QUERY_SEQLENS, TOTAL_SEQUENCE_LENGTH = "seqlens_k", "query_seqlens", "total_sequence_length"  # ort flavour
LOGITS = "logits"
NEXT_IDS = "next_ids"
HIDDEN = "hidden"  # optional: the final hidden state (B, S, E), the LM head's input (a feature-level draft reads it)


# Symbolic dimension names used in shapes.
BATCH, SEQ, PAST, TOTAL = "batch", "seq", "past", "total"

PRECISIONS = ("fp32", "fp16", "int8", "int4", "int8-dynamic")  # the integer ones: export/quantize.py
ENGINE_KINDS = ("decoder", "optimum")  # "optimum": concat-style export, manifest derived from the graph
INPUT_MODES = ("ids", "embeds")
CACHE_DTYPES = ("float32", "float16")
FLAVORS = ("portable", "ort")  # portable: standard ONNX ops; ort: ONNX Runtime contrib ops (see above)
FUSABLE_OPS = ("attention", "rotary", "norm")  # what an ort-flavour graph may fuse (engine.json `fusion`)


class EngineError(ValueError):
    """An engine folder that does not match its manifest, or a manifest that does not make sense."""


# Names of the optimum "text-generation-with-past" export (concat-style: present = past + new rows).
OPTIMUM_ATTENTION_MASK = "attention_mask"  # int64 [B, P + S]: 1 = attend, 0 = masked


def _per_layer(pattern: str):
    """-> name(i): the tensor name of layer i, pattern.format(i)."""
    def name(i: int) -> str:
        return pattern.format(i)
    return name


optimum_past_key, optimum_past_value = _per_layer("past_key_values.{}.key"), _per_layer("past_key_values.{}.value")
past_key, past_value = _per_layer("past.{}.key"), _per_layer("past.{}.value")  # cache inputs
present_key, present_value = _per_layer("present.{}.key"), _per_layer("present.{}.value")  # cache outputs


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16"
    shape: list  # ints for fixed dims, strings for symbolic ones

    def matches(self, name: str, dtype: str, shape: list) -> str | None:
        """None if an engine tensor (name, dtype, shape) agrees with this spec, else what differs."""
        if name != self.name:
            return f"name {name!r} != {self.name!r}"
        if dtype != self.dtype:
            return f"{self.name}: dtype {dtype} != manifest {self.dtype}"
        if len(shape) != len(self.shape):
            return f"{self.name}: rank {len(shape)} != manifest {len(self.shape)}"
        for a, b in zip(shape, self.shape):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                return f"{self.name}: shape {shape} != manifest {self.shape}"
        return None


def decoder_io(num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int, hidden_size: int,
               input_mode: str = "ids", cache_dtype: str = "float32", flavor: str = "portable",
               hidden: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of a contract decoder of `flavor`, in graph order; `hidden` adds the HIDDEN output."""
    if flavor not in FLAVORS:
        raise EngineError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    if input_mode not in INPUT_MODES:
        raise EngineError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
    if cache_dtype not in CACHE_DTYPES:
        raise EngineError(f"cache dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
    first = (TensorSpec(INPUT_IDS, "int64", [BATCH, SEQ]) if input_mode == "ids"
             else TensorSpec(INPUTS_EMBEDS, "float32", [BATCH, SEQ, hidden_size]))
    if flavor == "portable":
        inputs = [first, TensorSpec(POSITION_IDS, "int64", [BATCH, SEQ]),
                  TensorSpec(ATTENTION_BIAS, "float32", [BATCH, 1, SEQ, PAST])]
    else:
        inputs = [first, TensorSpec(SEQLENS_K, "int32", [BATCH]), TensorSpec(QUERY_SEQLENS, "int32", [BATCH]),
                  TensorSpec(TOTAL_SEQUENCE_LENGTH, "int32", [])]
    outputs = [TensorSpec(LOGITS, "float32", [BATCH, SEQ, vocab_size]), TensorSpec(NEXT_IDS, "int64", [BATCH, SEQ])]
    if hidden:
        outputs.append(TensorSpec(HIDDEN, "float32", [BATCH, SEQ, hidden_size]))
    kv = [BATCH, num_kv_heads, PAST, head_dim]
    for i in range(num_layers):
        inputs += [TensorSpec(past_key(i), cache_dtype, kv), TensorSpec(past_value(i), cache_dtype, kv)]
        outputs += [TensorSpec(present_key(i), cache_dtype, kv), TensorSpec(present_value(i), cache_dtype, kv)]
    return inputs, outputs


def cache_names(num_layers: int) -> list[tuple[str, str]]:
    """(past, present) name pairs in buffer order: key 0, value 0, key 1, ... (the runtime's buffers[2i], [2i+1])."""
    out = []
    for i in range(num_layers):
        out += [(past_key(i), present_key(i)), (past_value(i), present_value(i))]
    return out


def optimum_io(num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int
               ) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of an optimum decoder export, in graph order."""
    inputs = [TensorSpec(INPUT_IDS, "int64", [BATCH, SEQ]), TensorSpec(OPTIMUM_ATTENTION_MASK, "int64", [BATCH, TOTAL]),
              TensorSpec(POSITION_IDS, "int64", [BATCH, SEQ])]
    outputs = [TensorSpec(LOGITS, "float32", [BATCH, SEQ, vocab_size])]
    for i in range(num_layers):
        inputs += [TensorSpec(optimum_past_key(i), "float32", [BATCH, num_kv_heads, PAST, head_dim]),
                   TensorSpec(optimum_past_value(i), "float32", [BATCH, num_kv_heads, PAST, head_dim])]
        outputs += [TensorSpec(present_key(i), "float32", [BATCH, num_kv_heads, TOTAL, head_dim]),
                    TensorSpec(present_value(i), "float32", [BATCH, num_kv_heads, TOTAL, head_dim])]
    return inputs, outputs


# -- manifest field checks ----------------------------------------------------------------------------
# engine.json is read on a robot before anything runs: a wrong or malformed field must stop the load with
# one error naming the field, not surface later as a TypeError or an ONNX Runtime shape error mid-decode.

TENSOR_DTYPES = ("int64", "int32", "float32", "float16")  # what a contract or optimum graph binds
POSITIVE_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context")
OPTIONAL_STR_FIELDS = ("tokenizer_file", "embedding_file", "model_data_file")
SHA256_FIELDS = ("tokenizer_sha256", "source_sha256", "model_sha256", "model_data_sha256")
DATA_HASH_LIMIT = 2 << 30  # bytes: an external data file up to this size is hashed at load; a larger one sized


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a size


def _as_list(v, what: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise EngineError(f"{what}: expected a list of tensors (name, dtype, shape), got {v!r}")
    return list(v)


def _tensor_spec(t, what: str, i: int) -> TensorSpec:
    """A TensorSpec from its JSON dict, checked: a str name, a known dtype, dims that are ints > 0 or names."""
    if isinstance(t, TensorSpec):
        t = asdict(t)
    if not isinstance(t, dict) or set(t) != {"name", "dtype", "shape"}:
        raise EngineError(f"{what}[{i}]: expected {{name, dtype, shape}}, got {t!r}")
    name, dtype, shape = t["name"], t["dtype"], t["shape"]
    if not (isinstance(name, str) and name):
        raise EngineError(f"{what}[{i}].name: expected a non-empty string, got {name!r}")
    if dtype not in TENSOR_DTYPES:
        raise EngineError(f"{what}[{i}] ({name}).dtype: expected one of {TENSOR_DTYPES}, got {dtype!r}")
    if not (isinstance(shape, list) and all((_is_int(d) and d > 0) or (isinstance(d, str) and d) for d in shape)):
        raise EngineError(f"{what}[{i}] ({name}).shape: expected a list of ints > 0 or dimension names, "
                          f"got {shape!r}")
    return TensorSpec(name, dtype, list(shape))


def _field_problems(m: "Manifest") -> list[str]:
    """Each scalar field against its expected type and range (expected ..., got ...)."""
    problems = []

    def want(name: str, ok: bool, expected: str):
        if not ok:
            problems.append(f"{name}: expected {expected}, got {getattr(m, name)!r}")

    want("model_file", isinstance(m.model_file, str) and _inside_folder(m.model_file),
         "a file name inside the engine folder")
    want("architecture", isinstance(m.architecture, str), "a string")
    for name in POSITIVE_FIELDS:
        want(name, _is_int(getattr(m, name)) and getattr(m, name) > 0, "an integer > 0")
    # 0 = unknown, allowed for optimum engines derived from a config.json without hidden_size
    unknown_ok = m.kind == "optimum" and m.hidden_size == 0
    want("hidden_size", _is_int(m.hidden_size) and (m.hidden_size > 0 or unknown_ok), "an integer > 0")
    want("precision", m.precision in PRECISIONS, f"one of {PRECISIONS}")
    want("kind", m.kind in ENGINE_KINDS, f"one of {ENGINE_KINDS}")
    want("input_mode", m.input_mode in INPUT_MODES, f"one of {INPUT_MODES}")
    want("sliding_window", m.sliding_window is None or (_is_int(m.sliding_window) and m.sliding_window > 0),
         "null or an integer > 0")
    lw = m.layer_windows
    want("layer_windows", lw is None or (isinstance(lw, list) and len(lw) == m.num_layers
                                         and all(w is None or (_is_int(w) and w > 0) for w in lw)),
         f"null or a list of num_layers ({m.num_layers}) windows, each null or an integer > 0")
    for name in OPTIONAL_STR_FIELDS:
        v = getattr(m, name)
        want(name, v is None or (isinstance(v, str) and _inside_folder(v)),
             "null or a file name inside the engine folder")
    for name in SHA256_FIELDS:
        v = getattr(m, name)
        want(name, v is None or (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)),
             "null or 64 lowercase hex digits")
    want("model_data_bytes", m.model_data_bytes is None or (_is_int(m.model_data_bytes) and m.model_data_bytes >= 0),
         "null or an integer >= 0")
    want("edgespec_version", isinstance(m.edgespec_version, str), "a string")
    want("contract_version", _is_int(m.contract_version), "an integer")
    want("extra", isinstance(m.extra, dict), "a JSON object")
    want("flavor", m.flavor in FLAVORS and (m.flavor == "portable" or m.kind == "decoder"),
         f"one of {FLAVORS} ('ort' only for kind 'decoder')")
    want("fusion", isinstance(m.fusion, dict) and set(m.fusion) <= set(FUSABLE_OPS)
         and all(isinstance(v, str) for v in m.fusion.values()), f"a JSON object of {FUSABLE_OPS} -> strings")
    if problems:
        return problems  # the checks below need the sizes to be numbers
    if m.num_heads % m.num_kv_heads:
        problems.append(f"num_heads: expected a multiple of num_kv_heads {m.num_kv_heads}, got {m.num_heads}")
    vocab = f"an id in [0, vocab_size {m.vocab_size})"
    want("bos_token_id", m.bos_token_id is None or (_is_int(m.bos_token_id) and 0 <= m.bos_token_id < m.vocab_size),
         f"null or {vocab}")
    want("eos_token_ids", isinstance(m.eos_token_ids, list)
         and all(_is_int(t) and 0 <= t < m.vocab_size for t in m.eos_token_ids), f"a list of ids in [0, {m.vocab_size})")
    a = m.argmax_ids
    want("argmax_ids", a is None or (isinstance(a, (list, tuple)) and len(a) == 2 and all(map(_is_int, a))
                                     and 0 <= a[0] < a[1] <= m.vocab_size),
         f"null or [lo, hi] with 0 <= lo < hi <= vocab_size {m.vocab_size}")
    return problems


def _inside_folder(name: str) -> bool:
    """A relative path that stays in the engine folder (no absolute path, no '..')."""
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


@dataclass
class Manifest:
    """What `engine.json` holds. Written by export, read and checked by every backend."""
    model_file: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    precision: str = "fp32"
    kind: str = "decoder"
    input_mode: str = "ids"
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    sliding_window: int | None = None  # applied by the runtime in attention_bias (compat engines, older exports)
    layer_windows: list | None = None  # each layer's window (null: global), applied inside the graph itself
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer_file: str | None = "tokenizer.json"
    tokenizer_sha256: str | None = None
    source_sha256: str | None = None
    model_sha256: str | None = None
    embedding_file: str | None = None  # embeds engines: the token embedding table, to embed ids on the host
    model_data_file: str | None = None  # the model's external data (its weights), beside it; None: inside it
    model_data_sha256: str | None = None
    model_data_bytes: int | None = None
    argmax_ids: list[int] | None = None  # [lo, hi): the ids next_ids picks among (None: the whole vocabulary)
    flavor: str = "portable"  # FLAVORS; folders exported before flavours existed are portable
    fusion: dict = field(default_factory=dict)  # ort flavour: FUSABLE_OPS name -> "fused" or why it is not
    edgespec_version: str = ""
    contract_version: int = CONTRACT_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """Check every field's type and range: ONE EngineError listing what is wrong (Manifest.read
        prefixes the file's path). The sizes are checked against the graph at load (check_graph_io)."""
        self.inputs = [_tensor_spec(t, "inputs", i) for i, t in enumerate(_as_list(self.inputs, "inputs"))]
        self.outputs = [_tensor_spec(t, "outputs", i) for i, t in enumerate(_as_list(self.outputs, "outputs"))]
        problems = _field_problems(self)
        if problems:
            raise EngineError("; ".join(problems))
        if self.argmax_ids is not None:
            self.argmax_ids = list(self.argmax_ids)
        if self.cache_dtype not in CACHE_DTYPES:
            raise EngineError(f"inputs {past_key(0)} (the KV cache) dtype: expected one of {CACHE_DTYPES}, "
                              f"got {self.cache_dtype!r}")

    # -- persistence ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / MANIFEST_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, engine_dir: Path) -> "Manifest":
        path = Path(engine_dir) / MANIFEST_FILE
        if not path.is_file():
            raise EngineError(f"{engine_dir}: no {MANIFEST_FILE}; expected an engine folder made by `edgespec export`")
        data = read_json_object(path, "manifest", EngineError)
        if data.get("contract_version") != CONTRACT_VERSION:
            raise EngineError(f"{path}: contract_version {data.get('contract_version')} is not the supported "
                              f"{CONTRACT_VERSION}; re-export the engine with this edgespec")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise EngineError(f"{path}: unknown manifest fields {unknown}")
        missing = [n for n, f in fields.items() if n not in data
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise EngineError(f"{path}: missing manifest fields {missing}")
        try:
            return cls(**data)
        except EngineError as e:
            raise EngineError(f"{path}: {e}") from None

    # -- checks --------------------------------------------------------------------------------
    def check_files(self, engine_dir: Path, hashes: bool = True) -> list[str]:
        """Problems between this manifest and the files beside it (empty list = consistent)."""
        engine_dir = Path(engine_dir)
        problems = []
        model = engine_dir / self.model_file
        if not model.is_file():
            return [f"model file {self.model_file} is missing from {engine_dir}"]
        if hashes and self.model_sha256 and file_sha256(model) != self.model_sha256:
            problems.append(f"{self.model_file}: sha256 differs from the manifest's model_sha256 "
                            f"(the model file was changed or replaced after export)")
        if self.model_data_file:
            data = engine_dir / self.model_data_file
            if not data.is_file():
                problems.append(f"model data file {self.model_data_file} (the weights of {self.model_file}) is "
                                f"missing from {engine_dir}")
            elif self.model_data_bytes is not None and data.stat().st_size != self.model_data_bytes:
                problems.append(f"{self.model_data_file}: {data.stat().st_size} bytes, but the manifest's "
                                f"model_data_bytes is {self.model_data_bytes} (changed or truncated after export)")
            elif (hashes and self.model_data_sha256 and data.stat().st_size <= DATA_HASH_LIMIT
                  and file_sha256(data) != self.model_data_sha256):
                problems.append(f"{self.model_data_file}: sha256 differs from the manifest's model_data_sha256 "
                                f"(the weights were changed after export)")
        if self.tokenizer_file:
            tok = engine_dir / self.tokenizer_file
            if not tok.is_file():
                problems.append(f"tokenizer file {self.tokenizer_file} is missing from {engine_dir}")
            elif hashes and self.tokenizer_sha256 and file_sha256(tok) != self.tokenizer_sha256:
                problems.append(f"{self.tokenizer_file}: sha256 differs from the manifest's tokenizer_sha256")
        if self.input_mode == "embeds" and not self.embedding_file:
            problems.append("input_mode 'embeds' needs embedding_file (the token embedding table), got null")
        elif self.embedding_file and not (engine_dir / self.embedding_file).is_file():
            problems.append(f"embedding file {self.embedding_file} is missing from {engine_dir}")
        return problems

    def check_graph_io(self, inputs: list[tuple[str, str, list]], outputs: list[tuple[str, str, list]]) -> list[str]:
        """Compare the graph's (name, dtype, shape) lists with the manifest's; return what differs.
        The sizes come first, each named by its engine.json field; then the tensors' names, dtypes and
        shapes (one line per list: a wrong size or dtype repeats in every layer's tensors)."""
        problems = self._graph_size_problems(inputs, outputs)
        for kind, want, got in (("input", self.inputs, inputs), ("output", self.outputs, outputs)):
            want_names, got_names = [t.name for t in want], [g[0] for g in got]
            if want_names != got_names:
                missing = [n for n in want_names if n not in got_names]
                extra = [n for n in got_names if n not in want_names]
                problems.append(f"{kind} names differ: missing {missing}, unexpected {extra}")
                continue
            diffs = [d for spec, (name, dtype, shape) in zip(want, got) if (d := spec.matches(name, dtype, shape))]
            if diffs:
                more = f" (and {len(diffs) - 1} more {kind}s)" if len(diffs) > 1 else ""
                problems.append(f"{kind} {diffs[0]}{more}")
        return problems

    def _graph_size_problems(self, inputs: list[tuple[str, str, list]], outputs: list[tuple[str, str, list]]
                             ) -> list[str]:
        """num_layers, num_kv_heads, head_dim, vocab_size and hidden_size, read back from the graph's
        tensors (a dim the graph leaves symbolic is not compared)."""
        ins, outs = {n: (d, s) for n, d, s in inputs}, {n: (d, s) for n, d, s in outputs}
        pk = optimum_past_key if self.kind == "optimum" else past_key
        problems = []
        layers = next(i for i in range(len(ins) + 1) if pk(i) not in ins)
        presents = next(i for i in range(len(outs) + 1) if present_key(i) not in outs)
        if (layers, presents) != (self.num_layers, self.num_layers):
            problems.append(f"num_layers: engine.json has {self.num_layers} but the graph has {layers} "
                            f"{pk(0).rsplit('.', 2)[0]}.i and {presents} present.i cache layers")
        if layers:  # (a cache dtype that differs is reported per tensor by the checks after these)
            shape = ins[pk(0)][1]
            for field_name, dim in (("num_kv_heads", 1), ("head_dim", 3)):
                got = shape[dim] if len(shape) == 4 else None
                if isinstance(got, int) and got != getattr(self, field_name):
                    problems.append(f"{field_name}: engine.json has {getattr(self, field_name)} but the graph's "
                                    f"{pk(0)} {shape} has {got} (dim {dim})")
        for field_name, (name, shape) in (("vocab_size", (LOGITS, outs.get(LOGITS, (None, []))[1])),
                                          ("hidden_size", (INPUTS_EMBEDS, ins.get(INPUTS_EMBEDS, (None, []))[1]))):
            got = shape[-1] if shape else None
            if isinstance(got, int) and got != getattr(self, field_name):
                problems.append(f"{field_name}: engine.json has {getattr(self, field_name)} but the graph's "
                                f"{name} {shape} has {got} (last dim)")
        return problems

    @property
    def has_hidden(self) -> bool:
        """The graph also outputs its final hidden state (HIDDEN)."""
        return any(t.name == HIDDEN for t in self.outputs)

    @property
    def argmax_range(self) -> tuple[int, int]:
        """[lo, hi) of the ids next_ids picks among."""
        return tuple(self.argmax_ids) if self.argmax_ids else (0, self.vocab_size)

    @property
    def cache_dtype(self) -> str:
        """dtype of the KV cache buffers (the past inputs'), e.g. float32 or float16."""
        spec = next((t for t in self.inputs if t.name in (past_key(0), optimum_past_key(0))), None)
        return spec.dtype if spec is not None else "float32"

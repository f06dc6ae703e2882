"""engine.json is checked at load: malformed fields, and sizes that disagree with the graph, stop the load
with one EngineError naming the file and the field (expected vs got), and `edgespec inspect` prints one
`error:` line. Each case edits a copy of a tiny exported engine (engine.json is not hashed; the model and
tokenizer files, which are, stay untouched)."""
import json
import shutil

import pytest

import edgespec
from edgespec import contract as C
from edgespec.cli import main as cli_main
from edgespec.backends.ort import OrtEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import char_tokenizer_json, make_checkpoint
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("manifest_checks")
    make_checkpoint("llama", root / "ckpt", seed=1)  # 2 layers, 2 KV heads of dim 8, vocab 96, hidden 32
    char_tokenizer_json(root / "ckpt" / "tokenizer.json")
    export_engine(root / "ckpt", root / "engine", max_context=64, progress=False)
    return root / "engine"


def edited(engine, tmp_path, **fields):
    """A copy of `engine` with engine.json's `fields` replaced (DELETE removes one)."""
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    data = json.loads((d / C.MANIFEST_FILE).read_text())
    for k, v in fields.items():
        if v is DELETE:
            del data[k]
        else:
            data[k] = v
    (d / C.MANIFEST_FILE).write_text(json.dumps(data))
    return d


DELETE = object()


def declared_io(layers=2, kv_heads=2, head_dim=8, vocab=96, cache="float32") -> dict:
    """inputs/outputs of a self-consistent manifest with these sizes (what another model's export declares)."""
    ins, outs = C.decoder_io(layers, kv_heads, head_dim, vocab, 32, cache_dtype=cache)
    return {"inputs": [vars(t) for t in ins], "outputs": [vars(t) for t in outs]}


MALFORMED = [  # (fields, what the error says): each used to load, or fail with TypeError/ZeroDivisionError/KeyError
    (dict(num_layers="2"), "num_layers: expected an integer > 0, got '2'"),
    (dict(num_layers=0), "num_layers: expected an integer > 0, got 0"),
    (dict(num_kv_heads=0), "num_kv_heads: expected an integer > 0, got 0"),
    (dict(head_dim=-8), "head_dim: expected an integer > 0, got -8"),
    (dict(vocab_size=True), "vocab_size: expected an integer > 0, got True"),
    (dict(vocab_size=96.0), "vocab_size: expected an integer > 0, got 96.0"),
    (dict(max_context=None), "max_context: expected an integer > 0, got None"),
    (dict(num_heads=3), "num_heads: expected a multiple of num_kv_heads 2, got 3"),
    (dict(precision="bf16"), "precision: expected one of \\('fp32', 'fp16', 'int8', 'int4', 'int8-dynamic'\\), "
                              "got 'bf16'"),
    (dict(kind="encoder"), "kind: expected one of"),
    (dict(input_mode="pixels"), "input_mode: expected one of"),
    (dict(argmax_ids=[0, 500]), "argmax_ids: expected null or \\[lo, hi\\] with 0 <= lo < hi <= vocab_size 96"),
    (dict(argmax_ids=[5]), "argmax_ids: expected"),
    (dict(eos_token_ids=[500]), "eos_token_ids: expected a list of ids in \\[0, 96\\), got \\[500\\]"),
    (dict(eos_token_ids=95), "eos_token_ids: expected a list"),
    (dict(bos_token_id=-1), "bos_token_id: expected null or an id in \\[0, vocab_size 96\\)"),
    (dict(sliding_window=0), "sliding_window: expected null or an integer > 0, got 0"),
    (dict(model_file=42), "model_file: expected a file name inside the engine folder, got 42"),
    (dict(model_file="../../model.onnx"), "model_file: expected a file name inside the engine folder"),
    (dict(model_sha256="abc"), "model_sha256: expected null or 64 lowercase hex digits, got 'abc'"),
    (dict(extra=[]), "extra: expected a JSON object, got \\[\\]"),
    (dict(inputs={"name": "input_ids"}), "inputs: expected a list of tensors"),
    (dict(inputs=[{"name": "input_ids"}]), "inputs\\[0\\]: expected \\{name, dtype, shape\\}"),
    (dict(outputs=[{"name": "logits", "dtype": "float64", "shape": ["batch", "seq", 96]}]),
     "outputs\\[0\\] \\(logits\\).dtype: expected one of .*got 'float64'"),
    (dict(outputs=[{"name": "logits", "dtype": "float32", "shape": "batch"}]),
     "outputs\\[0\\] \\(logits\\).shape: expected a list of ints > 0 or dimension names"),
    (dict(vocab_size=DELETE), "missing manifest fields \\['vocab_size'\\]"),
]


@pytest.mark.parametrize("fields,match", MALFORMED, ids=[next(iter(f)) + f"={f[next(iter(f))]!r:.20}"
                                                          for f, _ in MALFORMED])
def test_malformed_field_is_one_engine_error_naming_file_and_field(engine, tmp_path, fields, match):
    d = edited(engine, tmp_path, **fields)
    with pytest.raises(C.EngineError, match=match) as e:
        edgespec.load(d, provider="cpu")
    assert str(e.value).startswith(f"{d / C.MANIFEST_FILE}: ")


def test_manifest_that_is_not_an_object_is_refused(engine, tmp_path):
    d = edited(engine, tmp_path)
    (d / C.MANIFEST_FILE).write_text("[1, 2]")
    with pytest.raises(C.EngineError, match="expected a JSON object of manifest fields, got list"):
        OrtEngine(d)
    (d / C.MANIFEST_FILE).write_bytes(b'{"model_file": "\xff"}')
    with pytest.raises(C.EngineError, match="not valid JSON"):
        OrtEngine(d)


@pytest.mark.parametrize("fields,match", [
    # a size edited alone: the graph's tensors say otherwise
    (dict(num_layers=3), "num_layers: engine.json has 3 but the graph has 2 past.i and 2 present.i cache layers"),
    (dict(num_kv_heads=1), "num_kv_heads: engine.json has 1 but the graph's past.0.key .* has 2 \\(dim 1\\)"),
    (dict(head_dim=16), "head_dim: engine.json has 16 but the graph's past.0.key .* has 8 \\(dim 3\\)"),
    (dict(vocab_size=100), "vocab_size: engine.json has 100 but the graph's logits .* has 96 \\(last dim\\)"),
    # a manifest consistent in itself (another model's sizes and tensors) on this graph
    (dict(num_layers=3, **declared_io(layers=3)), "num_layers: engine.json has 3 but the graph has 2"),
    (dict(num_kv_heads=4, **declared_io(kv_heads=4)), "num_kv_heads: engine.json has 4 but the graph's"),
    (dict(head_dim=4, num_heads=4, **declared_io(head_dim=4)), "head_dim: engine.json has 4 but the graph's"),
    (dict(vocab_size=128, **declared_io(vocab=128)), "vocab_size: engine.json has 128 but the graph's"),
    (declared_io(cache="float16"), "input past.0.key: dtype float32 != manifest float16"),
])
def test_sizes_that_disagree_with_the_graph_are_refused_at_load(engine, tmp_path, fields, match):
    d = edited(engine, tmp_path, **fields)
    with pytest.raises(C.EngineError, match=f"{d / 'model.onnx'}: graph does not match .*engine.json:\n  - {match}"):
        edgespec.load(d, provider="cpu")


def test_embeds_engine_without_its_embedding_table_is_refused(engine, tmp_path):
    d = edited(engine, tmp_path, input_mode="embeds")
    with pytest.raises(C.EngineError, match="input_mode 'embeds' needs embedding_file"):
        OrtEngine(d)


def test_inspect_malformed_manifest_prints_one_error_line(engine, tmp_path, capsys):
    d = edited(engine, tmp_path, num_kv_heads=0)
    assert cli_main(["inspect", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {d / C.MANIFEST_FILE}: num_kv_heads: expected an integer > 0, got 0\n"
    assert cli_main(["inspect", str(d), "--json"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_inspect_manifest_that_disagrees_with_the_graph_exits_non_zero(engine, tmp_path, capsys):
    d = edited(engine, tmp_path, head_dim=16)
    assert cli_main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if not line.startswith("  - ")] == \
        [f"error: {d / 'model.onnx'}: graph does not match {d}/engine.json:"]
    assert "head_dim: engine.json has 16" in err


def test_inspect_unloadable_model_is_an_error_line_not_a_traceback(engine, tmp_path, capsys):
    d = edited(engine, tmp_path, model_sha256=None)  # no hash to catch the broken file first: ORT refuses it
    (d / "model.onnx").write_bytes(b"not an onnx model")
    assert cli_main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_model_onnx_runtime_cannot_load_is_an_engine_error(engine, tmp_path):
    d = edited(engine, tmp_path, model_sha256=None)
    (d / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(C.EngineError, match=f"{d / 'model.onnx'}: ONNX Runtime cannot load it \\(InvalidProtobuf"):
        edgespec.load(d, provider="cpu")

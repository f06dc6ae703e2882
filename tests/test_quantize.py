"""Integer precisions (export/quantize.py): weight-only int4 / int8 through MatMulNBits, dynamic int8, the
precision gate on them, and the weight bytes per token that export records and `edgespec inspect` shows."""
import json
import os

import numpy as np
import pytest

import edgespec
from conftest import make_checkpoint
from edgespec import contract as C
from edgespec.cli import main as cli_main
from edgespec.export import onnx_export, quantize
from edgespec.export.onnx_export import export_engine
from edgespec.export.validate import GateError, precision_gate

onnx = pytest.importorskip("onnx", reason="quantizing needs the export extra (onnx)")

CAP = 64  # max context of these tests' exports: the gates run faster, nothing here needs more


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qckpt") / "llama"
    make_checkpoint("llama", path, seed=0)
    return path


@pytest.fixture(scope="module")
def exported(llama_ckpt, tmp_path_factory):
    """The tiny llama at fp32 and each integer precision, exported as drafts (the gate reports, never refuses)."""
    root = tmp_path_factory.mktemp("qeng")
    out = {}
    for dtype in ("fp32",) + quantize.INTEGER_PRECISIONS:
        out[dtype] = root / dtype
        export_engine(llama_ckpt, out[dtype], dtype=dtype, max_context=CAP, progress=False, role="draft")
    return out


def nodes(engine_dir, op_type):
    return [n for n in onnx.load(str(engine_dir / "model.onnx")).graph.node if n.op_type == op_type]


def attrs(node) -> dict:
    return {a.name: a.i for a in node.attribute}


@pytest.mark.parametrize("dtype", quantize.INTEGER_PRECISIONS)
def test_integer_exports_load_and_decode(exported, dtype):
    m = C.Manifest.read(exported[dtype])
    assert m.precision == dtype and m.cache_dtype == "float32"
    q, a = m.extra["quantization"], m.extra["validation"]["agreement_vs_fp32"]
    if dtype in quantize.WEIGHT_ONLY:
        nbits = nodes(exported[dtype], "MatMulNBits")
        assert len(nbits) == q["quantized_matmuls"] > 0 and not nodes(exported[dtype], "MatMulInteger")
        head = [n for n in nbits if n.name.startswith(q["head"] or "-")]  # the lm_head: the MatMul of the logits
        assert {attrs(n)["bits"] for n in nbits if n not in head} == {q["bits"]} == {int(dtype[3:])}
        assert {attrs(n)["bits"] for n in head} == ({8} if dtype == "int4" else set())  # int4: lm_head at 8 bits
        assert {attrs(n)["block_size"] for n in nbits} == {q["block_size"]} == {quantize.BLOCK_SIZE}
        # the tiny model's down projection has K = 48: not a multiple of the 32-value block (padded last block)
        assert 48 in {attrs(n)["K"] for n in nbits} and 48 % quantize.BLOCK_SIZE
    else:
        assert nodes(exported[dtype], "MatMulInteger") and not nodes(exported[dtype], "MatMulNBits")
    assert a["tokens"] >= 1000 and 0.5 < a["top1_agreement"] <= 1
    out = edgespec.load(exported[dtype]).generate([5, 17, 33, 2], max_new_tokens=12)
    assert len(out.token_ids) == 12 and all(0 <= t < m.vocab_size for t in out.token_ids)


def test_int8_keeps_more_than_int4(exported):
    agree = {d: C.Manifest.read(exported[d]).extra["validation"]["agreement_vs_fp32"] for d in ("int4", "int8")}
    assert agree["int8"]["top1_agreement"] > agree["int4"]["top1_agreement"]
    assert agree["int8"]["mean_kl"] < agree["int4"]["mean_kl"]


def test_weight_bytes_per_token_counts_the_packed_blocks(exported):
    """int4: the 4-bit blocks are N * ceil(K/bs) * bs/2 bytes per MatMulNBits (the 8-bit lm_head's twice that),
    plus one float32 scale and half a zero-point byte (a whole one at 8 bits) per block; everything not
    quantized reads the same bytes as in the fp32 graph, and the embedding table counts one row per token."""
    fp32, int4 = (C.Manifest.read(exported[d]).extra["weight_bytes_per_token"] for d in ("fp32", "int4"))
    bs = quantize.BLOCK_SIZE

    def ceil(a, b):
        return -(-a // b)
    shapes = [(attrs(n)["K"], attrs(n)["N"], attrs(n)["bits"]) for n in nodes(exported["int4"], "MatMulNBits")]
    for bits in (4, 8):  # the lm_head's blocks are 8-bit
        assert int4["by_kind"][f"{bits}-bit blocks"] == sum(n * ceil(k, bs) * bs * b // 8 for k, n, b in shapes
                                                           if b == bits)
    assert int4["by_kind"]["block scales (float32)"] == sum(4 * n * ceil(k, bs) for k, n, _ in shapes)
    assert int4["by_kind"]["block zero points"] == sum(n * ceil(ceil(k, bs), 8 // b) for k, n, b in shapes)
    quantized = sum(v for k, v in int4["by_kind"].items() if k.startswith(("4-bit", "8-bit", "block ")))
    assert fp32["total"] - sum(4 * k * n for k, n, _ in shapes) == int4["total"] - quantized  # the rest: unchanged
    graph = onnx.load(str(exported["fp32"] / "model.onnx")).graph
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    stored = sum(a.nbytes for a in arrays.values())
    tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in arrays
              and arrays[n.input[0]].ndim == 2}  # the embedding and the rotary tables: one row per token
    assert len(tables) >= 1 and "embed_tokens" in tables
    rows = sum(arrays[t].nbytes - arrays[t].nbytes // arrays[t].shape[0] for t in tables)
    assert stored - rows <= fp32["total"] <= stored - rows + 4096  # + the graph's small constants
    assert int4["total"] < 0.3 * fp32["total"]


def test_inspect_shows_weight_bytes_per_token_and_precision(exported, capsys):
    assert cli_main(["inspect", str(exported["int4"])]) == 0
    said = capsys.readouterr().out
    w = C.Manifest.read(exported["int4"]).extra["weight_bytes_per_token"]
    assert f"weight bytes per token: {w['total'] / 1e6:.2f} MB (4-bit blocks" in said
    assert "precision int4: weight-only MatMulNBits" in said and f"4-bit blocks of {quantize.BLOCK_SIZE}" in said
    assert "8-bit" in said.split("lm_head")[1]
    assert "KV cache 256 B per context token" in said  # 2 x 2 layers x 2 kv heads x head dim 8 x 4 bytes


def test_inspect_of_an_engine_without_the_record_says_so(exported, tmp_path, capsys):
    import shutil
    eng = tmp_path / "old"
    shutil.copytree(exported["int8-dynamic"], eng)
    data = json.loads((eng / "engine.json").read_text())
    del data["extra"]["weight_bytes_per_token"], data["extra"]["quantization"]
    data["precision"] = "int8"  # as exported before int8 meant weight-only
    (eng / "engine.json").write_text(json.dumps(data))
    assert cli_main(["inspect", str(eng)]) == 0
    said = capsys.readouterr().out
    assert "weight bytes per token: not recorded" in said and "now int8-dynamic" in said


def test_int4_draft_with_fp32_target_is_exact(tiny_engines, tmp_path):
    """Greedy speculation with an int4 draft gives plain decoding's tokens, with drafts both kept and rejected."""
    draft = tmp_path / "noisy-int4"
    ckpt = tiny_engines["noisy"].parent / "ckpt" / "noisy"  # conftest.tiny_engines' draft checkpoint
    export_engine(ckpt, draft, dtype="int4", max_context=128, progress=False, role="draft")
    plain = edgespec.load(tiny_engines["target"])
    prompts = ["def f(x):", "import os\n", "class A:", "x = [1, 2"]
    accepted = drafted = 0
    for gamma in (2, 4):
        spec = edgespec.load(tiny_engines["target"], draft=draft, gamma=gamma)
        for p in prompts:
            want = plain.generate(p, max_new_tokens=40).token_ids
            got = spec.generate(p, max_new_tokens=40)
            assert got.token_ids == want, (gamma, p)
            accepted, drafted = accepted + got.stats.accepted, drafted + got.stats.drafted
    assert 0 < accepted < drafted  # the int4 draft is right often, and wrong sometimes


def test_lossy_int4_target_is_refused_with_its_numbers(llama_ckpt, tmp_path, monkeypatch):
    """The tiny model's real int4 agreement (~0.86) is below the gate: the error carries the measured numbers."""
    seen = {}
    real = onnx_export.agreement

    def recording(*a, **k):
        seen.update(real(*a, **k))
        return dict(seen)
    monkeypatch.setattr(onnx_export, "agreement", recording)
    with pytest.raises(GateError) as e:
        export_engine(llama_ckpt, tmp_path / "t", dtype="int4", max_context=CAP, progress=False)
    said = str(e.value)
    assert seen["top1_agreement"] < 0.95
    for part in ("int4 target", f"{seen['top1_agreement']:.4f} of {seen['tokens']} held-out tokens",
                 f"mean KL {seen['mean_kl']:.2e}", ">= 0.99", "--allow-lossy", "--role draft"):
        assert part in said, f"{part!r} missing from: {said}"
    assert os.listdir(tmp_path) == []  # no engine folder, no staging folder
    m = export_engine(llama_ckpt, tmp_path / "t", dtype="int4", max_context=CAP, progress=False, allow_lossy=True)
    gate = m.extra["validation"]["precision_gate"]
    assert gate["top1"] == seen["top1_agreement"] and gate["overridden"] and not gate["passed"]


def test_int8_target_meets_a_lowered_threshold(llama_ckpt, tmp_path, monkeypatch):
    """The gate compares the measured agreement with its threshold: at 0.95 the tiny int8 target (~0.985)
    passes, and the record keeps the threshold it was held to."""
    import functools
    monkeypatch.setattr(onnx_export, "precision_gate", functools.partial(precision_gate, threshold=0.95))
    m = export_engine(llama_ckpt, tmp_path / "t", dtype="int8", max_context=CAP, progress=False)
    gate = m.extra["validation"]["precision_gate"]
    assert gate["threshold"] == 0.95 and gate["passed"] and gate["enforced"] and not gate["overridden"]
    with pytest.raises(GateError, match=r"int8 target .* expected >= 0\.9999"):
        precision_gate(m.extra["validation"]["agreement_vs_fp32"], "int8", "target", threshold=0.9999)


@pytest.mark.parametrize("call, match", [
    (lambda p: quantize.quantize("int3", p, p), r"integer precision must be one of \('int4', 'int8', "
                                                 r"'int8-dynamic'\), got 'int3'"),
    (lambda p: quantize.WeightOnly(bits=3), "bits must be 4 or 8 .*got 3"),
    (lambda p: quantize.WeightOnly(bits=4, block_size=48), "block_size must be a power of two >= 16.*got 48"),
    (lambda p: precision_gate({"top1_agreement": 1.0, "tokens": 9}, "int4", "target", threshold=99),
     r"threshold must be a top-1 agreement in \(0, 1\], got 99"),
])
def test_bad_settings_name_what_was_expected(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path / "x.onnx")


def test_bad_dtype_is_refused_before_any_work(llama_ckpt, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--dtype must be one of \(.*'int4', 'int8-dynamic'\), got 'int3'"):
        export_engine(llama_ckpt, tmp_path / "x", dtype="int3", progress=False)
    with pytest.raises(SystemExit):
        cli_main(["export", str(llama_ckpt), "--out", str(tmp_path / "x"), "--dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err and os.listdir(tmp_path) == []


def test_a_graph_without_constant_matmul_weights_is_refused(tmp_path):
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in "ab"],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="no MatMul with a constant weight to quantize .*got 1 MatMul nodes"):
        quantize.quantize("int4", tmp_path / "m.onnx", tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_weight_only_output_matches_fp32_closely_on_a_plain_matmul(tmp_path):
    """int8 blocks reproduce a random [64, 48] MatMul within 2% of its largest output, int4 within 20%."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 48])],
                          [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for dtype, tol in (("int8", 0.02), ("int4", 0.2)):
        rec = quantize.quantize(dtype, tmp_path / "m.onnx", tmp_path / f"{dtype}.onnx")
        assert rec["quantized_matmuls"] == 1 and rec["activation_matmuls"] == 0
        sess = ort.InferenceSession(str(tmp_path / f"{dtype}.onnx"), providers=["CPUExecutionProvider"])
        y = sess.run(None, {"x": x})[0]
        assert np.abs(y - x @ w).max() < tol * np.abs(x @ w).max(), dtype

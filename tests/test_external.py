"""The variants of an fp32 graph made one weight at a time (export/external.py, quantize.weight_only) are the
graphs ONNX Runtime's converters make from the fully loaded model: the same logits, bit for bit."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgespec import contract as C
from edgespec.export import quantize
from edgespec.export.external import DataWriter, fp16_graph, read_tensor
from edgespec.export.external import save_model
from edgespec.export.onnx_export import export_engine


@pytest.fixture(scope="module")
def fp32_graphs(tiny_checkpoints, tmp_path_factory):
    """fp32 folders with external weights: {flavor: folder}, the Gemma 3 checkpoint (the most family options)."""
    root = tmp_path_factory.mktemp("ext32")
    path, _ = tiny_checkpoints["gemma3"]
    return {f: export_engine(path, root / f, max_context=48, flavor=f, progress=False, external_data=True) and root / f
            for f in ("ort", "portable")}


def _logits(model_path, manifest: C.Manifest, fp16_cache: bool) -> np.ndarray:
    """One 6-token call from an empty cache through a plain session."""
    from edgespec.export.validate import _empty_past, _feeds
    from edgespec.masks import step_inputs
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(3).integers(0, manifest.vocab_size, size=(1, 6))
    past = [p.astype(np.float16) if fp16_cache else p for p in _empty_past(manifest, 1, manifest.max_context)]
    feeds = _feeds(manifest, ids, step_inputs(manifest, np.array([0]), 6, manifest.max_context), past)
    names = {i.name for i in sess.get_inputs()}
    return sess.run([C.LOGITS], {k: v for k, v in feeds.items() if k in names})[0]


@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_fp16_graph_streamed_equals_the_converter_on_the_loaded_model(fp32_graphs, tmp_path, flavor):
    from onnxruntime.transformers.float16 import convert_float_to_float16
    folder = fp32_graphs[flavor]
    m = C.Manifest.read(folder)
    src = folder / "model.onnx"
    cache = {n for pair in C.cache_names(m.num_layers) for n in pair}
    whole = onnx.load(str(src))
    keep = [t.name for t in list(whole.graph.input) + list(whole.graph.output) if t.name not in cache]
    whole = convert_float_to_float16(whole, keep_io_types=keep, disable_shape_infer=True)
    onnx.save(whole, str(tmp_path / "whole.onnx"))
    assert fp16_graph(src, tmp_path / "streamed.onnx", keep, external=True) == "streamed.onnx.data"
    streamed = onnx.load(str(tmp_path / "streamed.onnx"), load_external_data=False)
    assert len(streamed.graph.node) == len(whole.graph.node)
    types = lambda g: {t.name: t.data_type for t in g.graph.initializer}  # noqa: E731
    assert types(streamed) == types(whole) and onnx.TensorProto.FLOAT16 in types(streamed).values()
    assert not {v.name for v in streamed.graph.value_info} & set(types(streamed))  # no stand-in shape is left
    for t in streamed.graph.initializer:  # every weight's bytes, external or inline
        want = next(w for w in whole.graph.initializer if w.name == t.name)
        np.testing.assert_array_equal(read_tensor(t, tmp_path), onnx.numpy_helper.to_array(want))
    a = _logits(tmp_path / "whole.onnx", m, True)
    b = _logits(tmp_path / "streamed.onnx", m, True)
    assert np.isfinite(b).all()
    np.testing.assert_array_equal(a, b)


def test_weight_only_in_chunks_equals_one_pass_over_the_loaded_model(fp32_graphs, tmp_path, monkeypatch):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    folder = fp32_graphs["ort"]
    m = C.Manifest.read(folder)
    src = folder / "model.onnx"
    settings = quantize.WEIGHT_ONLY["int4"]
    # the earlier whole-model path: everything loaded, the head in a second pass at its own bits
    model = onnx.load(str(src))
    head = quantize.output_projection(model)
    for bits, exclude in ((settings.bits, [head]), (settings.head_bits, None)):
        q = MatMulNBitsQuantizer(model, bits=bits, block_size=settings.block_size, nodes_to_exclude=exclude,
                                 is_symmetric=settings.symmetric, accuracy_level=settings.accuracy_level,
                                 op_types_to_quantize=("MatMul",))
        q.process()
        model = q.model.model
    save_model(model, tmp_path / "whole.onnx", external=False)
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 1)  # one MatMul per pass
    rec = quantize.weight_only(src, tmp_path / "chunked.onnx", settings, external=True)
    assert rec["external_data"] == "chunked.onnx.data" and rec["head"] == head
    chunked = onnx.load(str(tmp_path / "chunked.onnx"))
    whole = onnx.load(str(tmp_path / "whole.onnx"))
    assert rec["quantized_matmuls"] == sum(n.op_type == "MatMulNBits" for n in whole.graph.node) == 4 * m.num_layers + 1
    arrays = lambda g: {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer}  # noqa: E731
    want, got = arrays(whole), arrays(chunked)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(_logits(tmp_path / "chunked.onnx", m, False), _logits(tmp_path / "whole.onnx", m, False))


def test_a_data_file_that_does_not_hold_a_tensor_is_refused_by_name(tmp_path):
    w = DataWriter(tmp_path / "w.data")
    t = w.tensor("big", np.arange(1024, dtype=np.float32))
    small = w.tensor("small", np.arange(4, dtype=np.float32))
    w.close()
    assert small.data_location == onnx.TensorProto.DEFAULT  # under EXTERNAL_MIN: inline
    np.testing.assert_array_equal(read_tensor(t, tmp_path), np.arange(1024, dtype=np.float32))
    (tmp_path / "w.data").write_bytes((tmp_path / "w.data").read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"w.data: initializer 'big' expects 4096 bytes of float32 at offset 0"):
        read_tensor(t, tmp_path)
    with pytest.raises(ValueError, match="closed"):
        w.tensor("late", np.zeros(1024, np.float32))

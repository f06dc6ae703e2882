"""An optimum export (concat-style cache, attention_mask) loads as an engine with a derived manifest.

The fixture was made by tests/fixtures/make_optimum_fixture.sh (optimum-cli export onnx --task
text-generation-with-past on a random tiny Llama) and ships transformers' logits for 12 ids.
"""
import shutil
from pathlib import Path

import numpy as np
import pytest

import edgespec
from edgespec import contract as C
from edgespec.backends.ort import OrtDecoder
from edgespec.backends.ort import OrtEngine

FIXTURE = Path(__file__).parent / "fixtures" / "optimum-tiny-llama"


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE / "reference.npz")


def test_manifest_is_derived_from_the_graph():
    m = OrtEngine(FIXTURE).manifest
    assert m.kind == "optimum" and m.num_layers == 2 and m.num_kv_heads == 2 and m.head_dim == 8
    assert m.vocab_size == 96 and m.max_context == 128 and m.eos_token_ids == [2]
    assert [t.name for t in m.inputs][:3] == [C.INPUT_IDS, C.OPTIMUM_ATTENTION_MASK, C.POSITION_IDS]


def test_prefill_matches_transformers(ref):
    d = OrtDecoder(OrtEngine(FIXTURE))
    np.testing.assert_allclose(d(ref["input_ids"]), ref["logits"], atol=1e-4)


def test_step_by_step_with_stale_rows_matches_transformers(ref):
    d = OrtDecoder(OrtEngine(FIXTURE))
    for j in range(len(d.cache.buffers)):  # garbage in every stale row: the mask must hide it
        d.cache.host(j)[...] = 7.0
    got = []
    for t in range(12):
        got.append(d(ref["input_ids"][:, t:t + 1])[:, 0].copy())
        d.cache.commit(1)
    np.testing.assert_allclose(np.stack(got, 1), ref["logits"], atol=1e-4)


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculative_decoding_on_an_optimum_engine_is_exact(draft):
    plain = edgespec.load(FIXTURE)
    gen = edgespec.load(FIXTURE, draft=FIXTURE if draft == "self" else "ngram", gamma=3)
    for p in ([5, 6, 7, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]):
        a, b = plain.generate(p, max_new_tokens=30), gen.generate(p, max_new_tokens=30)
        assert a.token_ids == b.token_ids
    assert b.stats.drafted > 0


def test_a_folder_that_is_neither_is_refused(tmp_path):
    shutil.copy(Path(__file__).parent / "fixtures" / "optimum-tiny-llama" / "config.json", tmp_path)
    import onnx
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), str(tmp_path / "model.onnx"))
    with pytest.raises(C.EngineError, match="not an optimum text-generation-with-past export"):
        OrtEngine(tmp_path)

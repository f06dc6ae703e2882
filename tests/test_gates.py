"""The parity gates judge precision, not rounding: their tolerance follows the logits' scale, and they still
refuse a wrong model. Each wrong model here is an engine exported from a checkpoint with one thing broken
(the rotary base, a bias, the window, the causal mask, Gemma's `1 + w` norms), judged against the reference
of the checkpoint it should compute."""
import json


import numpy as np
import pytest

from safetensors.numpy import load_file, save_file

from edgespec import masks
from edgespec.backends.ort import OrtEngine

from edgespec.export.onnx_export import export_engine
from edgespec.export.reference import ReferenceDecoder
from edgespec.export.validate import GateError, parity_gate, require, scaled_tolerance, verify_gate

CONTEXT = 48


def _copy(src, dst, config=None, tensors=None):
    """A copy of checkpoint src with config fields replaced and tensors changed by tensors(name, array)."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(src / "model.safetensors"))
    if tensors:
        w = {k: tensors(k, v) for k, v in w.items()}
    save_file(w, str(dst / "model.safetensors"))
    return dst


def _refused(wrong_ckpt, true_ckpt, tmp_path, flavor="portable"):
    """Export `wrong_ckpt` (its own gates pass: it is self-consistent), then gate it against the reference of
    `true_ckpt`: the parity gate must refuse it."""
    export_engine(wrong_ckpt, tmp_path / "wrong", max_context=CONTEXT, flavor=flavor, progress=False)
    engine = OrtEngine(tmp_path / "wrong")
    report = parity_gate(engine, ReferenceDecoder.from_pretrained(true_ckpt), CONTEXT)
    with pytest.raises(GateError, match="parity"):
        require("parity", report)
    return report


def test_a_correct_export_passes_against_its_own_reference(tiny_checkpoints, tmp_path):
    """The control for the refusals below: the same comparison on the right checkpoint passes."""
    path, _ = tiny_checkpoints["gemma3"]
    export_engine(path, tmp_path / "e", max_context=CONTEXT, progress=False)
    report = parity_gate(OrtEngine(tmp_path / "e"), ReferenceDecoder.from_pretrained(path), CONTEXT)
    require("parity", report)
    assert report["top1"]["disagree"] == 0 and report["top1"]["decisive_tokens"] > 0.9 * (4 + CONTEXT)


def test_the_tolerance_follows_the_logit_scale(tiny_checkpoints, tmp_path):
    """Logits of ~10^3 carry fp32 rounding of ~10^-4 in any correct engine: an absolute 1e-4 would refuse
    this export; 1e-4 x max |logit| passes it, and the same relative bound refuses a real error."""
    path, _ = tiny_checkpoints["llama"]
    big = _copy(path, tmp_path / "big", tensors=lambda k, v: v * 4000 if k == "lm_head.weight" else v)
    m = export_engine(big, tmp_path / "e", max_context=CONTEXT, progress=False)
    p = m.extra["validation"]["parity"]
    assert p["max_abs_logit"] > 1e3 and p["tolerance"] == pytest.approx(1e-4 * p["max_abs_logit"])
    assert 1e-4 < p["max_abs_diff"] <= p["tolerance"], p  # rounding above the old absolute gate, within the new
    assert m.extra["validation"]["verify"]["max_abs_diff"] <= m.extra["validation"]["verify"]["tolerance"]


def test_require_reads_the_scaled_tolerance():
    ok = {"max_abs_diff": 0.009, "tolerance": scaled_tolerance(100.0), "max_abs_logit": 100.0,
          "relative_tolerance": 1e-4, "top1": {"disagree": 0, "decisive_tokens": 10, "agreement": 1.0}}
    require("parity", ok)
    assert scaled_tolerance(0.3) == 1e-4  # small logits: never tighter than 1e-4 absolute
    with pytest.raises(GateError, match=r"1\.100e-02 > tolerance 1\.000e-02 \(1e-04 x max\(1, max \|logit\| 100\)\)"):
        require("parity", {**ok, "max_abs_diff": 0.011})
    with pytest.raises(GateError, match="top-1 differs on 2 of 10"):
        require("parity", {**ok, "top1": {"disagree": 2, "decisive_tokens": 10, "agreement": 0.8}})
    with pytest.raises(GateError, match="nan"):
        require("parity", {**ok, "max_abs_diff": float("nan")})


def test_a_wrong_rotary_base_is_refused(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["llama"]
    wrong = _copy(path, tmp_path / "ck", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    _refused(wrong, path, tmp_path)


def test_a_dropped_rope_scaling_is_refused(tiny_checkpoints, tmp_path):
    """Llama 3's rotary scaling read as the plain rotary of the same base."""
    path, _ = tiny_checkpoints["llama3-rope"]
    wrong = _copy(path, tmp_path / "ck", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    _refused(wrong, path, tmp_path)


def test_a_missing_bias_is_refused(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["qwen2"]
    wrong = _copy(path, tmp_path / "ck", tensors=lambda k, v: np.zeros_like(v) if k.endswith("k_proj.bias") else v)
    _refused(wrong, path, tmp_path, flavor="ort")


def test_a_dropped_sliding_window_is_refused(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["mistral-window"]
    _refused(_copy(path, tmp_path / "ck", {"sliding_window": None}), path, tmp_path)


def test_a_window_on_the_wrong_layers_is_refused(tiny_checkpoints, tmp_path):
    """Gemma 3 interleaves windowed and global layers: windowing every layer is a different model."""
    path, _ = tiny_checkpoints["gemma3"]
    wrong = _copy(path, tmp_path / "ck", {"layer_types": ["sliding_attention", "sliding_attention"]})
    _refused(wrong, path, tmp_path)


def test_gemmas_norm_offset_forgotten_is_refused(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["gemma3"]
    wrong = _copy(path, tmp_path / "ck", tensors=lambda k, v: v + 1 if k.endswith("norm.weight") else v)
    _refused(wrong, path, tmp_path)


def test_a_broken_causal_mask_is_refused(tiny_checkpoints, tmp_path, monkeypatch):
    """The runtime's mask lets each query see the next row (a future token): parity and verify refuse it."""
    path, _ = tiny_checkpoints["llama"]
    export_engine(path, tmp_path / "e", max_context=CONTEXT, progress=False)
    engine = OrtEngine(tmp_path / "e")
    real = masks.causal_bias

    def peeking(lengths, seq, rows, *a, **k):
        out = real(lengths, seq, rows, *a, **k)
        for b, n in enumerate(np.asarray(lengths)):
            for s in range(seq - 1):
                out[b, 0, s, n + s + 1] = 0.0
        return out
    monkeypatch.setattr(masks, "causal_bias", peeking)
    with pytest.raises(GateError):
        require("parity", parity_gate(engine, ReferenceDecoder.from_pretrained(path), CONTEXT))
    with pytest.raises(GateError):
        require("verify", verify_gate(engine, CONTEXT))

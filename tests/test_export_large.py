"""What real-size exports rely on, on tiny checkpoints: weights in an external data file beside the graph
(ONNX's protobuf stops at 2 GB), for fp32 and every variant; the checkpoint held in its own dtype; the peak
RSS recorded per stage; an export that would exceed its memory refused before any work."""
import json
import os

import numpy as np
import pytest

from edgespec.cli import main as cli_main
from edgespec.contract import EngineError
from edgespec.backends.ort import OrtEngine
from edgespec.export import memory
from edgespec.export.checkpoint import load_checkpoint
from edgespec.export.onnx_export import export_engine


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int4"])
@pytest.mark.parametrize("flavor", ["ort", "portable"])
def test_external_data_exports_load_and_match_inline(tiny_checkpoints, tmp_path, dtype, flavor):
    path, _ = tiny_checkpoints["qwen3"]
    kw = dict(max_context=48, flavor=flavor, progress=False, allow_lossy=True, dtype=dtype)
    ext = export_engine(path, tmp_path / "ext", external_data=True, **kw)
    inline = export_engine(path, tmp_path / "inline", external_data=False, **kw)
    assert ext.model_data_file == "model.onnx.data" and inline.model_data_file is None
    files = sorted(os.listdir(tmp_path / "ext"))
    native = ["native.npz"] if ext.extra["native"].get("file") else []  # the fp16 folder's native weights
    assert files == ["engine.json", "model.onnx", "model.onnx.data"] + native, files  # the fp32 graph is gone
    assert (tmp_path / "ext" / "model.onnx").stat().st_size < 64 * 1024  # the structure only
    assert ext.model_data_bytes == (tmp_path / "ext" / "model.onnx.data").stat().st_size
    ids = np.random.default_rng(0).integers(0, 96, size=(1, 20))
    a = np.array(OrtEngine(tmp_path / "ext").decoder()(ids))
    b = np.array(OrtEngine(tmp_path / "inline").decoder()(ids))
    np.testing.assert_array_equal(a, b)
    assert ext.extra["weight_bytes_per_token"] == inline.extra["weight_bytes_per_token"]


def test_a_missing_or_changed_data_file_is_refused_at_load(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["llama"]
    export_engine(path, tmp_path / "e", max_context=48, progress=False, external_data=True)
    data = tmp_path / "e" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="model.onnx.data: sha256 differs"):
        OrtEngine(tmp_path / "e")
    data.write_bytes(bytes(raw[:-8]))
    with pytest.raises(EngineError, match="model.onnx.data: .* bytes, but the manifest's model_data_bytes"):
        OrtEngine(tmp_path / "e")
    data.unlink()
    with pytest.raises(EngineError, match="model data file model.onnx.data .* is missing"):
        OrtEngine(tmp_path / "e")


def test_the_checkpoint_is_held_in_its_own_dtype(tmp_path):
    """A float16 checkpoint loads as float16 for the exporter (widened per tensor where used), float32 by
    default for everyone else."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(tmp_path)
    _, w16 = load_checkpoint(tmp_path, dtype=None)
    _, w32 = load_checkpoint(tmp_path)
    assert {a.dtype for a in w16.values()} == {np.dtype(np.float16)}
    assert {a.dtype for a in w32.values()} == {np.dtype(np.float32)}
    m = export_engine(tmp_path, tmp_path / "e", max_context=32, progress=False)
    assert m.extra["validation"]["parity"]["max_abs_diff"] <= m.extra["validation"]["parity"]["tolerance"]


def test_peak_memory_is_recorded_per_stage(tiny_checkpoints, tmp_path):
    m = export_engine(tiny_checkpoints["llama"][0], tmp_path / "e", max_context=48, dtype="fp16", progress=False)
    em = m.extra["export_memory"]
    stages = em["peak_rss_after_stage"]
    assert list(stages)[:2] == ["load checkpoint", "graph"] and "parity gate" in stages and "fp16 variant written" in stages
    assert list(stages.values()) == sorted(stages.values())  # a high-water mark never goes down
    assert em["peak_rss_bytes"] >= max(stages.values()) > 0
    assert em["estimate_bytes"]["parameters"] == m.extra["parameters"] > 0


def test_an_export_that_cannot_fit_is_refused_before_any_work(tiny_checkpoints, tmp_path, capsys):
    path, _ = tiny_checkpoints["llama"]
    with pytest.raises(memory.ExportMemoryError) as e:
        export_engine(path, tmp_path / "e", progress=False, max_memory=1 << 20)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "expected at most 0.0 GiB (--max-memory)" in msg
    assert os.listdir(tmp_path) == []  # nothing staged
    assert cli_main(["export", str(path), "--out", str(tmp_path / "e"), "--max-memory", "0.001", "--quiet"]) == 2
    assert "needs about" in capsys.readouterr().err


def test_the_estimate_counts_each_stage(tiny_checkpoints):
    from edgespec.export.checkpoint import ModelSpec
    spec = ModelSpec.from_config(json.loads((tiny_checkpoints["llama"][0] / "config.json").read_text()))
    n = sum(int(np.prod(s)) for s in spec.checkpoint_shapes().values())
    fp16 = memory.estimate(spec, 2 * n, "fp16")
    assert fp16["parameters"] == n and fp16["checkpoint_bytes"] == 2 * n
    # the native weights take the checkpoint's tensors over as they are made: the checkpoint (2 N) beside the
    # embedding, the head and one layer packed, never beside the whole packed copy
    outside = sum(int(np.prod(s)) for k, s in spec.checkpoint_shapes().items() if not k.startswith("model.layers."))
    one_layer = (n - outside) / spec.num_layers
    assert 0 < outside < n and one_layer > 0
    native = int(2 * n + 2 * (outside + one_layer))
    # the checkpoint is not held beside the fp32 session: the gates hold 4 N
    assert fp16["stages_bytes"] == {"graph": 2 * n, "gates": 4 * n, "variant": int(4.6 * n), "native": native}
    assert fp16["largest_stage"] == "variant" and native < 4 * n
    assert fp16["total_bytes"] == int(4.6 * n) + memory.MARGIN_BYTES
    int4 = memory.estimate(spec, 2 * n, "int4")
    assert int4["largest_stage"] == "gates"
    assert int4["stages_bytes"]["native"] == int(2 * n + 0.6 * (outside + one_layer))
    fp32 = memory.estimate(spec, 2 * n, "fp32")  # its exact native copy is gated against the fp32 session, alone
    assert fp32["largest_stage"] == "native" and fp32["largest_stage_bytes"] == 6 * n
    assert memory.estimate(spec, 10 * n, "fp16")["checkpoint_bytes"] == 4 * n  # an odd file size: bf16 widened


def test_a_bf16_checkpoint_reads_without_torch_as_its_exact_float32_values(tmp_path):
    import torch
    from safetensors.torch import save_file

    from edgespec.export.checkpoint import read_safetensors
    t = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7).half(), "c": torch.arange(4)}
    save_file(t, str(tmp_path / "m.safetensors"))
    got = read_safetensors(tmp_path / "m.safetensors")
    assert got["a"].dtype == np.float32 and np.array_equal(got["a"], t["a"].float().numpy())
    assert got["b"].dtype == np.float16 and np.array_equal(got["b"], t["b"].numpy())
    assert np.array_equal(got["c"], t["c"].numpy())
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="do not hold|ends inside"):
        read_safetensors(tmp_path / "cut.safetensors")

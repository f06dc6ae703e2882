"""tools/device/cuda_check.py (the GPU check of provider cuda-native) run end to end on the CPU: a tiny float16
model as the source, the stand-in runtime (tests/cuda_standin.py) in place of the GPU, PyTorch on the CPU. What it
checks is the script: the models it makes, the engines it builds in memory, every step's record and the summary;
the numbers are the GPU run's."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import char_tokenizer_json
from cuda_standin import StandIn

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("the stand-in runs native_step.c, compiled with a C compiler; none here", allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _check_module():
    spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "tools" / "device" / "cuda_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cuda_check"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    out = tmp_path_factory.mktemp("src")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   eos_token_id=95)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.normal_(0, 0.2).half().float())
    model.save_pretrained(out, safe_serialization=True)
    char_tokenizer_json(out / "tokenizer.json")
    return out


def test_the_check_runs_every_step_and_keeps_the_other_keys_of_its_file(tiny_source, tmp_path, monkeypatch, capsys):
    from conftest import make_f16_policy

    from edgespec.backends import cuda_native
    mod = _check_module()
    rt = StandIn()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)  # the policies' engines
    policy = make_f16_policy(tmp_path / "policy")
    monkeypatch.setattr(mod, "open_runtime", lambda lib, work, data: rt)
    out = tmp_path / "device.json"
    out.write_text(json.dumps({"paths": {"cuda": {"unavailable": "no onnxruntime-gpu"}}}))
    rc = mod.main(["--smoke", "--models", "tiny", "--source", str(tiny_source), "--prompts", "2", "--out", str(out),
                   "--key", "cuda_native", "--work", str(tmp_path / "work"), "--vla", str(policy)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["paths"] == {"cuda": {"unavailable": "no onnxruntime-gpu"}}  # device_setup's record, kept
    r = doc["cuda_native"]["models"]["tiny"]
    errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert r["parity"]["top1_agreement"] == 1.0 and r["parity"]["max_logit_diff"] == 0.0  # the stand-in is exact
    assert r["spec_equals_plain"]["identical"] is True
    for mode in ("plain", "plain_no_graphs", "speculative", "speculative_draft_on_cpu"):
        assert r["speed"][mode]["tokens"] > 0 and r["speed"][mode]["tokens_per_s"] > 0
    assert 0 <= r["speed"]["speculative"]["acceptance"] <= 1
    assert r["torch"]["torch_eager"]["tokens_per_s"] > 0 and "skipped" in r["torch"]["torch_cuda_graphs"]
    assert set(r["kernels"]) >= {"S=1", "S=5"}  # the stand-in has no kernels: empty breakdowns, but the calls ran
    assert r["weight_bytes"] > 0 and r["draft_weight_bytes"] > 0
    v = doc["cuda_native"]["vla"]
    assert "error" not in v, v
    assert v["actions_identical"] == {"head": "4/4", "decoder": "4/4"} and v["decode_ms_median"]["plain"] > 0
    shown = capsys.readouterr().out
    assert "tiny: parity top-1 1.0" in shown and "spec==plain True" in shown


def test_the_draft_is_a_seeded_float16_perturbation(tiny_source, tmp_path):
    mod = _check_module()
    from safetensors.numpy import load_file
    a = mod.noisy_copy(tiny_source, tmp_path / "a")
    b = mod.noisy_copy(tiny_source, tmp_path / "b")
    wa, wb, w = (load_file(str(d / "model.safetensors")) for d in (a, b, tiny_source))
    k = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(wa[k], wb[k]) and not np.array_equal(wa[k], w[k])
    assert np.array_equal(wa[k].astype(np.float16).astype(wa[k].dtype), wa[k])  # exactly float16 values
    rel = np.abs(wa[k] - w[k]) / np.maximum(np.abs(w[k]), 1e-6)
    assert 0.1 < float(np.median(rel)) / mod.DRAFT_NOISE < 1.0  # |N(0,1)| has median 0.67

"""A VLA policy (inputs_embeds decoders) on the native providers: the export writes native.npz for its target and
draft, and cpu-native and cuda-native (on the stand-in runtime) decode the same actions as ONNX Runtime's CPU
provider, speculative equal to plain."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import assert_fast_path_matches_reference, make_f16_policy, policy_obs
from cuda_standin import StandIn

import edgespec
from edgespec.backends import cuda_native

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("the native step is compiled with a C compiler; none here", allow_module_level=True)
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def f16_policy(tmp_path_factory):
    return make_f16_policy(tmp_path_factory.mktemp("f16policy"))


def test_the_policy_decoders_carry_native_weights(f16_policy):
    for part in ("target", "draft"):
        m = json.loads((f16_policy / part / "engine.json").read_text())
        assert m["input_mode"] == "embeds"
        native = m["extra"]["native"]
        assert native.get("file") == "native.npz", native
        assert native["gate"]["passed"] and native["gate"]["ids_agree"] == native["gate"]["ids"]


@pytest.mark.parametrize("provider", ["cpu-native", "cuda-native"])
def test_a_policy_decodes_the_same_actions_on_a_native_provider(f16_policy, provider, monkeypatch):
    rt = StandIn()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)
    ref = edgespec.load_policy(f16_policy, draft=True, provider="cpu")
    pol = edgespec.load_policy(f16_policy, draft=True, provider=provider)
    assert pol.target.caps.embeds and type(pol.target).__name__ != type(ref.target).__name__
    for seed in range(3):
        obs = policy_obs(seed)
        np.testing.assert_array_equal(pol.act(*obs), ref.act(*obs))
    assert_fast_path_matches_reference(pol, range(3))  # speculative (the draft decoder) equals plain
    if provider == "cuda-native":
        assert ("capture", 1) in rt.log or any(kind == "capture" for kind, _ in rt.log)


def test_cuda_native_and_cpu_native_agree_bit_for_bit_on_a_policy(f16_policy, monkeypatch):
    rt = StandIn()
    monkeypatch.setattr(cuda_native, "runtime", lambda device_id=0: rt)
    cpu = edgespec.load_policy(f16_policy, draft=True, provider="cpu-native")
    gpu = edgespec.load_policy(f16_policy, draft=True, provider="cuda-native")
    pre = cpu.encode(*policy_obs(7))
    a, ai = cpu.decode_ids(pre)
    b, bi = gpu.decode_ids(pre)
    assert a == b and ai["accepted"] == bi["accepted"]
    assert np.array_equal(cpu.target.last_logits(), gpu.target.last_logits())

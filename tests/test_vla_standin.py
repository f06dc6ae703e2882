"""export/vla_standin.py: a real-shape stand-in of an edgespec-vla/1 policy model folder computes the source policy
(the bundled 256-bin reacher policy here; a FAST policy with its feature head in test_fast_policy.py), and refuses a
folder that is not one by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "vla-reacher"


def test_widened_encoder_writes_the_sources_prefix_then_zeros():
    from edgespec.export.vla import example_inputs, load_encoder
    from edgespec.export.vla_model import VLAConfig, build_encoder
    from edgespec.export.vla_standin import widen_encoder
    from safetensors.torch import load_file
    enc, policy, cfg = load_encoder(BUNDLED)
    wide_cfg = VLAConfig.from_dict({**policy["config"], "hidden": 320, "heads": 5})
    wide = build_encoder(wide_cfg)
    state = widen_encoder(load_file(str(BUNDLED / "encoder.safetensors")), cfg.img_tokens, 256, 320)
    wide.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    wide.eval()
    with torch.no_grad():
        for img, st, instr in example_inputs(policy, 3, seed=2):
            args = (torch.from_numpy(img), torch.from_numpy(st), torch.from_numpy(instr))
            a, b = enc(*args), wide(*args)  # (1, P, 256), (1, P, 320)
            torch.testing.assert_close(b[..., :256], a, rtol=0, atol=1e-6)  # matmuls of another width round apart
            assert torch.count_nonzero(b[..., 256:]) == 0


def test_a_bins_policy_standin_acts_as_its_source(tmp_path):
    """The bundled bins policy inflated (wider stream, more heads, layers and MLP channels): the same actions and the
    same target calls plain, with its widened draft decoder and with its widened per-dimension draft head (which reads
    the whole prefix, P x E)."""
    from edgespec import load_policy
    from edgespec.export.standin import Shape
    from edgespec.export.vla import export_policy
    from edgespec.export.vla_standin import make_vla_standin
    rec = make_vla_standin(BUNDLED, tmp_path / "big", shape=Shape(512, 8, 4, 64, 768, 5), progress=False)
    assert rec["target"]["params"] > 1.5 * json.loads((BUNDLED / "train.json").read_text())["params"]["target"]
    cfg = json.loads((tmp_path / "big" / "policy.json").read_text())["config"]
    assert (cfg["hidden"], cfg["heads"], cfg["target_layers"]) == (512, 8, 5)
    export_policy(BUNDLED, tmp_path / "e-small", progress=False)
    export_policy(tmp_path / "big", tmp_path / "e-big", progress=False)
    rng = np.random.default_rng(3)
    for kw in ({}, {"draft": True, "gamma": 4}, {"draft": "head"}):
        small, big = load_policy(tmp_path / "e-small", **kw), load_policy(tmp_path / "e-big", **kw)
        assert big.target.m.hidden_size == 512
        for instr in ("reach the red target", "go to the blue target"):
            img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            state = rng.normal(0, 1, 6)
            np.testing.assert_array_equal(big.act(img, state, instr), small.act(img, state, instr))
            assert big.last_info["target_calls"] == small.last_info["target_calls"], kw


def test_what_is_not_a_policy_model_folder_is_refused(tmp_path):
    from edgespec.export.standin import StandinError
    from edgespec.export.vla_standin import make_vla_standin
    with pytest.raises(StandinError, match="expected a policy model folder"):
        make_vla_standin(tmp_path, tmp_path / "out")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "policy.json").write_text(json.dumps({"format": "openvla"}))
    with pytest.raises(StandinError, match="format: expected 'edgespec-vla/1'.*got 'openvla'"):
        make_vla_standin(tmp_path / "src", tmp_path / "out")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    shutil.copytree(BUNDLED, tmp_path / "bundled")
    with pytest.raises(ValueError, match="expected an empty folder or an earlier stand-in"):
        make_vla_standin(tmp_path / "bundled", keep, shape={"hidden_size": 256, "num_attention_heads": 4,
                                                              "num_key_value_heads": 4, "head_dim": 64,
                                                              "intermediate_size": 512, "num_hidden_layers": 4})
    assert (keep / "notes.txt").read_text() == "mine"

"""train_openvla.py end to end on a few synthetic demonstrations (2 steps): it writes an OpenVLA-layout checkpoint
the importer reads, a draft that carries the target's embedding table (what it was trained to read), and a
hidden-state draft head; the folder exports with --horizon and both drafts, and speculative decoding equals plain."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_train_openvla_writes_an_importable_policy(tmp_path):
    from safetensors.torch import load_file

    from edgespec import load_policy
    from edgespec.draft_head import DraftHeadWeights
    from edgespec.export.openvla import export_openvla
    from edgespec.export.prismatic import read_checkpoint
    from edgespec.export.training.train_openvla import main

    rng = np.random.default_rng(0)
    n = 48
    words = np.array(["reach the red target", "go to the blue target", "touch the green target"])
    demos = tmp_path / "demos.npz"
    np.savez(demos, image=rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8),
             state=rng.normal(0, 1, (n, 6)).astype(np.float32), instruction=words[np.arange(n) % 3],
             chunk=rng.uniform(-0.2, 0.2, (n, 8, 2)).astype(np.float32),
             goal=rng.uniform(-0.2, 0.2, (n, 2)).astype(np.float32), episode=np.arange(n) // 8,
             horizon=np.int64(8), noise_std=np.float64(0.01), noisy_every=np.int64(2))
    out = tmp_path / "model"
    assert main(["--train", str(demos), "--val", str(demos), "--out", str(out), "--work", str(tmp_path / "work"),
                 "--steps", "2", "--batch", "8", "--head-steps", "2", "--threads", "1"]) == 0
    ck = read_checkpoint(out / "target")
    assert (ck.n_image_tokens, ck.llm_dim, ck.vits[0].pos_prefix, ck.fused) == (16, 256, True, False)
    assert len(ck.norm_stats["reacher"]["action"]["q01"]) == 16  # 8 steps x 2 dims, repeated per step
    target = load_file(str(out / "target" / "model.safetensors"))["language_model.model.embed_tokens.weight"]
    draft = load_file(str(out / "draft" / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(draft.float(), target.float())
    assert DraftHeadWeights.load(out / "draft_head.npz").ctx_w.shape[0] == 256
    meta = export_openvla(out / "target", tmp_path / "engine", horizon=8, draft=out / "draft",
                          draft_head=out / "draft_head.npz", action_names=["fingertip.x", "fingertip.y"],
                          action_units=["m", "m"], action_kind="cartesian_position", progress=False)
    assert (meta["horizon"], meta["dims"]) == (8, 2) and meta["end_to_end_gate"]["passed"]
    plain = load_policy(tmp_path / "engine")
    img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    want = plain.act(img, None, "reach the red target")
    assert want.shape == (8, 2)
    for draft_kind in (True, "head"):
        np.testing.assert_array_equal(load_policy(tmp_path / "engine", draft=draft_kind).act(
            img, None, "reach the red target"), want)
    # the same command again: the finished run is kept, with what was added to its folder since (a feature head)
    (out / "feature_head.npz").write_bytes(b"added later")
    before = (out / "draft_head.npz").stat().st_mtime_ns
    assert main(["--train", str(demos), "--val", str(demos), "--out", str(out), "--work", str(tmp_path / "work"),
                 "--steps", "2", "--batch", "8", "--head-steps", "2", "--threads", "1"]) == 0
    assert (out / "feature_head.npz").read_bytes() == b"added later"
    assert (out / "draft_head.npz").stat().st_mtime_ns == before

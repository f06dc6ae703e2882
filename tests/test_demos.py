"""robots/demos.py: the reacher's training data and closed-loop evaluation, and the export side reading that
data (train_vla.load_demos / main, train_draft_head.load_data / main) without importing the simulator.

Needs mujoco + gymnasium (the robots extra) and an offscreen GL (MUJOCO_GL=osmesa), like test_reacher.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec.policy import instruction_ids, load_policy
from edgespec.robots import demos
from edgespec.robots.reacher import EPISODE_STEPS, expert_chunk


@pytest.fixture(scope="module")
def expert_files(tmp_path_factory):
    """Tiny train (seeds 0..3) and val (500000..500001) files through the command, one worker."""
    work = tmp_path_factory.mktemp("expert")
    assert demos.main(["expert", "--work", str(work), "--episodes", "4", "--val-episodes", "2",
                       "--workers", "1"]) == 0
    return demos.expert_file(work, "train", 4), demos.expert_file(work, "val", 2)


def test_expert_file_holds_clean_labels_from_the_states_reached(expert_files):
    d = dict(np.load(expert_files[0]))
    n = 4 * EPISODE_STEPS
    assert d["image"].shape == (n, 64, 64, 3) and d["image"].dtype == np.uint8
    assert d["state"].shape == (n, 6) and d["chunk"].shape == (n, 8, 2) and d["goal"].shape == (n, 2)
    assert d["instruction"].shape == (n,) and d["instruction"].dtype.kind == "U"
    assert d["episode"].tolist() == [s for s in range(4) for _ in range(EPISODE_STEPS)]
    assert (int(d["horizon"]), float(d["noise_std"]), int(d["noisy_every"])) == (8, 0.01, 2)
    for i in range(0, n, 7):  # the label is the expert's chunk from the fingertip actually reached
        want = expert_chunk(d["state"][i, 4:6].astype(np.float64), d["goal"][i].astype(np.float64), 8)
        np.testing.assert_allclose(d["chunk"][i], want, atol=1e-6)


def test_only_noisy_seeds_execute_noise_and_episodes_are_reproducible():
    quiet, loud = demos.expert_episodes([1, 2], noise_std=0.0), demos.expert_episodes([1, 2], noise_std=0.05)
    odd, even = quiet["episode"] == 1, quiet["episode"] == 2
    for k in ("image", "state", "chunk", "goal"):  # seed 1 is clean whatever the noise; seed 2 is noisy
        np.testing.assert_array_equal(quiet[k][odd], loud[k][odd])
    assert not np.array_equal(quiet["state"][even], loud["state"][even])
    again = demos.expert_episodes([2, 1], noise_std=0.05)  # an episode depends on its seed only
    for k in ("image", "state", "chunk", "goal"):
        np.testing.assert_array_equal(again[k][again["episode"] == 2], loud[k][even])


def test_an_existing_file_is_kept(expert_files):
    before = expert_files[1].stat().st_mtime_ns
    assert demos.write_expert(expert_files[1], np.arange(500_000, 500_002), workers=1) == expert_files[1]
    assert expert_files[1].stat().st_mtime_ns == before


def test_train_vla_reads_the_file_as_word_ids(expert_files, tmp_path):
    from edgespec.export.training.train_vla import load_demos
    from edgespec.export.vla_model import WORDS
    d = load_demos(expert_files[0], 6)
    want = np.stack([instruction_ids(str(s), WORDS, 6) for s in d["instruction"]])
    assert d["instr"].dtype == want.dtype and np.array_equal(d["instr"], want)
    with pytest.raises(FileNotFoundError, match="robots.demos expert"):
        load_demos(tmp_path / "missing.npz", 6)
    np.savez(tmp_path / "old.npz", image=d["image"], instr=d["instr"])
    with pytest.raises(ValueError, match=r"not an expert demonstrations file.*'instruction'"):
        load_demos(tmp_path / "old.npz", 6)


@pytest.mark.slow
def test_train_vla_trains_from_the_files_and_records_where_they_came_from(expert_files, tmp_path):
    from edgespec.export.training.train_vla import VLAConfig, main
    out = tmp_path / "model"
    assert main(["--train", str(expert_files[0]), "--val", str(expert_files[1]), "--out", str(out),
                 "--work", str(tmp_path / "work"), "--threads", "1"]) == 0
    policy = json.loads((out / "policy.json").read_text())
    cfg = VLAConfig.from_dict(policy["config"])
    assert (cfg.episodes, cfg.val_episodes, cfg.horizon, cfg.noise_std) == (4, 2, 8, 0.01)
    report = json.loads((out / "train.json").read_text())
    assert report["train_samples"] == 4 * EPISODE_STEPS and report["data"]["train"] == str(expert_files[0])
    assert report["fast_fit"] is None  # a bins policy has no FAST tokenizer
    assert (out / "encoder.safetensors").is_file() and (out / "target" / "config.json").is_file()


def test_train_vla_fast_records_the_tokenizer_fit(expert_files, tmp_path):
    """A FAST policy's train.json keeps its tokenizer's fit: tokens per chunk and the round-trip error with its
    bound (fast_tokens.FitReport), so the bound is on file beside the policy, not only printed."""
    from edgespec.export.training.train_vla import main
    out = tmp_path / "fast"
    assert main(["--train", str(expert_files[0]), "--val", str(expert_files[1]), "--out", str(out), "--work",
                 str(tmp_path / "work-fast"), "--threads", "1", "--actions", "fast", "--fast-vocab", "300"]) == 0
    fit = json.loads((out / "train.json").read_text())["fast_fit"]
    assert fit["chunks"] == 4 * EPISODE_STEPS and 1 <= fit["tokens_per_chunk_mean"] <= fit["tokens_per_chunk_max"]
    assert 0 <= fit["max_abs_error"] <= fit["error_bound"]


def test_bundled_policy_config_still_loads():
    """The bundled model's policy.json holds a retired key (eval_episodes): it must still load."""
    from pathlib import Path

    from edgespec.export.training.train_vla import VLAConfig
    meta = json.loads((Path(__file__).resolve().parents[1] / "models" / "vla-reacher" / "policy.json").read_text())
    assert "eval_episodes" in meta["config"]
    assert VLAConfig.from_dict(meta["config"]).episodes == meta["config"]["episodes"]


def test_on_policy_rows_are_the_policys_plain_greedy_ids(tiny_reacher_policy):
    d = demos.on_policy_episodes(tiny_reacher_policy, [3])
    pol = load_policy(tiny_reacher_policy)
    assert d["prefix"].dtype == np.float16 and d["prefix"].shape[:2] == (EPISODE_STEPS, pol.prefix_len)
    assert d["ids"].shape == (EPISODE_STEPS, pol.horizon * pol.dims) and (d["episode"] == 3).all()
    env = demos.ThreeTargetReacher()
    env_obs = env.reset(seed=3)
    env.close()
    pre = pol.encode(env_obs["image"], env_obs["state"], env_obs["instruction"])
    assert d["ids"][0].tolist() == pol.decode_ids(pre, use_draft=False)[0]
    np.testing.assert_array_equal(d["prefix"][0], pre[0].astype(np.float16))


@pytest.mark.slow
def test_on_policy_blocks_feed_the_draft_head_training(tiny_reacher_policy, tmp_path, capsys):
    from edgespec.export.training.train_draft_head import load_data, main
    paths = demos.write_on_policy(tiny_reacher_policy, tmp_path, episodes=4, workers=1, block=2)
    key = demos.policy_key(tiny_reacher_policy)
    assert [p.name for p in paths] == [f"draft-head-data-{key}-700000-2.npz", f"draft-head-data-{key}-700002-2.npz"]
    mtime = paths[0].stat().st_mtime_ns
    assert demos.write_on_policy(tiny_reacher_policy, tmp_path, episodes=2, workers=1, block=2) == paths[:1]
    assert paths[0].stat().st_mtime_ns == mtime  # reused, not collected again
    pol = load_policy(tiny_reacher_policy)
    data = load_data(paths[::-1], pol.prefix_len, pol.horizon * pol.dims, 256)  # any order -> seed order
    assert data["episode"].tolist() == [s for s in range(700_000, 700_004) for _ in range(EPISODE_STEPS)]
    with pytest.raises(ValueError, match="comes from another policy"):
        load_data(paths, pol.prefix_len + 1, pol.horizon * pol.dims, 256)
    with pytest.raises(FileNotFoundError, match="robots.demos on-policy"):
        load_data([tmp_path / "missing.npz"], pol.prefix_len, pol.horizon * pol.dims, 256)
    out = tmp_path / "model"
    assert main(["--policy", str(tiny_reacher_policy), "--data", *map(str, paths), "--out", str(out),
                 "--epochs", "1", "--batch", "32", "--hidden", "16", "--radius", "4", "--threads", "1"]) == 0
    report = json.loads((out / "draft_head.json").read_text())
    assert report["episodes"] == 4 and report["chunks"] == 4 * EPISODE_STEPS and (out / "draft_head.npz").is_file()


def test_closed_loop_replans_every_execute_steps_and_scores_success():
    calls = []

    def hold(obs):  # stay where the fingertip is: never reaches a target
        calls.append(1)
        return np.tile(obs["state"][4:6], (8, 1))
    res = demos.closed_loop(hold, [5, 6], execute=4)
    assert (res["success"], res["episodes"]) == (0.0, 2) and res["mean_return"] < 0
    assert len(calls) == 2 * EPISODE_STEPS // 4


def test_eval_command_prints_the_result_and_its_command(tiny_reacher_policy, capsys):
    argv = ["eval", "--policy", str(tiny_reacher_policy), "--episodes", "1", "--execute", "8"]
    assert demos.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["episodes"] == 1 and 0.0 <= got["success"] <= 1.0 and got["seed0"] == demos.EVAL_SEED0
    assert got["command"] == "python -m edgespec.robots.demos " + " ".join(argv)

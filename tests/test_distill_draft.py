"""export/training/distill_draft.py: a draft fine-tuned on the target's greedy choices over train_attn_head's cached
code windows agrees with them more often, is saved as a checkpoint like its source, and reports acceptance before
and after; the windows it reads are found by key and a wrong folder is refused."""
import json

import numpy as np
import pytest

from edgespec.export.training import distill_draft as D
from edgespec.export.training import train_attn_head as T


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    work = tmp_path_factory.mktemp("windows")
    assert T.main(["--target", "models/demo-target", "--windows", "code", "--code-context", "24", "--out",
                   str(work / "h.npz"), "--work", str(work), "--train-seqs", "32", "--val-seqs", "4", "--seq-len", "48",
                   "--hidden", "32", "--heads", "2", "--epochs", "1", "--quiet", "--threads", "2"]) == 0
    return work


def test_the_distilled_draft_follows_the_targets_greedy_choices_more_often(windows, tmp_path):
    out = tmp_path / "d"
    assert D.main(["--draft", "models/demo-draft", "--windows", str(windows), "--out", str(out), "--epochs", "4",
                   "--batch", "8", "--lr", "2e-3", "--quiet", "--threads", "2"]) == 0
    r = json.loads((out / "distill.json").read_text())
    assert r["after"]["train_agreement"] > r["before"]["train_agreement"] + 0.02
    assert len(r["after"]["tokens_per_round_by_gamma"]) == 6 and r["train_windows"] == 32
    assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())["dtype"] == "float16"
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    data = D.load_blocks(D.window_blocks(windows)[0])
    # the saved float16 weights give (nearly) the agreement measured before saving
    assert abs(D.agreement(D.greedy_table(model, data["ids"]), data["greedy"]) - r["after"]["train_agreement"]) < 0.02


def test_window_blocks_are_found_by_key_and_a_folder_without_one_is_refused(windows, tmp_path):
    train, val, key = D.window_blocks(windows)
    assert key.startswith("code24-") and len(train) == 2 and len(val) == 1
    with pytest.raises(ValueError, match="found 0 keys"):
        D.window_blocks(tmp_path)
    for split in ("train", "val"):
        np.savez(tmp_path / f"{split}-other-0000.npz", ids=np.zeros((1, 4), np.int64))
        np.savez(tmp_path / f"{split}-more-0000.npz", ids=np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="found 2 keys: more, other; pick one with --key"):
        D.window_blocks(tmp_path)
    assert D.window_blocks(tmp_path, "other")[2] == "other"
    with pytest.raises(ValueError, match="no train and val windows for key 'none'"):
        D.window_blocks(tmp_path, "none")
    assert D.main(["--windows", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet"]) == 2


def test_settings_are_checked():
    with pytest.raises(ValueError, match="lr must be > 0"):
        D.DistillConfig(lr=0)

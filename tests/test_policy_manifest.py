"""policy.json at load: its state/action semantics, one clear error for a malformed field, and the content
hash that refuses a policy.json or action_stats.json edited after export."""
from __future__ import annotations

import json
import shutil

import pytest

from edgespec.export.vla_model import REACHER_SEMANTICS
from edgespec.policy_contract import CONTENT_HASH, PolicyFileError
from edgespec.policy import Policy, load_policy


def copy_policy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit(folder, change) -> None:
    meta = json.loads((folder / "policy.json").read_text())
    change(meta)
    (folder / "policy.json").write_text(json.dumps(meta, indent=2))


def manifest_only(src, dst):
    """A folder with just policy.json (and action_stats.json): load reads and checks these before any engine."""
    dst.mkdir()
    for name in ("policy.json", "action_stats.json"):
        shutil.copy2(src / name, dst / name)
    return dst


def test_semantics_are_attributes(tiny_reacher_policy):
    pol = load_policy(tiny_reacher_policy)
    for name, value in REACHER_SEMANTICS.items():
        assert getattr(pol, name) == value, name
    assert len(pol.state_names) == pol.state_dim and len(pol.action_names) == pol.dims


def _set(key, value):
    def change(meta):
        meta[key] = value
    return change


def _drop(key):
    def change(meta):
        del meta[key]
    return change


@pytest.mark.parametrize("change, match", [
    (_set("horizon", "eight"), r"horizon: expected an integer > 0, got 'eight'"),
    (_drop("words"), r"words: expected distinct strings, the first \"<pad>\" \(or a prompt\), got None"),
    (_set("words", ["<pad>", "reach", "reach"]), r"words: expected distinct strings"),
    (_set("state_names", ["a", "b"]), r"state_names: expected 6 \(state_dim\) distinct non-empty strings"),
    (_set("action_names", ["fingertip.x", "fingertip.x"]), r"action_names: expected 2 \(dims\) distinct"),
    (_set("action_units", "m"), r"action_units: expected 2 \(dims\) strings, got 'm'"),
    (_set("action_kind", "torque"), r"action_kind: expected one of \('cartesian_position', 'joint_position', "
                                    r"'cartesian_delta'\)"),
    (_drop("embodiment"), r"missing fields \['embodiment'\] \(an export older than policy.json's state/action"),
    (_set("binary_dims", [5]), r"binary_dims: expected distinct action dimensions in \[0, 2\)"),
    (_set("binary_dims", [[0]]), r"binary_dims: expected distinct action dimensions in \[0, 2\), got \[\[0\]\]"),
    (_set("dims", True), r"dims: expected an integer > 0, got True"),
])
def test_malformed_policy_json_gets_one_clear_error(tiny_reacher_policy, tmp_path, change, match):
    d = manifest_only(tiny_reacher_policy, tmp_path / "p")
    edit(d, change)
    with pytest.raises(PolicyFileError, match=match) as e:
        load_policy(d)
    assert str(d / "policy.json") in str(e.value)


@pytest.mark.parametrize("text, match", [("{", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_policy_json_that_is_not_an_object_gets_one_clear_error(tiny_reacher_policy, tmp_path, text, match):
    d = manifest_only(tiny_reacher_policy, tmp_path / "p")
    (d / "policy.json").write_text(text)
    with pytest.raises(PolicyFileError, match=match):
        load_policy(d)


def test_swapped_instruction_words_are_refused(tiny_reacher_policy, tmp_path):
    """Swapping "red" and "blue" would make the robot reach for the other target."""
    d = copy_policy(tiny_reacher_policy, tmp_path / "p")

    def swap(meta):
        w = meta["words"]
        i, j = w.index("red"), w.index("blue")
        w[i], w[j] = w[j], w[i]
    edit(d, swap)
    with pytest.raises(PolicyFileError, match=r"policy.json was edited after export .* re-export"):
        load_policy(d)
    assert Policy(d, check_hashes=False).words != load_policy(tiny_reacher_policy).words  # opt-out: loads


def test_edited_action_statistics_are_refused(tiny_reacher_policy, tmp_path):
    d = copy_policy(tiny_reacher_policy, tmp_path / "p")
    stats = json.loads((d / "action_stats.json").read_text())
    stats["q99"][0] *= 2  # the actions would span twice the range
    (d / "action_stats.json").write_text(json.dumps(stats))
    with pytest.raises(PolicyFileError, match=r"action_stats.json was edited after export"):
        load_policy(d)


def test_a_policy_exported_without_content_hash_says_re_export(tiny_reacher_policy, tmp_path):
    d = manifest_only(tiny_reacher_policy, tmp_path / "p")
    edit(d, _drop(CONTENT_HASH))
    with pytest.raises(PolicyFileError, match=r"has no content_sha256 .* re-export it with `edgespec export-policy"):
        load_policy(d)


# -- ensure_policy_engines re-exports what is stale -------------------------------------------------------------
def fake_folders(tmp_path, tiny_reacher_policy):
    """models/NAME (a policy.json) and engines/NAME (the export's policy.json), nothing else."""
    src, eng = tmp_path / "models" / "p", tmp_path / "engines" / "p"
    meta = json.loads((tiny_reacher_policy / "policy.json").read_text())
    model = {k: v for k, v in meta.items() if k not in (CONTENT_HASH, "encoder_file", "encoder_sha256",
                                                         "encoder_gate", "precision", "action_stats_sha256",
                                                         "draft_head_sha256")}
    src.mkdir(parents=True)
    eng.mkdir(parents=True)
    (src / "policy.json").write_text(json.dumps(model))
    (eng / "policy.json").write_text(json.dumps(meta))
    return src, eng


@pytest.mark.parametrize("change, stale", [
    (None, False),
    (_drop(CONTENT_HASH), True),  # exported before the content hash
    (_drop("action_names"), True),  # exported before the semantics
    (_set("embodiment", "another-arm"), True),  # the model's semantics changed since
])
def test_ensure_policy_engines_re_exports_stale_folders(tiny_reacher_policy, tmp_path, monkeypatch, change, stale):
    import edgespec.export.vla as vla
    from edgespec.export.bundled import ensure_policy_engines
    src, eng = fake_folders(tmp_path, tiny_reacher_policy)
    if change:
        edit(eng, change)
    calls = []
    monkeypatch.setattr(vla, "export_policy", lambda *a, **k: calls.append((a, k)))
    assert ensure_policy_engines(tmp_path / "models", tmp_path / "engines", "p") == eng
    assert calls == ([((src, eng), {"progress": False, "force": True})] if stale else [])


@pytest.mark.parametrize("extra, stale", [({}, True), ({"native": {"file": "native.npz"}}, False),
                                          ({"native": {"unavailable": "no C compiler"}}, False)])
def test_ensure_policy_engines_re_exports_a_target_without_native_weights(tiny_reacher_policy, tmp_path, monkeypatch,
                                                                          extra, stale):
    """A policy folder exported before its target carried native weights (provider cpu-native) is re-exported."""
    import edgespec.export.vla as vla
    from edgespec.contract import CONTRACT_VERSION, MANIFEST_FILE
    from edgespec.export.bundled import ensure_policy_engines
    src, eng = fake_folders(tmp_path, tiny_reacher_policy)
    (eng / "target").mkdir()
    (eng / "target" / MANIFEST_FILE).write_text(json.dumps({"contract_version": CONTRACT_VERSION, "extra": extra}))
    calls = []
    monkeypatch.setattr(vla, "export_policy", lambda *a, **k: calls.append((a, k)))
    ensure_policy_engines(tmp_path / "models", tmp_path / "engines", "p")
    assert calls == ([((src, eng), {"progress": False, "force": True})] if stale else [])

"""Every `edgespec` command turns expected failures (bad arguments, bad files, engine and ONNX Runtime
errors) into one `error: ...` line on stderr and exit status 2; a bug still raises with its traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from edgespec import cli
from edgespec.cli import main as cli_main

BAD_TEXT = os.fsdecode(b"def \xff(x):")  # how sys.argv carries undecodable bytes: 'def \udcff(x):'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import char_tokenizer_json, make_checkpoint
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("cli_errors")
    make_checkpoint("llama", root / "ckpt", seed=2)
    char_tokenizer_json(root / "ckpt" / "tokenizer.json")
    export_engine(root / "ckpt", root / "engine", max_context=64, progress=False)
    return root / "engine"


def one_error_line(capsys) -> str:
    """The single line a failed command printed on stderr (asserting it is the only one)."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", [
    ["generate", "--target", "{engine}", "--prompt", BAD_TEXT],
    ["generate", "--target", "{engine}", "--prompt", "def", "--stop", BAD_TEXT],
    ["profile", "--target", "{engine}", "--prompt", BAD_TEXT],
    ["demo", "--engines", "{tmp}", "--models", "{tmp}", "--prompt", BAD_TEXT],
])
def test_prompt_that_is_not_utf8_is_one_error_line(engine, tmp_path, capsys, command):
    argv = [a.format(engine=engine, tmp=tmp_path) for a in command]
    assert cli_main(argv) == 2
    line = one_error_line(capsys)
    assert "is not valid UTF-8 text: '\\udcff' at character 4" in line


def test_prompt_bytes_from_a_real_command_line(engine):
    """The bytes reach Python as a lone surrogate in sys.argv; the process prints one line and exits 2."""
    argv = [sys.executable, "-m", "edgespec.cli", "generate", "--target", os.fsencode(engine),
            "--prompt", b"def \xff(x):", "--max-new-tokens", "2"]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUTF8": "1"}, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: the --prompt is not valid UTF-8 text") and r.stderr.count("\n") == 1, r.stderr


def test_batch_file_that_is_not_utf8_names_the_file(engine, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"def f(x):\n\xff\xfe\n")
    assert cli_main(["generate", "--target", str(engine), "--batch-file", str(f)]) == 2
    assert one_error_line(capsys) == f"error: {f}: expected UTF-8 text, got byte 0xff at offset 10"


def test_temperature_below_the_floor_is_one_error_line(engine, capsys):
    assert cli_main(["generate", "--target", str(engine), "--prompt", "def", "--temperature", "1e-310"]) == 2
    assert "temperature must be 0 (greedy) or >= 0.0001, got 1e-310" in one_error_line(capsys)


def test_onnx_runtime_error_is_one_error_line(engine, tmp_path, capsys):
    """A model file ONNX Runtime cannot load (no hash recorded to catch it first): ORT's own exception
    (InvalidProtobuf, no common base with Fail / InvalidArgument / RuntimeException) becomes the line."""
    d = tmp_path / "e"
    shutil.copytree(engine, d)
    m = json.loads((d / "engine.json").read_text())
    (d / "engine.json").write_text(json.dumps({**m, "model_sha256": None}))
    (d / "model.onnx").write_bytes(b"not an onnx model")
    assert cli_main(["generate", "--target", str(d), "--prompt", "def"]) == 2
    assert "INVALID_PROTOBUF" in one_error_line(capsys)
    assert cli_main(["profile", "--target", str(d)]) == 2
    assert "INVALID_PROTOBUF" in one_error_line(capsys)


@pytest.mark.parametrize("command,said", [
    (["generate", "--target", "{tmp}/missing", "--prompt", "x"], "no such engine folder"),
    (["generate", "--target", "{engine}", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be"),
    (["generate", "--target", "{engine}"], "give exactly one of --prompt TEXT or --batch-file FILE"),
    (["profile", "--target", "{engine}", "--prompts-file", "{tmp}/missing.txt"], "No such file"),
    (["export", "{tmp}/missing", "--out", "{tmp}/out"], "not a folder"),
    (["export", "{tmp}", "--out", "{engine}"], "already exists"),
    (["export-policy", "{tmp}/missing", "--out", "{tmp}/out"], "not a VLA policy folder"),
    (["demo", "--engines", "{tmp}", "--models", "{tmp}"], "neither"),
    (["generate", "--target", "{engine}", "--deadline", "1", "--prompt", "x"], "go with a server target"),
    (["generate", "--target", "http://127.0.0.1:9", "--draft", "{engine}", "--gamma", "2", "--prompt", "x"],
     "cannot reach the server at load"),
    (["generate", "--target", "{engine}", "--draft", "{engine}", "--lookup-gamma", "6", "--prompt", "x"],
     "lookup_gamma=6 goes with lookup="),
    (["profile", "--target", "{engine}", "--draft", "{engine}", "--lookup", "2", "--lookup-gamma", "17"],
     "lookup_gamma must be an int in 0..16"),
    (["serve-target"], "give the model folder to serve"),
    (["serve-target", "{tmp}", "--dry-run", "--python", "python3"], "not a Hugging Face model folder"),
])
def test_expected_errors_of_every_command_are_one_line(engine, tmp_path, capsys, command, said):
    argv = [a.format(engine=engine, tmp=tmp_path) for a in command]
    assert cli_main(argv) == 2
    assert said in one_error_line(capsys)


def test_a_bug_still_raises_with_its_traceback(engine, monkeypatch):
    def broken(args):
        raise KeyError("a bug, not a user error")
    monkeypatch.setattr(cli, "cmd_inspect", broken)
    with pytest.raises(KeyError):
        cli_main(["inspect", str(engine)])


def test_demo_with_a_manifest_that_is_not_an_object_is_one_error_line(tmp_path, capsys):
    from edgespec.export.bundled import DEMO_ENGINES
    for name in DEMO_ENGINES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "engine.json").write_text("[1, 2]")
    assert cli_main(["demo", "--engines", str(tmp_path), "--models", str(tmp_path)]) == 2
    assert "engine.json: expected a JSON object of manifest fields, got list" in one_error_line(capsys)

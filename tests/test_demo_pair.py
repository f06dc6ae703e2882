"""The bundled demo pair: standard HF folders that transformers loads, exported engines that agree with
the torch reference token for token, and a draft that speeds the target up without changing its output."""
import json
from pathlib import Path

import pytest
import torch
import transformers

import edgespec
from edgespec.export.onnx_export import export_engine
from edgespec.export.reference import ReferenceDecoder

MODELS = Path(__file__).resolve().parents[1] / "models"
PROMPT = "def read_config(path):\n    \"\"\"Read a JSON config file.\"\"\"\n"


@pytest.fixture(scope="module")
def demo_engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    for name in ("demo-target", "demo-draft"):
        export_engine(MODELS / name, root / name, max_context=256, progress=False)
    return root / "demo-target", root / "demo-draft"


@pytest.mark.parametrize("name,lo,hi", [("demo-target", 25e6, 40e6), ("demo-draft", 1e6, 3e6)])
def test_bundled_models_are_standard_hf_folders(name, lo, hi):
    path = MODELS / name
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert lo <= sum(p.numel() for p in hf.parameters()) <= hi
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ReferenceDecoder.from_pretrained(path)(ids)
    assert (got - want).abs().max().item() < 1e-4


def test_pair_shares_one_tokenizer():
    a = (MODELS / "demo-target" / "tokenizer.json").read_bytes()
    b = (MODELS / "demo-draft" / "tokenizer.json").read_bytes()
    assert a == b and json.loads(a)["model"]["type"] == "BPE"


def test_golden_greedy_output_torch_reference_vs_onnx_runtime(demo_engines):
    """Same 48 greedy tokens from the eager torch reference and from the ONNX Runtime engine."""
    gen = edgespec.load(demo_engines[0])
    ids = gen.tok.encode(PROMPT)
    ref = ReferenceDecoder.from_pretrained(MODELS / "demo-target")
    seq = list(ids)
    for _ in range(48):
        seq.append(int(ref(torch.tensor([seq]))[0, -1].argmax()))
    assert gen.generate(ids, max_new_tokens=48).token_ids == seq[len(ids):]


def test_demo_draft_is_accepted_and_exact(demo_engines):
    plain = edgespec.load(demo_engines[0])
    spec = edgespec.load(demo_engines[0], draft=demo_engines[1], gamma=4)
    a, b = plain.generate(PROMPT, max_new_tokens=64), spec.generate(PROMPT, max_new_tokens=64)
    assert a.token_ids == b.token_ids
    assert b.stats.acceptance_rate > 0.5, f"the distilled draft should be accepted often: {b.stats.acceptance_rate}"


def test_demo_command_reports_speedup_and_exactness(demo_engines, capsys):
    from edgespec.cli import main as cli_main
    assert cli_main(["demo", "--engines", str(demo_engines[0].parent), "--max-new-tokens", "24", "--gamma", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical to plain decoding") == 3 and "DIFFERS" not in out
    assert "speedup over plain decoding (same engines, same run):" in out


def test_generate_json_output(demo_engines, capsys):
    import json as _json
    from edgespec.cli import main as cli_main
    assert cli_main(["generate", "--target", str(demo_engines[0]), "--draft", "ngram", "--prompt", PROMPT,
                     "--max-new-tokens", "12", "--json"]) == 0
    got = _json.loads(capsys.readouterr().out)
    assert len(got["token_ids"]) == 12 and got["stats"]["new_tokens"] == 12 and isinstance(got["text"], str)

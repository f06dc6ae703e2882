"""bench/peers/llamacpp_runner.py: its arguments, the llama-server flags each mode gets, its JSON, its GGUF cache
and the pre-tokenizer wrapper around convert_hf_to_gguf.py.

Without the real build (CI does not build llama.cpp) the runner runs against fakes made here: a llama-server (a
small HTTP server in Python that answers /health, /props, /tokenize and /completion like the real one), a
llama-quantize and a convert_hf_to_gguf.py whose vocabulary step raises NotImplementedError as the real one does
for an unknown pre-tokenizer hash. A few seconds in all. The tests at the end need the real build
(`bash bench/setup_peers.sh llamacpp`) and skip without it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "bench" / "peers" / "llamacpp_runner.py"
sys.path.insert(0, str(RUNNER.parent))

import llamacpp_runner as lr  # noqa: E402

FAKE_SERVER = r'''#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
with open(os.environ["FAKE_LLAMACPP_ARGV"], "a") as f:
    f.write(json.dumps(argv) + "\n")
if os.environ.get("FAKE_LLAMACPP_DIE"):
    print("error: unknown argument: --spec-type", flush=True)
    sys.exit(1)
port = int(argv[argv.index("--port") + 1])
draft = "-md" in argv or "--spec-type" in argv
from tokenizers import Tokenizer
tok = Tokenizer.from_file(os.environ["FAKE_LLAMACPP_TOKENIZER"])

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path == "/health":
            self.reply({"status": "ok"})
        elif self.path == "/props":
            self.reply({"build_info": "b1-fake", "default_generation_settings": {"n_ctx": 256}})
        else:
            self.reply({"error": "not found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self.reply({"tokens": tok.encode(body["content"], add_special_tokens=False).ids})
            return
        ids, n = body["prompt"], body["n_predict"]
        out = [(ids[-1] + 1 + i) % 4096 for i in range(n)]
        stop = "limit"
        if not body.get("ignore_eos") and 0 in out:  # stop at EOS (id 0), the EOS token kept, as llama-server does
            out, stop = out[:out.index(0) + 1], "eos"
        t = {"prompt_n": len(ids), "prompt_ms": 2.0, "predicted_n": len(out), "predicted_ms": 4.0 * len(out),
             "predicted_per_second": (len(out) - 1) / (4e-3 * len(out))}
        if draft:
            t.update(draft_n=2 * len(out), draft_n_accepted=len(out))
        self.reply({"tokens": out, "timings": t, "stop_type": stop, "content": "x"})

HTTPServer(("127.0.0.1", port), H).serve_forever()
'''

FAKE_QUANTIZE = r'''#!{python}
import sys
src, dst, kind = sys.argv[1:4]
data = open(src).read()
open(dst, "w").write(data + f"quantized {kind}\n")
'''

FAKE_CONVERT = r'''
import argparse
from pathlib import Path
from conversion import base

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--outtype")
    ap.add_argument("--outfile")
    a = ap.parse_args()
    pre = base.TextModel(a.model).get_vocab_base_pre(None)
    Path(a.outfile).write_text(f"gguf {a.outtype} pre={pre}\n")
'''

FAKE_BASE = r'''
class TextModel:
    def __init__(self, dir_model):
        self.dir_model = dir_model

    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
'''


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """A fake llama.cpp build (bin/, src/, llamacpp.json), a target and a draft HF folder (the demo tokenizer)."""
    pytest.importorskip("tokenizers", reason="the runner encodes prompts with the tokenizers package")
    bin_, src = tmp_path / "bin", tmp_path / "src"
    (src / "conversion").mkdir(parents=True)
    bin_.mkdir()
    for name, text in (("llama-server", FAKE_SERVER), ("llama-quantize", FAKE_QUANTIZE)):
        (bin_ / name).write_text(text.replace("{python}", sys.executable))
        (bin_ / name).chmod(0o755)
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERT)
    (src / "conversion" / "__init__.py").write_text("")
    (src / "conversion" / "base.py").write_text(FAKE_BASE)
    info = tmp_path / "info"
    info.mkdir()
    (info / "llamacpp.json").write_text(json.dumps({"bin": str(bin_), "src": str(src), "llama_cpp_python": "0.0.fake",
                                                    "llama_cpp_commit": "fake123", "cmake_flags": ["-DGGML_NATIVE=ON"]}))
    models = {}
    for role in ("demo-target", "demo-draft"):
        d = tmp_path / "models" / role
        d.mkdir(parents=True)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "models" / role / f, d / f)
        models[role] = d
    env = dict(os.environ, FAKE_LLAMACPP_ARGV=str(tmp_path / "argv.jsonl"),
               FAKE_LLAMACPP_TOKENIZER=str(models["demo-target"] / "tokenizer.json"))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n    return", "The quick brown fox", [5, 6, 7]]))
    return dict(tmp=tmp_path, info=info, env=env, target=models["demo-target"], draft=models["demo-draft"],
                prompts=prompts, work=tmp_path / "work")


def run(fake, *args, env=None, prompts=None):
    cmd = [sys.executable, str(RUNNER), "--target", str(fake["target"]), "--draft", str(fake["draft"]),
           "--prompts", str(prompts or fake["prompts"]), "--work", str(fake["work"]), "--llamacpp-dir",
           str(fake["info"]), "--max-new-tokens", "6", "--load-timeout", "20", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env or fake["env"], timeout=120)
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {p.stdout!r}; stderr: {p.stderr[-2000:]}"
    return p.returncode, json.loads(lines[0]), p.stderr


def server_argv(fake) -> list[str]:
    return json.loads((fake["tmp"] / "argv.jsonl").read_text().splitlines()[-1])


# ---- arguments ---------------------------------------------------------------------------------------------------
def parse(*a):
    args = lr.build_parser().parse_args(["--target", "T", "--prompts", "p.json", "--work", "W", *a])
    lr.check_args(args)
    return args


@pytest.mark.parametrize("argv, message", [
    (("--mode", "draft"), "--mode draft needs --draft"),
    (("--mode", "draft", "--draft", "D", "--draft-max", "2", "--draft-min", "3"), "0 <= --draft-min <= --draft-max"),
    (("--mode", "draft", "--draft", "D", "--draft-p-min", "1.5"), "--draft-p-min must be in"),
    (("--mode", "lookup", "--ngram-size", "0"), "--ngram-size, --lookup-max and --ngram-min-hits must be >= 1"),
    (("--max-new-tokens", "0"), "--max-new-tokens and --repeats must be >= 1"),
    (("--threads", "0"), "--threads must be >= 1"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_unknown_modes_precisions_and_lookup_types_are_argparse_errors(capsys):
    for bad in (("--mode", "ngram"), ("--precision", "q5_k"), ("--lookup-type", "ngram-foo")):
        with pytest.raises(SystemExit):
            parse(*bad)
    assert "invalid choice" in capsys.readouterr().err


def test_each_mode_gets_its_llama_server_flags():
    a = lr.server_args(parse("--threads", "2"), Path("t.gguf"), None, 512)
    assert a[:8] == ["-m", "t.gguf", "-t", "2", "-tb", "2", "-c", "512"] and "-md" not in a and "--spec-type" not in a
    assert "-np" in a and a[a.index("-np") + 1] == "1" and "--no-webui" in a
    d = lr.server_args(parse("--mode", "draft", "--draft", "D", "--draft-max", "6", "--draft-min", "1",
                             "--draft-p-min", "0.75", "--threads", "2", "--draft-threads", "1"),
                       Path("t.gguf"), Path("d.gguf"), 512)
    assert d[d.index("-md") + 1] == "d.gguf" and d[d.index("--spec-type") + 1] == "draft-simple"
    assert [d[d.index(f) + 1] for f in ("--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min", "-td",
                                        "-tbd")] == ["6", "1", "0.75", "1", "1"]
    d0 = lr.server_args(parse("--mode", "draft", "--draft", "D"), Path("t"), Path("d"), 512)
    assert "-td" not in d0  # 0: llama.cpp's default, the target's threads
    k = lr.server_args(parse("--mode", "lookup", "--ngram-size", "4", "--lookup-max", "12"), Path("t"), None, 512)
    assert [k[k.index(f) + 1] for f in ("--spec-type", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
                                        "--spec-ngram-simple-min-hits")] == ["ngram-simple", "4", "12", "1"]
    m = lr.server_args(parse("--mode", "lookup", "--lookup-type", "ngram-mod", "--ngram-size", "8"), Path("t"), None, 64)
    assert m[m.index("--spec-ngram-mod-n-match") + 1] == "8" and "--spec-ngram-simple-size-n" not in m
    c = lr.server_args(parse("--mode", "lookup", "--lookup-type", "ngram-cache"), Path("t"), None, 64)
    assert c[c.index("--spec-type") + 1] == "ngram-cache" and not any(x.startswith("--spec-ngram") for x in c)
    assert "--no-repack" not in a and "--no-repack" in lr.server_args(parse("--no-repack"), Path("t"), None, 64)
    e = lr.server_args(parse("--server-extra", "-fa", "off"), Path("t"), None, 64)
    assert e[-2:] == ["-fa", "off"]


def test_the_convert_wrapper_names_gpt2_only_for_gpt2s_byte_level_pre_tokenizer(tmp_path):
    ns: dict = {}
    code = lr.CONVERT_WRAPPER.split("_orig = ")[0].split("from conversion import base")[1]
    exec("import json\nfrom pathlib import Path\n" + code, ns)  # gpt2_byte_level alone
    tj = json.loads((ROOT / "models" / "demo-target" / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    assert ns["gpt2_byte_level"](tmp_path)
    for change in ({"add_prefix_space": True}, {"use_regex": False}):
        (tmp_path / "tokenizer.json").write_text(json.dumps(dict(tj, pre_tokenizer={**tj["pre_tokenizer"], **change})))
        assert not ns["gpt2_byte_level"](tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(dict(tj, normalizer={"type": "NFC"})))
    assert not ns["gpt2_byte_level"](tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(dict(tj, pre_tokenizer={"type": "Metaspace"})))
    assert not ns["gpt2_byte_level"](tmp_path)


# ---- the whole runner against the fakes -------------------------------------------------------------------------
RESULT_KEYS = {"prompt_index", "repeat", "prompt_token_ids", "token_ids", "new_tokens", "tokens_per_s", "ttft_s",
               "decode_s", "total_s", "stop_type"}


def test_plain_prints_one_json_object_in_genai_runners_shape(fake):
    from tokenizers import Tokenizer
    rc, out, err = run(fake, "--mode", "plain", "--threads", "2", "--repeats", "2")
    assert rc == 0, out
    assert out["system"] == "llama.cpp fake123 (llama-cpp-python 0.0.fake)" and out["mode"] == "plain"
    assert out["speculative_stats"] is None and isinstance(out["peak_rss_bytes"], int)
    res = out["results"]
    assert len(res) == 6 and [r["repeat"] for r in res] == [0, 0, 0, 1, 1, 1]
    assert all(RESULT_KEYS <= set(r) and "speculative_stats" not in r for r in res)
    tok = Tokenizer.from_file(str(fake["target"] / "tokenizer.json"))  # edgespec's TextTokenizer.encode
    prompts = json.loads(fake["prompts"].read_text())
    assert [r["prompt_token_ids"] for r in res[:3]] == [tok.encode(p, add_special_tokens=False).ids for p in prompts[:2]] \
        + [[5, 6, 7]]
    r = res[2]  # ids 8..13: the fake's deterministic continuation; 4 ms a token by llama.cpp's own timings
    assert r["token_ids"] == [8, 9, 10, 11, 12, 13] and r["new_tokens"] == 6 and r["stop_type"] == "limit"
    assert r["decode_s"] == pytest.approx(0.024) and r["tokens_per_s"] == pytest.approx(250.0)
    assert r["ttft_s"] == pytest.approx(0.002) and r["total_s"] > 0
    c = out["config"]
    assert c["tokenizer_check"]["identical"] == 2 and c["tokenizer_check"]["differing"] == []
    assert c["precision"] == "f16" and c["threads"] == 2 and c["server_build_info"] == "b1-fake"
    assert c["builds"]["target"]["reused"] is False and "pre_tokenizer_note" in c["builds"]["target"]
    assert "tokenizer.ggml.pre = gpt-2" in c["builds"]["target"]["pre_tokenizer_note"]
    assert Path(c["target_gguf"]).read_text() == "gguf f16 pre=gpt-2\n"
    argv = server_argv(fake)
    assert argv[argv.index("-m") + 1] == c["target_gguf"] and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_a_prompt_that_reaches_eos_stops_there_with_the_eos_token_unless_ignore_eos(fake, tmp_path):
    p = tmp_path / "eos.json"
    p.write_text(json.dumps([[4093]]))  # the fake continues 4094, 4095, 0 (EOS), 1, ...
    rc, out, _ = run(fake, "--mode", "plain", prompts=p)
    assert rc == 0 and out["results"][0]["token_ids"] == [4094, 4095, 0] and out["results"][0]["stop_type"] == "eos"
    rc, out, _ = run(fake, "--mode", "plain", "--ignore-eos", prompts=p)
    assert out["results"][0]["token_ids"] == [4094, 4095, 0, 1, 2, 3] and out["config"]["stop"] == "max_new_tokens"


def test_draft_and_lookup_report_llama_servers_draft_counters_and_reuse_the_conversions(fake):
    rc, out, _ = run(fake, "--mode", "draft", "--precision", "q4_0", "--draft-precision", "q8_0", "--draft-max", "5",
                     "--draft-p-min", "0.5", "--threads", "2", "--draft-threads", "1")
    assert rc == 0, out
    c = out["config"]
    assert (c["precision"], c["draft_precision"], c["draft_max"], c["draft_p_min"], c["draft_threads"]) == \
        ("q4_0", "q8_0", 5, 0.5, 1)
    assert Path(c["target_gguf"]).name.endswith("-q4_0.gguf") and Path(c["draft_gguf"]).name.endswith("-q8_0.gguf")
    assert Path(c["target_gguf"]).read_text().endswith("quantized Q4_0\n")
    assert "llama-quantize" in c["builds"]["target"]["builder_command"]
    assert "<CONVERT_WRAPPER>" in c["builds"]["target"]["builder_command"]
    assert all(r["speculative_stats"] == {"draft_tokens_proposed": 12, "draft_tokens_accepted": 6}
               for r in out["results"])
    assert out["speculative_stats"]["acceptance_rate"] == 0.5 and out["speculative_stats"]["runs"] == 3
    argv = server_argv(fake)
    assert argv[argv.index("-md") + 1] == c["draft_gguf"] and argv[argv.index("-td") + 1] == "1"
    # a second run converts nothing: every GGUF is reused
    rc, out, _ = run(fake, "--mode", "lookup", "--precision", "q4_0", "--ngram-size", "2", "--lookup-max", "4")
    assert rc == 0 and out["config"]["builds"]["target"]["reused"] is True
    assert (out["config"]["spec_type"], out["config"]["ngram_size"], out["config"]["lookup_max"]) == ("ngram-simple", 2, 4)
    assert out["speculative_stats"]["draft_tokens_accepted"] == 18


def test_failures_are_one_json_object_with_the_reason(fake, tmp_path):
    rc, out, _ = run(fake, "--mode", "draft", "--draft-max", "0")
    assert rc == 2 and "--draft-max >= 1" in out["error"] and out["stage"] == "setup"
    rc, out, _ = run(fake, "--mode", "plain", "--llamacpp-dir", str(tmp_path / "nowhere"))
    assert rc == 2 and "bash bench/setup_peers.sh llamacpp" in out["error"]
    rc, out, _ = run(fake, "--mode", "lookup", env=dict(fake["env"], FAKE_LLAMACPP_DIE="1"))
    assert rc == 0 and out["stage"] == "server start" and "exited with 1" in out["error"]
    assert "unknown argument: --spec-type" in out["server_log_tail"][-1] and "--spec-type" in out["server_command"]


def test_a_tokenizer_the_wrapper_does_not_vouch_for_fails_the_conversion(fake):
    tj = json.loads((fake["target"] / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (fake["target"] / "tokenizer.json").write_text(json.dumps(tj))
    rc, out, _ = run(fake, "--mode", "plain")
    assert rc == 2 and out["stage"] == "build" and "convert_hf_to_gguf.py" in out["error"]
    assert any("NotImplementedError" in ln for ln in out["build_log_tail"])


# ---- with the real build (bash bench/setup_peers.sh llamacpp) ---------------------------------------------------
VENV_PY = ROOT / ".venv-llamacpp" / "bin" / "python"
real = pytest.mark.skipif(not (ROOT / ".venv-llamacpp" / lr.INFO_FILE).is_file() or not VENV_PY.exists(),
                          reason="needs the llama.cpp build: bash bench/setup_peers.sh llamacpp")


def run_real(tmp_path, prompts, *args):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(prompts))
    cmd = [str(VENV_PY), str(RUNNER), "--target", str(ROOT / "models" / "demo-target"), "--draft",
           str(ROOT / "models" / "demo-draft"), "--prompts", str(f), "--work", str(ROOT / ".cache" / "peers" / "llamacpp"),
           "--threads", "1", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and "error" not in out, (out.get("error"), p.stderr[-3000:])
    return out


@real
def test_real_llama_cpp_tokenises_the_benchmark_prompts_as_edgespec_does(tmp_path):
    """Every prompt of bench_peers (20 code + 4 prose) through llama.cpp's own tokenizer (the GGUF's, pre-tokenizer
    gpt-2) gives edgespec's ids; and the q4_0 GGUF (quantized from the same f16) tokenises the same."""
    pytest.importorskip("onnxruntime", reason="edgespec needs onnxruntime")
    sys.path.insert(0, str(ROOT / "bench" / "lib"))
    import edgespec
    from prompts import PROSE, code_prompts
    tok = edgespec.tokenizer.TextTokenizer(ROOT / "models" / "demo-target" / "tokenizer.json")
    prompts = code_prompts(tok, 20) + PROSE
    for prec in ("f16", "q4_0"):
        out = run_real(tmp_path, prompts, "--mode", "plain", "--precision", prec, "--max-new-tokens", "2",
                       "--warmup", "0")
        assert out["config"]["tokenizer_check"] == dict(out["config"]["tokenizer_check"], prompts=24, identical=24,
                                                        differing=[])
        assert [r["prompt_token_ids"] for r in out["results"]] == [tok.encode(p) for p in prompts]
        assert all(r["prompt_n"] == len(r["prompt_token_ids"]) for r in out["results"])  # llama.cpp got them all


@real
def test_real_draft_and_lookup_decode_what_plain_decodes(tmp_path):
    """Greedy speculative decoding verifies every token with the target: draft and lookup at f16 give plain's
    tokens (the same GGUF), and report their draft counters."""
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return", "The documentation describes how to"]
    plain = run_real(tmp_path, prompts, "--mode", "plain", "--max-new-tokens", "24")
    for mode in (("--mode", "draft", "--draft-max", "4"), ("--mode", "lookup", "--ngram-size", "2", "--lookup-max", "4")):
        out = run_real(tmp_path, prompts, *mode, "--max-new-tokens", "24")
        assert [r["token_ids"] for r in out["results"]] == [r["token_ids"] for r in plain["results"]], mode
        assert out["speculative_stats"]["draft_tokens_proposed"] >= out["speculative_stats"]["draft_tokens_accepted"]
    assert all(r["new_tokens"] >= 1 and r["tokens_per_s"] > 0 for r in plain["results"])
    assert plain["peak_rss_bytes"] > 0 and plain["config"]["server_build_info"]


def test_the_runner_imports_without_touching_stdout():
    """Importing the module (as these tests do) must not redirect stdout; only main() does."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(RUNNER.parent)!r})
        import llamacpp_runner
        print("still stdout")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "still stdout"


# ---- setup_peers.sh's AMX probe -------------------------------------------------------------------------------

def _amx_probe_source() -> str:
    text = (ROOT / "bench" / "setup_peers.sh").read_text()
    start = text.index("AMX_PROBE=$(cat <<'EOF'\n") + len("AMX_PROBE=$(cat <<'EOF'\n")
    return text[start:text.index("\nEOF\n", start)]


def _cc_with_amx():
    cc = shutil.which("cc")
    if cc is None or subprocess.run([cc, "-mamx-tile", "-E", "-x", "c", "/dev/null"], capture_output=True).returncode:
        pytest.skip("needs a C compiler that knows -mamx-tile")
    return cc


def test_the_amx_probe_says_what_ggmls_own_tile_setup_does(tmp_path):
    """The probe decides whether llama.cpp is built with AMX. What matters is whether ggml's AMX kernels run, and
    that depends on the compiler as much as on the CPU: GCC 12 drops the stores of ggml_tile_config_init's local
    tile configuration, so llama.cpp faulted at its first tilezero on a CPU whose AMX works, while a probe with a
    compiler barrier passed there. The probe's verdict must be that of ggml's pattern, built as llama.cpp is."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if " amx_tile" not in flags:
        pytest.skip("this CPU does not list amx_tile")
    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    cc = _cc_with_amx()
    (tmp_path / "probe.c").write_text(_amx_probe_source())
    subprocess.run([cc, "-O3", "-march=native", "probe.c", "-o", "probe"], cwd=tmp_path, check=True)
    # ggml-cpu/amx/mmq.cpp's ggml_tile_config_init (one tile kept), in C++ as ggml compiles it
    (tmp_path / "ggml.cpp").write_text(textwrap.dedent("""\
        #include <immintrin.h>
        #include <cstdint>
        #include <sys/syscall.h>
        #include <unistd.h>
        struct tile_config_t { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
                               uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
        __attribute__((noinline)) void ggml_tile_config_init() {
            alignas(64) tile_config_t tc = {};
            tc.palette_id = 1;
            tc.start_row = 0;
            tc.rows[0] = 16;  tc.colsb[0] = 64;
            _tile_loadconfig(&tc);
        }
        int main() {
            if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
            ggml_tile_config_init();
            _tile_zero(0);
            _tile_release();
            return 0;
        }
        """))
    subprocess.run([cxx, "-O3", "-march=native", "ggml.cpp", "-o", "ggml"], cwd=tmp_path, check=True)
    ggml_runs = subprocess.run([str(tmp_path / "ggml")], capture_output=True).returncode == 0
    assert (subprocess.run([str(tmp_path / "probe")], capture_output=True).returncode == 0) == ggml_runs


def test_setup_peers_builds_the_probe_as_llamacpp_is_built():
    text = (ROOT / "bench" / "setup_peers.sh").read_text()
    fn = text[text.index("amx_faults() {"):]
    assert 'cc -O3 -march=native "$d/probe.c"' in fn[:fn.index("\n}\n")]
    assert "__asm__" not in _amx_probe_source()  # a barrier would make it pass where ggml's own code faults

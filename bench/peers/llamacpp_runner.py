"""Peer runner: llama.cpp (plain, draft-model speculative, prompt lookup / n-gram speculative), greedy.

Runs inside .venv-llamacpp (see bench/setup_peers.sh: llama-cpp-python's sdist, its vendored llama.cpp built
with cmake), as a subprocess of the benchmark harness:

    .venv-llamacpp/bin/python bench/peers/llamacpp_runner.py --target models/demo-target \
        --draft models/demo-draft --prompts prompts.json --max-new-tokens 128 --repeats 1 \
        --work .cache/peers/llamacpp --mode draft --precision f16 --draft-max 4 --threads 2 --draft-threads 1

Prints exactly ONE JSON object on stdout (everything else goes to stderr), the same shape as genai_runner.py:

    {"system": "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)", "mode": ..., "config": {...},
     "results": [{"prompt_index", "repeat", "prompt_token_ids", "token_ids", "new_tokens",
                  "tokens_per_s", "ttft_s", "decode_s", "total_s", "speculative_stats", "stop_type"}, ...],
     "speculative_stats": {...summed over the timed runs...} | null, "peak_rss_bytes": ...}

Engine: llama.cpp's own `llama-server` (tools/server), one process per runner call, serving every prompt of the
call with the models loaded once (load time is never timed). It is the one llama.cpp program that takes a prompt
as token ids and hands back the generated token ids together with its own timings and draft counters, and it
runs llama.cpp's speculative decoding (common/speculative.cpp, the code behind llama-speculative-simple too):

  * plain:  `llama-server -m TARGET.gguf -t T -tb T`
  * draft:  `... -md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max K --spec-draft-n-min M
            --spec-draft-p-min P -td TD -tbd TD` (TD = 0: llama.cpp's default, the target's threads);
  * lookup: `... --spec-type ngram-simple --spec-ngram-simple-size-n N --spec-ngram-simple-size-m M
            --spec-ngram-simple-min-hits H`: prompt-lookup decoding (the last N tokens are looked up in the
            context; the M tokens that followed the match are the draft); or `--lookup-type ngram-cache`
            (llama-lookup's 1..4-gram context cache, 8 draft tokens, fixed in this llama.cpp), or the other
            n-gram types of --spec-type (ngram-map-k, ngram-map-k4v: N/M/H as for ngram-simple; ngram-mod:
            --spec-ngram-mod-n-match N, -n-max M, -n-min --lookup-min).
  Each request: POST /completion {"prompt": [token ids], "n_predict": --max-new-tokens, "temperature": 0,
  "top_k": 1, "samplers": ["top_k"], "cache_prompt": false (every prompt is processed from scratch, repeats
  too), "return_tokens": true, "ignore_eos": false}.

Tokenisation: prompts given as text are encoded here with the `tokenizers` package from the target folder's
tokenizer.json (`encode(text, add_special_tokens=False)`, exactly as edgespec's TextTokenizer), and the ids are
what llama.cpp receives, so the prompt token ids cannot differ from edgespec's. The GGUF's own tokenizer is made
right as well (for llama.cpp's text-prompt programs): convert_hf_to_gguf.py identifies a BPE pre-tokenizer by a
hash of a test string's token ids and refuses ours (an unlisted vocabulary); CONVERT_WRAPPER answers the hash
check with "gpt-2" when, and only when, tokenizer.json has no normalizer and its pre_tokenizer is ByteLevel with
use_regex and no prefix space (GPT-2's regex, which llama.cpp's "gpt-2" pre-tokenizer implements); anything else
still fails. Every run checks it: the server's /tokenize of each text prompt (add_special as llama.cpp's programs
tokenise) against our ids, in config.tokenizer_check (tests/test_llamacpp_runner.py checks real prompts too).

Stopping: like edgespec and the other peers, at EOS or after --max-new-tokens, whichever comes first (the EOS
token, when generated, is among token_ids, as in edgespec's output); --ignore-eos decodes the full count.

Timing: llama.cpp's own per-request timings (ggml_time_us inside the server's slot): ttft_s = prompt_ms (the
prompt's evaluation up to the first token), decode_s = predicted_ms (from the first generated token to the
last); tokens_per_s = new_tokens / decode_s, the convention of edgespec's Stats and the other runners (llama.cpp's
own predicted_per_second divides by new_tokens - 1, "the first token is free"; kept as
llamacpp_predicted_per_second). total_s is the wall clock around the HTTP request (HTTP and JSON included).
peak_rss_bytes is the server process's VmHWM (the models live there), read before it is stopped.

Models: each Hugging Face folder is converted once with llama.cpp's convert_hf_to_gguf.py --outtype f16, then
llama-quantize makes q8_0 / q4_0 from that f16 file; cached in --work by the folder's path, file sizes and
mtimes and the llama.cpp commit; config.builds records the exact commands.

Exit status: 0 with results; 0 with {"error": ...} when the server refuses the requested settings (its log
tail); 2 with {"error": ...} for anything else (bad arguments, missing build, conversion failure, ...).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex

import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

MODES = ("plain", "draft", "lookup")
PRECISIONS = ("f16", "q8_0", "q4_0")
LOOKUP_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
INFO_FILE = "llamacpp.json"  # written by bench/setup_peers.sh into .venv-llamacpp: {bin, src, versions, ...}

# convert_hf_to_gguf.py with one change: a BPE pre-tokenizer whose hash it does not know is named "gpt-2" when
# tokenizer.json says it is GPT-2's (ByteLevel, use_regex, no prefix space, no normalizer). argv: LLAMA_CPP_SRC,
# then convert_hf_to_gguf.py's own arguments.
CONVERT_WRAPPER = r'''
import json, sys
from pathlib import Path
src = Path(sys.argv[1])
sys.argv = [str(src / "convert_hf_to_gguf.py")] + sys.argv[2:]
sys.path.insert(0, str(src))
import convert_hf_to_gguf as conv
from conversion import base

def gpt2_byte_level(model_dir):
    p = Path(model_dir) / "tokenizer.json"
    if not p.is_file():
        return False
    tj = json.loads(p.read_text(encoding="utf-8"))
    pre = tj.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    return (tj.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", True))

_orig = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        if not gpt2_byte_level(self.dir_model):
            raise
        print("EDGESPEC: BPE pre-tokenizer hash not in convert_hf_to_gguf.py; tokenizer.json's pre_tokenizer is "
              "GPT-2's ByteLevel regex (use_regex, no prefix space, no normalizer): tokenizer.ggml.pre = gpt-2",
              file=sys.stderr, flush=True)
        return "gpt-2"

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
conv.main()
'''


def log(*a):
    print(*a, file=sys.stderr, flush=True)


_JSON_OUT = None  # the real stdout, set up in main(): importing this module (the tests do) changes nothing


def emit(obj: dict, code: int = 0):
    out = _JSON_OUT or sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()
    sys.exit(code)


class BuildError(RuntimeError):
    def __init__(self, msg: str, log_tail: list[str]):
        super().__init__(msg)
        self.log_tail = log_tail


class ServerError(RuntimeError):
    def __init__(self, msg: str, log_tail: list[str]):
        super().__init__(msg)
        self.log_tail = log_tail


# ---- the llama.cpp build ----------------------------------------------------------------------------------------
def find_llamacpp(explicit: Path | None) -> dict:
    """The build bench/setup_peers.sh made: {"bin": dir of llama-server etc., "src": llama.cpp source, ...}.
    --llamacpp-dir DIR (a folder holding llamacpp.json) overrides the venv's."""
    here = Path(explicit) if explicit else Path(sys.prefix)
    f = here / INFO_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: build llama.cpp with `bash bench/setup_peers.sh llamacpp`")
    info = json.loads(f.read_text())
    for key in ("bin", "src"):
        if not Path(info.get(key, "")).is_dir():
            raise FileNotFoundError(f"{f}: {key} {info.get(key)!r} is not a folder: rerun "
                                    "`bash bench/setup_peers.sh llamacpp`")
    for prog in ("llama-server", "llama-quantize"):
        if not os.access(Path(info["bin"]) / prog, os.X_OK):
            raise FileNotFoundError(f"{Path(info['bin']) / prog} missing: rerun `bash bench/setup_peers.sh llamacpp`")
    return info


def system_name(info: dict) -> str:
    commit = info.get("llama_cpp_commit") or "unknown commit"
    return f"llama.cpp {commit} (llama-cpp-python {info.get('llama_cpp_python', '?')})"


# ---- conversion: HF folder -> GGUF -------------------------------------------------------------------------------
def folder_key(hf_dir: Path, version: str) -> str:
    h = hashlib.sha1(f"{hf_dir.resolve()}|{version}".encode())
    for p in sorted(hf_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def convert_command(info: dict, hf_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", CONVERT_WRAPPER, str(info["src"]), str(hf_dir), "--outtype", "f16",
            "--outfile", str(out)]


def quantize_command(info: dict, f16: Path, out: Path, precision: str) -> list[str]:
    return [str(Path(info["bin"]) / "llama-quantize"), str(f16), str(out), precision.upper()]


def _run_logged(cmd: list[str], logf: Path, what: str, env=None) -> None:
    with open(logf, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        lines = [ln for ln in logf.read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else "(no output)"
        raise BuildError(f"{what} failed (exit {r.returncode}): {last} (full log: {logf})", lines[-25:])


def _shown(cmd: list[str]) -> str:
    """A command for the record: the converter's inline wrapper named, not printed."""
    return shlex.join(["<CONVERT_WRAPPER>" if c == CONVERT_WRAPPER else c for c in cmd])


def gguf(info: dict, hf_dir: Path, work: Path, precision: str) -> tuple[Path, dict]:
    """The GGUF of one HF folder at one precision (f16 converted, q8_0 / q4_0 quantized from it); reused when
    already made. Returns its path and record (commands, whether reused, the pre-tokenizer note)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    version = str(info.get("llama_cpp_commit") or info.get("llama_cpp_python") or "?")
    stem = f"{hf_dir.resolve().name}-{folder_key(hf_dir, version)}"
    f16 = work / f"{stem}-f16.gguf"
    out = work / f"{stem}-{precision}.gguf"
    record = {"path": str(out), "precision": precision, "commands": []}
    conv = convert_command(info, hf_dir, f16.with_suffix(".partial"))
    record["commands"].append(_shown(conv).replace(".partial", ".gguf"))
    if precision != "f16":
        record["commands"].append(shlex.join(quantize_command(info, f16, out, precision)))
    record["builder_command"] = " && ".join(record["commands"])  # what bench_peers' report prints
    if out.is_file():
        log(f"[llama.cpp] reusing {out}")
        return out, dict(record, reused=True)
    work.mkdir(parents=True, exist_ok=True)
    if not f16.is_file():
        tmp = f16.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        log("[llama.cpp] converting: " + _shown(conv))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        _run_logged(conv, work / f"{stem}-f16.convert.log", f"convert_hf_to_gguf.py on {hf_dir}", env)
        if not tmp.is_file():
            raise BuildError(f"convert_hf_to_gguf.py wrote no {tmp}", [])
        os.replace(tmp, f16)
    note = [ln for ln in (work / f"{stem}-f16.convert.log").read_text(errors="replace").splitlines()
            if ln.startswith("EDGESPEC:")] if (work / f"{stem}-f16.convert.log").is_file() else []
    if note:
        record["pre_tokenizer_note"] = note[0]
    if precision != "f16":
        tmp = out.with_suffix(".partial")
        q = quantize_command(info, f16, tmp, precision)
        log("[llama.cpp] quantizing: " + shlex.join(q))
        _run_logged(q, work / f"{stem}-{precision}.quantize.log", f"llama-quantize {precision}")
        if not tmp.is_file():
            raise BuildError(f"llama-quantize wrote no {tmp}", [])
        os.replace(tmp, out)
    return out, dict(record, reused=False)


# ---- the server -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(args, target: Path, draft: Path | None, ctx: int) -> list[str]:
    """llama-server's arguments for one configuration (the host and port come separately)."""
    a = ["-m", str(target), "-t", str(args.threads), "-tb", str(args.threads), "-c", str(ctx), "-np", "1",
         "--threads-http", "1", "--no-webui", "--no-warmup" if not args.server_warmup else "--warmup"]
    if args.mode == "draft":
        a += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.draft_max),
              "--spec-draft-n-min", str(args.draft_min), "--spec-draft-p-min", str(args.draft_p_min)]
        if args.draft_threads:
            a += ["-td", str(args.draft_threads), "-tbd", str(args.draft_threads)]
    elif args.mode == "lookup":
        a += ["--spec-type", args.lookup_type]
        if args.lookup_type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
            key = args.lookup_type.replace("ngram-", "")
            a += [f"--spec-ngram-{key}-size-n", str(args.ngram_size), f"--spec-ngram-{key}-size-m",
                  str(args.lookup_max), f"--spec-ngram-{key}-min-hits", str(args.ngram_min_hits)]
        elif args.lookup_type == "ngram-mod":
            a += ["--spec-ngram-mod-n-match", str(args.ngram_size), "--spec-ngram-mod-n-max", str(args.lookup_max),
                  "--spec-ngram-mod-n-min", str(args.lookup_min)]
    if args.no_repack:  # no extra buffer types: the weights stay as loaded (no AMX or repacked layouts)
        a += ["--no-repack"]
    return a + list(args.server_extra or [])


class Server:
    """One llama-server process on 127.0.0.1 (a free port), its log in a file."""

    def __init__(self, binary: Path, argv: list[str], logf: Path, load_timeout: float):
        self.port = free_port()
        self.cmd = [str(binary)] + argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.logf = logf
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(logf, "w")
        log("[llama.cpp] starting: " + shlex.join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready(load_timeout)

    def log_tail(self, n: int = 25) -> list[str]:
        self._log.flush()
        return [ln for ln in self.logf.read_text(errors="replace").splitlines() if ln.strip()][-n:]

    def wait_ready(self, timeout: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise ServerError(f"llama-server exited with {self.proc.returncode} before it was ready: "
                                  + (tail[-1] if tail else "(no output)"), tail)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise ServerError(f"llama-server not ready after {timeout:.0f} s", self.log_tail())

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server {path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def peak_rss_bytes(self) -> int | None:
        try:
            for ln in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if ln.startswith("VmHWM:"):
                    return int(ln.split()[1]) * 1024
        except OSError:
            pass
        return None

    def os_threads(self) -> int | None:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---- prompts ----------------------------------------------------------------------------------------------------
def load_prompts(path: Path) -> list:
    prompts = json.loads(path.read_text())
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"{path}: expected a non-empty JSON list of strings (or of token-id lists)")
    return prompts


def encode_prompts(prompts: list, tokenizer_json: Path) -> list[list[int]]:
    """Token ids as edgespec makes them (tokenizers, add_special_tokens=False); id lists pass through."""
    tok = None
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(tokenizer_json))
            out.append(tok.encode(p, add_special_tokens=False).ids)
        else:
            out.append([int(t) for t in p])
    return out


def sum_stats(all_stats: list[dict]) -> dict | None:
    if not all_stats:
        return None
    prop = sum(s.get("draft_tokens_proposed", 0) for s in all_stats)
    acc = sum(s.get("draft_tokens_accepted", 0) for s in all_stats)
    return {"draft_tokens_proposed": prop, "draft_tokens_accepted": acc,
            "acceptance_rate": acc / prop if prop else 0.0, "runs": len(all_stats),
            "note": "llama-server's timings.draft_n and draft_n_accepted summed over the timed runs; "
                    "acceptance_rate = accepted / proposed"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="Hugging Face folder (Llama architecture)")
    ap.add_argument("--draft", type=Path, default=None, help="the draft's Hugging Face folder (--mode draft)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list of strings (or of token-id lists)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, required=True, help="cache of GGUF conversions (and server logs)")
    ap.add_argument("--mode", choices=MODES, default="plain")
    ap.add_argument("--precision", choices=PRECISIONS, default="f16", help="the target's GGUF weights")
    ap.add_argument("--draft-precision", choices=PRECISIONS, default=None, help="the draft's (default: --precision)")
    ap.add_argument("--threads", type=int, default=2, help="target threads (-t and -tb)")
    ap.add_argument("--draft-threads", type=int, default=0,
                    help="draft threads (-td and -tbd); 0 = llama.cpp's default (the target's)")
    ap.add_argument("--draft-max", type=int, default=3, help="--spec-draft-n-max (llama.cpp's default 3)")
    ap.add_argument("--draft-min", type=int, default=0, help="--spec-draft-n-min")
    ap.add_argument("--draft-p-min", type=float, default=0.0,
                    help="--spec-draft-p-min: stop drafting below this draft probability (greedy)")
    ap.add_argument("--lookup-type", choices=LOOKUP_TYPES, default="ngram-simple", help="--spec-type of --mode lookup")
    ap.add_argument("--ngram-size", type=int, default=3,
                    help="lookup: the n-gram looked up (size-n; ngram-mod: n-match)")
    ap.add_argument("--lookup-max", type=int, default=8,
                    help="lookup: the draft's length (size-m; ngram-mod: n-max)")
    ap.add_argument("--lookup-min", type=int, default=1, help="lookup ngram-mod: n-min")
    ap.add_argument("--ngram-min-hits", type=int, default=1, help="lookup: --spec-ngram-*-min-hits")
    ap.add_argument("--no-repack", action="store_true",
                    help="llama-server --no-repack: no weight repacking (on an AMX CPU, no AMX weights)")
    ap.add_argument("--ignore-eos", action="store_true", help="decode --max-new-tokens even past EOS")
    ap.add_argument("--ctx-size", type=int, default=0,
                    help="context (-c); 0 = the longest prompt + max new tokens + draft room, rounded up to 256")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generations (16 tokens) before timing")
    ap.add_argument("--server-warmup", action="store_true", help="let llama-server run its own warm-up at load")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="seconds for llama-server to load")
    ap.add_argument("--llamacpp-dir", type=Path, default=None,
                    help="a folder holding llamacpp.json (default: this Python's venv, as setup_peers.sh writes it)")
    ap.add_argument("--server-extra", nargs=argparse.REMAINDER, default=None,
                    help="everything after it goes to llama-server as is")
    return ap


def check_args(args) -> None:
    if args.max_new_tokens < 1 or args.repeats < 1:
        raise ValueError("--max-new-tokens and --repeats must be >= 1")
    if args.threads < 1 or args.draft_threads < 0:
        raise ValueError("--threads must be >= 1 and --draft-threads >= 0")
    if args.mode == "draft":
        if args.draft is None:
            raise ValueError("--mode draft needs --draft")
        if args.draft_max < 1 or not 0 <= args.draft_min <= args.draft_max:
            raise ValueError(f"need --draft-max >= 1 and 0 <= --draft-min <= --draft-max, got "
                             f"{args.draft_max} and {args.draft_min}")
        if not 0.0 <= args.draft_p_min <= 1.0:
            raise ValueError(f"--draft-p-min must be in [0, 1], got {args.draft_p_min}")
    if args.mode == "lookup" and (args.ngram_size < 1 or args.lookup_max < 1 or args.ngram_min_hits < 1):
        raise ValueError("--ngram-size, --lookup-max and --ngram-min-hits must be >= 1")


def config_of(args) -> dict:
    c = {"precision": args.precision, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
         "repeats": args.repeats, "warmup": args.warmup, "stop": "max_new_tokens" if args.ignore_eos else
         "EOS or max_new_tokens", "search": {"temperature": 0, "top_k": 1, "samplers": ["top_k"]}}
    if args.mode == "draft":
        c.update(draft_precision=args.draft_precision or args.precision,
                 draft_threads=args.draft_threads or "llama.cpp default (= threads)",
                 spec_type="draft-simple", draft_max=args.draft_max, draft_min=args.draft_min,
                 draft_p_min=args.draft_p_min)
    elif args.mode == "lookup":
        c.update(spec_type=args.lookup_type)
        if args.lookup_type != "ngram-cache":
            c.update(ngram_size=args.ngram_size, lookup_max=args.lookup_max)
        if args.lookup_type == "ngram-mod":
            c.update(lookup_min=args.lookup_min)
        elif args.lookup_type != "ngram-cache":
            c.update(ngram_min_hits=args.ngram_min_hits)
        else:
            c.update(note="llama-lookup's n-gram cache (1..4-grams); 8 draft tokens, fixed in this llama.cpp")
    return c


def main(argv=None):
    global _JSON_OUT
    # The one JSON object goes to the real stdout; everything else (subprocesses' prints included) to stderr.
    _JSON_OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = {"mode": args.mode, "system": "llama.cpp"}
    try:
        check_args(args)
        info = find_llamacpp(args.llamacpp_dir)
        base["system"] = system_name(info)
        prompts = load_prompts(args.prompts)
        encoded = encode_prompts(prompts, args.target / "tokenizer.json")
        work = args.work
        work.mkdir(parents=True, exist_ok=True)
        target, target_rec = gguf(info, args.target, work, args.precision)
        draft, draft_rec = (gguf(info, args.draft, work, args.draft_precision or args.precision)
                            if args.mode == "draft" else (None, None))
    except BuildError as e:
        emit({**base, "error": str(e), "stage": "build", "build_log_tail": e.log_tail}, 2)
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        emit({**base, "error": f"{type(e).__name__}: {e}", "stage": "setup"}, 2)

    config = config_of(args)
    config.update(target_gguf=str(target), draft_gguf=str(draft) if draft else None,
                  builds={"target": target_rec, **({"draft": draft_rec} if draft_rec else {})},
                  llama_cpp={k: info.get(k) for k in ("llama_cpp_python", "llama_cpp_commit", "cmake_flags")})
    longest = max(len(e) for e in encoded)
    ctx = args.ctx_size or -(-(longest + args.max_new_tokens + max(args.draft_max, args.lookup_max, 16) + 16)
                             // 256) * 256
    config["ctx_size"] = ctx
    argv_srv = server_args(args, target, draft, ctx)
    logf = work / f"server-{os.getpid()}.log"
    try:
        srv = Server(Path(info["bin"]) / "llama-server", argv_srv, logf, args.load_timeout)
    except ServerError as e:
        emit({**base, "config": config, "error": str(e), "stage": "server start", "server_log_tail": e.log_tail,
              "server_command": shlex.join([str(Path(info["bin"]) / "llama-server")] + argv_srv)}, 0)
    config["server_command"] = shlex.join(srv.cmd)
    config["os_threads"] = srv.os_threads()
    results, all_stats = [], []
    try:
        try:
            props = srv.get("/props")
            config["server_build_info"] = props.get("build_info")
            gs = props.get("default_generation_settings") or {}
            config["server_n_ctx"] = gs.get("n_ctx")
        except Exception as e:  # noqa: BLE001  (/props is informative only)
            config["server_props_error"] = str(e)
        # llama.cpp's tokenisation of each text prompt against ours (we always send our ids)
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        if texts:
            bad = []
            for i, p in texts:
                theirs = srv.post("/tokenize", {"content": p, "add_special": True, "parse_special": True})["tokens"]
                if theirs != encoded[i]:
                    bad.append(i)
            config["tokenizer_check"] = {"prompts": len(texts), "identical": len(texts) - len(bad), "differing": bad,
                                         "note": "llama.cpp /tokenize (add_special, parse_special) vs tokenizers "
                                                 "(add_special_tokens=False); the ids sent are always ours"}

        def run_one(ids: list[int], n: int) -> tuple[dict, float]:
            body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                    "seed": 0, "cache_prompt": False, "return_tokens": True, "ignore_eos": bool(args.ignore_eos),
                    "stream": False}
            t0 = time.perf_counter()
            r = srv.post("/completion", body)
            return r, time.perf_counter() - t0

        for _ in range(args.warmup):
            run_one(encoded[0], min(16, args.max_new_tokens))
        for rep in range(args.repeats):
            for i, ids in enumerate(encoded):
                r, wall = run_one(ids, args.max_new_tokens)
                t = r.get("timings") or {}
                out = [int(x) for x in r.get("tokens") or []]
                decode = (t.get("predicted_ms") or 0.0) / 1e3
                res = {"prompt_index": i, "repeat": rep, "prompt_token_ids": ids, "token_ids": out,
                       "new_tokens": len(out), "tokens_per_s": len(out) / decode if decode > 0 else None,
                       "ttft_s": (t.get("prompt_ms") or 0.0) / 1e3, "decode_s": decode, "total_s": wall,
                       "llamacpp_predicted_per_second": t.get("predicted_per_second"),
                       "prompt_n": t.get("prompt_n"), "stop_type": r.get("stop_type")}
                if t.get("predicted_n") is not None and t["predicted_n"] != len(out):
                    res["predicted_n"] = t["predicted_n"]  # tokens returned vs counted: should never differ
                if args.mode != "plain":
                    st = {"draft_tokens_proposed": int(t.get("draft_n") or 0),
                          "draft_tokens_accepted": int(t.get("draft_n_accepted") or 0)}
                    res["speculative_stats"] = st
                    all_stats.append(st)
                results.append(res)
                log(f"[llama.cpp {args.mode}] rep {rep} prompt {i}: {len(out)} tok, ttft {res['ttft_s']:.4f}s, "
                    f"{res['tokens_per_s'] or 0:.1f} tok/s")
        peak = srv.peak_rss_bytes()
    except Exception as e:  # noqa: BLE001
        log(traceback.format_exc())
        tail = srv.log_tail()
        srv.stop()
        emit({**base, "config": config, "error": str(e) or type(e).__name__, "stage": "generate",
              "results": results, "server_log_tail": tail}, 2)
    srv.stop()
    emit({**base, "config": config, "results": results,
          "speculative_stats": sum_stats(all_stats) if args.mode != "plain" else None,
          "peak_rss_bytes": peak, "peak_rss_note": "llama-server's VmHWM (the models live in that process)"}, 0)


if __name__ == "__main__":
    main()

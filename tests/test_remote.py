"""Remote targets (remote.py): drafts here, verification on a real vLLM server started by a fixture on
127.0.0.1 (`edgespec serve-target`, the fleet extra; the README's test command installs it). Greedy output
must equal vLLM's own greedy decoding; a killed server falls back to the local target with no token lost or
duplicated; a server with the wrong model or vocabulary is refused at connect; malformed replies are refused.
The server is killed by the last test of this module."""
import dataclasses
import json
import os
import signal
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import edgespec
from edgespec import serve
from edgespec.contract import Manifest
from edgespec.remote import RemoteConfig, RemoteError, RemoteUnavailable, _Failure
from edgespec.backends.remote import RemoteTarget
from edgespec.backends.remote_decoder import TokenCache
from edgespec.tokenizer import TextTokenizer

MODELS = Path(__file__).resolve().parents[1] / "models"
PROMPTS = ["def read_config(path):\n", "import os\nimport sys\n\n\ndef main(argv=None):\n", "class Stack:\n"]


# -- without a server ------------------------------------------------------------------------------------
def test_token_cache_commit_rewind_and_follower():
    class Follower:  # records what the local cache is told
        def __init__(self):
            self.lengths = np.zeros(2, np.int64)

        def commit(self, n):
            self.lengths = self.lengths + n

        def rewind_to(self, lengths):
            self.lengths = np.asarray(lengths).copy()

    c = TokenCache(2, max_context=10)
    c.write([[1, 2, 3], [4, 5, 0]])
    c.commit(np.array([3, 2]))
    assert c.tokens == [[1, 2, 3], [4, 5]] and c.lengths.tolist() == [3, 2]
    with pytest.raises(ValueError, match="can keep"):
        c.commit(np.array([0, 2]))  # only one written row of sequence 1 is left
    c.local = f = Follower()
    c.write([[7], [8]])
    c.follower = f
    c.commit(1)
    assert c.tokens == [[1, 2, 3, 7], [4, 5, 8]] and f.lengths.tolist() == [1, 1]
    c.rewind_to(np.array([2, 3]))
    assert c.tokens == [[1, 2], [4, 5, 8]] and f.lengths.tolist() == [1, 1] and c.follower is None
    c.rewind_to(0)
    assert f.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match="max context is 10"):
        c.reserve(11)


@pytest.mark.parametrize("kw,msg", [(dict(url="localhost:8000"), "http://HOST:PORT"),
                                    (dict(deadline_s=0), "deadline_s"),
                                    (dict(backoff_s=2.0, backoff_max_s=1.0), "backoff_max_s"),
                                    (dict(on_failure="hold"), "on_failure")])
def test_remote_config_refuses_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RemoteConfig(**{"url": "http://127.0.0.1:8000", **kw})


def test_serve_target_command_has_the_protocol_flags():
    argv, plain = serve.command(MODELS / "demo-target", port=8011, python="python3")
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size"):
        assert flag in argv and flag in plain
    assert argv[argv.index("--max-logprobs") + 1] == "-1" and plain.startswith("vllm serve ")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model folder"):
        serve.command(MODELS, port=8011, python="python3")


def test_serve_target_setup_refuses_a_full_disk_before_pip_runs(tmp_path, monkeypatch):
    """A fresh vLLM environment on a nearly full disk is refused by name, before pip fails midway."""
    ran = []
    monkeypatch.setattr(serve.subprocess, "run", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(serve.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100 * 2**30, 98 * 2**30,
                                                                                      int(2.5 * 2**30)))
    with pytest.raises(RuntimeError, match=r"2\.5 GiB free, and a fresh .*venv-vllm needs about 6 GiB"):
        serve.setup_env(tmp_path / ".venv-vllm")
    assert ran == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("die", [True, False])
def test_a_started_server_dies_with_the_process_that_started_it(die):
    """serve.start: a caller killed outright (a test run stopped with SIGKILL or SIGTERM runs no fixture teardown)
    leaves no server behind; die_with_parent=False keeps it (the caller stops it)."""
    import subprocess
    code = ("import sys, time; from pathlib import Path; from edgespec import serve; "
            "serve.command = lambda *a, **k: ([sys.executable, '-c', 'import time; time.sleep(120)'], ''); "
            f"p = serve.start(Path('m'), 0, die_with_parent={die}); print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()

    def alive():
        try:  # the child is not ours: a zombie is reaped by init once it has exited
            os.kill(child, 0)
            stat = Path(f"/proc/{child}/stat").read_text()
            return stat.split(")")[1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False
    deadline = time.monotonic() + (10 if die else 2)  # dies within a moment; one that lives does so past 2 s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert alive() != die
    finally:
        if alive():
            os.killpg(child, signal.SIGKILL)


def test_remote_needs_a_local_vocabulary_side():
    with pytest.raises(ValueError, match="local=TARGET_ENGINE_DIR"):
        edgespec.load("http://127.0.0.1:9", draft="ngram")
    with pytest.raises(ValueError, match="hidden state"):
        edgespec.load("http://127.0.0.1:9", draft="head")
    with pytest.raises(ValueError, match="go with a target URL"):
        edgespec.load("engines/demo-target", local="engines/demo-target")


# -- against a real vLLM server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("remote")
    for name in ("demo-target", "demo-draft"):
        export_engine(MODELS / name, root / name, max_context=512, progress=False)
    return root / "demo-target", root / "demo-draft"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import vllm_server
    yield from vllm_server(tmp_path_factory, MODELS / "demo-target", max_model_len=1024)


def _vllm_greedy(url: str, ids: list[int], n: int) -> list[int]:
    import http.client
    from urllib.parse import urlsplit
    p = urlsplit(url)
    c = http.client.HTTPConnection(p.hostname, p.port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"model": "demo-target", "prompt": ids, "max_tokens": n,
                                                     "temperature": 0.0, "return_token_ids": True}),
              {"Content-Type": "application/json"})
    return json.loads(c.getresponse().read())["choices"][0]["token_ids"]


def test_greedy_remote_equals_vllm_greedy_and_reads_the_prefix_cache(server, engines):
    url, _ = server
    target, draft = engines
    gen = edgespec.load(url, draft=draft, local=target, gamma=4, lookup=3)
    for p in PROMPTS:
        out = gen.generate(p, max_new_tokens=48)
        want = _vllm_greedy(url, gen.encode(p), len(out.token_ids))
        assert out.token_ids == want, p
        assert out.stats.fallbacks == 0 and out.stats.accepted > 0
    c = gen.target.counters
    assert c.requests > 0 and c.fallbacks == 0 and not c.failures
    assert c.cached_tokens > 0, "verify calls never read the prefix cache (is the edgespec plugin loaded?)"
    assert c.recomputes == 0
    # the plugin's rows: a cached prefix comes back as null rows, the new positions as computed ones
    eng, ids = gen.target, list(range(1, 70))
    body = {"model": "demo-target", "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1, "return_token_ids": True,
            "cache_salt": "rows", "vllm_xargs": {"edgespec_verify": 1}}
    eng.http.request("POST", "/v1/completions", dict(body, prompt=ids), 60)
    r = eng.http.request("POST", "/v1/completions", dict(body, prompt=ids + [5, 6, 7]), 60)
    rows = r["choices"][0]["prompt_logprobs"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert rows[:65] == [None] * 65 and all(row is not None for row in rows[65:])
    assert eng._parse(r, [ids + [5, 6, 7]], [69], False)[0].shape == (3,)


def test_pipelined_rounds_equal_vllm_greedy_and_some_bets_win(server, engines):
    url, _ = server
    target, draft = engines
    for lookup in (0, 3):
        gen = edgespec.load(url, draft=draft, local=target, gamma=4, lookup=lookup,
                            remote=RemoteConfig(url, pipeline=True))
        for p in PROMPTS:
            out = gen.generate(p, max_new_tokens=48)
            assert out.token_ids == _vllm_greedy(url, gen.encode(p), len(out.token_ids)), (lookup, p)
        c = gen.target.counters
        assert c.prefetched > 0 and 0 < c.prefetch_hits <= c.prefetched and c.fallbacks == 0, c


def test_auto_gamma_measures_the_remote_costs(server, engines):
    url, _ = server
    target, draft = engines
    gen = edgespec.load(url, draft=draft, local=target, gamma="auto", lookup=3)
    assert gen.cost is not None and gen.target.counters.requests > 0  # the load-time probes ran on the server
    out = gen.generate(PROMPTS[2], max_new_tokens=32)
    assert out.token_ids == _vllm_greedy(url, gen.encode(PROMPTS[2]), len(out.token_ids))
    assert out.stats.drafted > 0 and out.stats.fallbacks == 0


def test_batch_and_plain_remote_equal_local_plain(server, engines):
    url, _ = server
    target, draft = engines
    local = edgespec.load(target)
    want = [o.token_ids for o in local.generate(PROMPTS[:2], max_new_tokens=24)]
    for kw in (dict(draft=draft, gamma=3), dict(draft=None, gamma=0)):
        gen = edgespec.load(url, local=target, **kw)
        got = [o.token_ids for o in gen.generate(PROMPTS[:2], max_new_tokens=24)]
        assert got == want and gen.target.counters.fallbacks == 0, kw


def test_sampled_remote_reads_full_distributions(server, engines):
    url, _ = server
    target, draft = engines
    gen = edgespec.load(url, draft=draft, local=target, gamma=3)
    assert gen.target.full_distribution
    out = gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=1)
    assert len(out.token_ids) == 12 and out.stats.fallbacks == 0 and out.stats.drafted > 0
    gen.target.full_distribution = False  # what a server started without --max-logprobs -1 reports
    with pytest.raises(RemoteError, match="full distribution"):
        gen.generate(PROMPTS[0], max_new_tokens=4, temperature=0.8, seed=1)


def test_wrong_model_or_vocabulary_is_refused_at_connect(server, engines, tmp_path):
    url, _ = server
    target, _ = engines
    m = Manifest.read(target)
    tok = TextTokenizer.from_engine(target, m)
    with pytest.raises(RemoteError, match="does not serve model 'other'"):
        RemoteTarget(RemoteConfig(url, model="other"), m, target, tok)
    with pytest.raises(RemoteError, match="vocabulary of 4096 tokens"):
        RemoteTarget(RemoteConfig(url), dataclasses.replace(m, vocab_size=5000), target, tok)
    # same tokenizer and vocabulary, another model (the draft) as the local target: its outputs give it away
    from edgespec.backends import open_engine
    _, draft = engines
    with pytest.raises(RemoteError, match="is not the target in .*total variation"):
        RemoteTarget(RemoteConfig(url), m, target, tok, open_engine(draft))
    from conftest import char_tokenizer_json
    char_tokenizer_json(tmp_path / "tokenizer.json")
    with pytest.raises(RemoteError, match="tokenizes differently"):
        RemoteTarget(RemoteConfig(url), m, target, TextTokenizer(tmp_path / "tokenizer.json"))


def test_malformed_replies_are_refused(server, engines):
    url, _ = server
    target, draft = engines
    eng = edgespec.load(url, draft=draft, local=target, gamma=3).target
    prompt = [[5, 6, 7, 8, 9]]
    real = eng.http.request("POST", "/v1/completions", {"model": "demo-target", "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0.0, "prompt_logprobs": 1,
                                                        "return_token_ids": True}, 30)
    assert eng._parse(real, prompt, [2], False)[0].shape == (3,)

    def broken(edit):
        r = json.loads(json.dumps(real))
        edit(r["choices"][0])
        return r
    cases = {"no prompt logprobs": broken(lambda c: c.pop("prompt_logprobs")),
             "two generated tokens": broken(lambda c: c.update(token_ids=[1, 2])),
             "an id outside the vocabulary": broken(lambda c: c.update(token_ids=[99999])),
             "rows missing": broken(lambda c: c.update(prompt_logprobs=c["prompt_logprobs"][:2])),
             "no choices": {"choices": []}}
    for what, reply in cases.items():
        eng.http.request = lambda *a, _r=reply: _r  # the server's reply, edited on the way
        with pytest.raises(_Failure, match="unexpected reply") as e:
            eng._complete(prompt, [2], "salt", False, cached=True)
        assert e.value.kind == "malformed", what


def test_deadline_miss_falls_back_then_reconnects(server, engines):
    url, _ = server
    target, draft = engines
    plain = edgespec.load(target).generate(PROMPTS[1], max_new_tokens=32).token_ids
    cfg = RemoteConfig(url, deadline_s=1e-4, backoff_s=0.01, backoff_max_s=0.02)
    gen = edgespec.load(url, draft=draft, local=target, gamma=3, remote=cfg)
    out = gen.generate(PROMPTS[1], max_new_tokens=32)
    c = gen.target.counters
    assert out.token_ids == plain and out.stats.fallbacks > 0 and c.failures.get("deadline", 0) > 0
    gen.target.config = dataclasses.replace(cfg, deadline_s=30.0)  # the network recovers
    t0 = time.monotonic()
    while not gen.target.available():  # the identity check runs on its own thread: decoding never waits
        assert time.monotonic() - t0 < 30, "no reconnect within 30 s"
        time.sleep(0.01)
    out = gen.generate(PROMPTS[1], max_new_tokens=32)
    assert out.token_ids == plain and out.stats.fallbacks == 0 and c.reconnects >= 1


def test_killed_server_falls_back_with_no_token_lost(server, engines):
    """Last in the module: it kills the server."""
    url, proc = server
    target, draft = engines
    plain = edgespec.load(target).generate(PROMPTS[0], max_new_tokens=96)
    gen = edgespec.load(url, draft=draft, local=target, gamma=4,
                        remote=RemoteConfig(url, deadline_s=5.0, pipeline=True))
    strict = edgespec.load(url, draft=draft, local=target, gamma=4,
                           remote=RemoteConfig(url, on_failure="raise"))
    # first the server hangs (SIGSTOP: it accepts connections and never answers): the verify misses its
    # deadline, decoding goes on locally, and the identity check that follows hangs on its own thread
    hung = edgespec.load(url, draft=draft, local=target, gamma=4,
                         remote=RemoteConfig(url, deadline_s=0.5, connect_timeout_s=60, backoff_s=0.01))
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        out = hung.generate(PROMPTS[0], max_new_tokens=48)
        assert out.token_ids == plain.token_ids[:48] and out.stats.fallbacks > 0
        assert hung.target.counters.failures.get("deadline", 0) >= 1
        assert hung.target._recheck is not None and hung.target._recheck.is_alive(), \
            "the identity check of a hanging server ended (or never started) before decoding did"
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    pieces = []
    for i, piece in enumerate(gen.stream(PROMPTS[0], max_new_tokens=96)):
        pieces.append(piece)
        if i == 5:
            serve.stop(proc)
    assert "".join(pieces) == plain.text
    assert gen.last_stats.new_tokens == 96 and gen.last_stats.fallbacks > 0
    assert gen.target.counters.failures.get("connection", 0) >= 1
    with pytest.raises(RemoteUnavailable, match="on_failure is 'raise'"):
        strict.generate(PROMPTS[0], max_new_tokens=8)
    with pytest.raises(RemoteUnavailable, match="cannot reach the server at load"):
        edgespec.load(url, draft=draft, gamma=3)
    later = edgespec.load(url, draft=draft, local=target, gamma=4)  # starts on the local target
    assert later.generate(PROMPTS[0], max_new_tokens=96).token_ids == plain.token_ids

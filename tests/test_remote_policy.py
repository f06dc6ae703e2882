"""A VLA policy verified on a real vLLM server (remote.py's embeddings path), started by a fixture on
127.0.0.1 from the bundled policy's target checkpoint: its actions equal the local policy's, a server with
another model is refused at connect, malformed replies are refused, and when the server dies the policy
falls back to its own target (exact) or, configured to, raises RemoteUnavailable, which the control loop
turns into hold-then-stop; the loop profile counts both. The server is killed by the last test."""
from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from edgespec import serve
from edgespec.contract import Manifest
from edgespec.backends import open_engine
from edgespec.policy import load_policy
from edgespec.remote import RemoteConfig, RemoteError, RemoteUnavailable, _Failure
from edgespec.backends.remote import RemoteTarget
from edgespec.backends.remote_decoder import TokenCache
from edgespec.tensorfile import torch_bytes

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
INSTRUCTIONS = ["reach the red target", "go to the blue target", "touch the green target"]


# -- without a server ------------------------------------------------------------------------------------
def test_tensor_file_loads_in_torch_as_the_same_array():
    torch = pytest.importorskip("torch", reason="the export extra (torch) reads the file back")
    rng = np.random.default_rng(0)
    for shape in [(3,), (12, 256), (2, 300, 5)]:
        x = rng.normal(size=shape).astype(np.float32)
        t = torch.load(io.BytesIO(torch_bytes(x)), weights_only=True)
        assert t.dtype == torch.float32 and tuple(t.shape) == shape and np.array_equal(t.numpy(), x)
    with pytest.raises(ValueError, match="NaN or inf"):
        torch_bytes(np.array([1.0, np.nan]))


def test_serve_command_for_a_checkpoint_without_a_tokenizer():
    argv, plain = serve.command(MODELS / "vla-reacher" / "target", port=8013, python="python3")
    for flag in ("--skip-tokenizer-init", "--enable-prompt-embeds", "--enable-prefix-caching"):
        assert flag in argv and flag in plain
    assert argv[argv.index("--max-model-len") + 1] == "64"  # its config's max_position_embeddings
    text, _ = serve.command(MODELS / "demo-target", port=8013, python="python3")
    assert "--enable-prompt-embeds" not in text and text[text.index("--max-model-len") + 1] == "2048"


def test_token_cache_keeps_embedding_rows_with_the_ids():
    c = TokenCache(1, max_context=16, width=2)
    c.write([[-1, -1, 5]], [np.arange(6, dtype=np.float32).reshape(3, 2)])
    c.commit(2)
    assert c.tokens == [[-1, -1]] and c.rows[0].tolist() == [[0, 1], [2, 3]]
    c.write([[7, 8]], [np.full((2, 2), 9, np.float32)])
    c.commit(1)
    assert c.tokens == [[-1, -1, 7]] and c.rows[0].shape == (3, 2) and c.rows[0][-1].tolist() == [9, 9]
    c.rewind_to(1)
    assert c.tokens == [[-1]] and c.rows[0].tolist() == [[0, 1]]


# -- against a real vLLM server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy_dir():
    from edgespec.export.bundled import ensure_policy_engines
    return ensure_policy_engines(MODELS, ROOT / "engines")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import vllm_server
    yield from vllm_server(tmp_path_factory, MODELS / "vla-reacher" / "target")


def _observations(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        yield img, rng.normal(size=6) * 0.2, INSTRUCTIONS[i % len(INSTRUCTIONS)]


@pytest.mark.parametrize("draft,mode", [("head", "greedy"), (False, "greedy"), ("head", "relaxed")])
def test_remote_policy_acts_as_the_local_policy(server, policy_dir, draft, mode):
    url, _ = server
    local = load_policy(policy_dir, draft=draft, mode=mode)
    remote = load_policy(policy_dir, draft=draft, mode=mode, remote=url)
    for img, state, instr in _observations(4):
        assert np.array_equal(remote.act(img, state, instr), local.act(img, state, instr))
        assert remote.last_info["fallbacks"] == 0
        assert remote.last_info["target_calls"] == local.last_info["target_calls"]
    c = remote.remote.counters
    assert c.requests >= 4 and c.fallbacks == 0 and not c.failures


def test_another_model_is_refused_at_connect(server, policy_dir):
    url, _ = server
    draft = open_engine(policy_dir / "draft")  # same vocabulary and width as the target: only its outputs differ
    emb = np.load(draft.dir / draft.manifest.embedding_file)
    with pytest.raises(RemoteError, match="is not the target in .*total variation"):
        RemoteTarget(RemoteConfig(url), draft.manifest, draft.dir, None, draft, emb)
    narrow = dataclasses.replace(Manifest.read(policy_dir / "target"), hidden_size=96)
    with pytest.raises(RemoteError, match="refused a probe of 8 embeddings of width 96"):
        RemoteTarget(RemoteConfig(url), narrow, policy_dir / "target", None, None, np.zeros((256, 96), np.float32))
    text = ROOT / "engines" / "demo-target"
    if text.is_dir():  # a text target's client against this tokenizer-less server
        from edgespec.tokenizer import TextTokenizer
        tm = Manifest.read(text)
        with pytest.raises(RemoteError, match="does not tokenize text"):
            RemoteTarget(RemoteConfig(url), tm, text, TextTokenizer.from_engine(text, tm))


def test_malformed_embeddings_replies_are_refused(server, policy_dir):
    url, _ = server
    pol = load_policy(policy_dir, remote=url)
    eng = pol.remote
    rows = np.load(policy_dir / "target" / "embedding.npy")[[3, 10, 17, 24]]
    assert eng.verify_embeds(rows, 2, "salt").shape == (2,)
    real = eng._http().request("POST", "/v1/completions", {
        "model": eng.model, "prompt_embeds": [base64.b64encode(torch_bytes(rows[:e])).decode() for e in (3, 4)],
        "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}, 30)

    def broken(edit):
        r = json.loads(json.dumps(real))
        edit(r)
        return r
    cases = {"one choice for two prompts": broken(lambda r: r["choices"].pop()),
             "two generated tokens": broken(lambda r: r["choices"][0].update(token_ids=[1, 2])),
             "an id outside the range": broken(lambda r: r["choices"][1].update(token_ids=[256])),
             "no token ids": broken(lambda r: r["choices"][0].pop("token_ids"))}
    for what, reply in cases.items():
        eng._http().request = lambda *a, _r=reply: _r  # the server's reply, edited on the way
        with pytest.raises(_Failure, match="unexpected reply") as e:
            eng.verify_embeds(rows, 2, "salt")
        assert e.value.kind == "malformed", what


def test_killed_server_falls_back_or_holds_and_the_loop_profile_counts_it(server, policy_dir):
    """Last in the module: it kills the server."""
    pytest.importorskip("mujoco", reason="the reacher needs the robots extra (mujoco)")
    from edgespec.robots.loop import ControlLoop, LoopConfig
    from edgespec.robots.profile import loop_profile
    from edgespec.robots.reacher import ReacherRobot

    url, proc = server
    local = load_policy(policy_dir, draft="head")
    falls_back = load_policy(policy_dir, draft="head", remote=RemoteConfig(url, backoff_s=0.05))
    holds = load_policy(policy_dir, draft="head", remote=RemoteConfig(url, on_failure="raise"))
    obs = list(_observations(3, seed=1))
    assert np.array_equal(falls_back.act(*obs[0]), local.act(*obs[0]))

    class KillsTheServer:  # the policy, and the server dies during its third call
        def __init__(self, policy):
            self.policy, self.calls = policy, 0

        @property
        def last_info(self):
            return self.policy.last_info

        def __call__(self, o):
            self.calls += 1
            if self.calls == 3:
                serve.stop(proc)
            return self.policy(o)

    with ReacherRobot(seed=1, color="red") as robot:
        rep = ControlLoop(robot, KillsTheServer(falls_back), LoopConfig(hz=20, hold_s=1.0)).run(2.5)
        final = robot.env.distance()
    prof = loop_profile(rep)
    assert prof["remote"]["fallbacks"] > 0 and prof["remote"]["unavailable"] == 0, prof["remote"]
    assert rep.safe_stop_reason == "" and not rep.faults and final < 0.02, (rep.faults, final)
    for o in obs[1:]:  # the same actions, now from the local target
        assert np.array_equal(falls_back.act(*o), local.act(*o)) and falls_back.last_info["fallbacks"] > 0

    with pytest.raises(RemoteUnavailable, match="on_failure is 'raise'"):
        holds.act(*obs[0])
    with ReacherRobot(seed=1, color="red") as robot:
        start = robot.env.distance()
        rep = ControlLoop(robot, holds, LoopConfig(hz=20, hold_s=0.5)).run(1.5)
        moved = abs(robot.env.distance() - start)
    prof = loop_profile(rep)
    assert prof["remote"]["unavailable"] >= 1 and prof["inferences"].get("raised", 0) >= 1, prof
    assert "RemoteUnavailable" in rep.faults[0] and rep.safe_stop_reason, (rep.faults, rep.safe_stop_reason)
    assert rep.sent == 0 and moved < 0.01, (rep.sent, moved)  # held where it stood, then stopped
    with pytest.raises(RemoteUnavailable, match="cannot reach the server at load"):
        load_policy(policy_dir, remote=RemoteConfig(url, on_failure="raise"))
    later = load_policy(policy_dir, draft="head", remote=url)  # server down: starts on the local target
    assert np.array_equal(later.act(*obs[2]), local.act(*obs[2])) and later.last_info["fallbacks"] > 0

"""A target on a vLLM server: the device drafts, the server verifies, edgespec's own rules accept.

    gen = edgespec.load("http://127.0.0.1:8000", draft="engines/demo-draft", local="engines/demo-target")

`RemoteTarget` stands where a target engine stands (`.manifest`, `.decoder(batch)`), so the speculative
round, the acceptance rules, auto γ and the statistics are the same code as on the device. Its decoder's
"KV cache" is the committed token ids per sequence (`TokenCache`): the K/V rows live in vLLM's prefix cache.

One verify = one `/v1/completions` call per round (one prompt per sequence): prompt = committed tokens + the
call's S new tokens, `max_tokens` 1 at temperature 0. `prompt_logprobs` gives the target's top token at each
new position but the last, the generated token is the last's (greedy: only ids are read). Sampled
acceptance reads the full distribution (`prompt_logprobs` and `logprobs` -1) and is refused, with the
reason, when the server does not return all of it (`--max-logprobs -1`).

Prefix caching: vLLM skips its prefix cache for prompt-logprob requests; the edgespec plugin it loads
(vllm_plugin.py) lets verify calls read it. Each generation sends its own cache salt, so a call can only hit
its own generation's earlier calls, which end before the call's first new position; every row read is also
checked (a skipped row holds vllm_plugin.SKIPPED_LOGPROB) and the call is asked again without the cache if
one ever is. `RemoteTarget.counters` reports the prompt tokens sent and how many the cache held.

An inputs_embeds target (a VLA policy's, `load_policy(..., remote=URL)`) is served with embedding prompts:
its verify sends the committed rows and the new ones as embeddings (tensorfile.py), and, because vLLM
returns no prompt log-probabilities for embedding prompts, one prompt per position the caller reads (the
rows up to it, one generated token), all in one call (`verify_embeds`). Greedy and relaxed acceptance only.

Failure (deadline, refused, reset, HTTP error, malformed reply): the call runs on the local target engine
(`local=`), which first catches up on the committed tokens; the output stays exact. Without a local target
the call raises `RemoteUnavailable` (a robot's control loop then holds, then stops). Either way it is
counted. The server is retried after a back-off that doubles up to `backoff_max_s`; a server is trusted only
after its identity check (served model, tokenizer, vocabulary, and its next-token distribution after a
probe against the local target's), at load and after every failure (then on a thread of its own, so a
server that hangs never stalls decoding).
"""
from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from .contract import EngineError, Manifest
from .tensorfile import torch_bytes

VERIFY_FLAG = {"edgespec_verify": 1}  # vllm_xargs: this call may read the prefix cache (vllm_plugin.py)
FINGERPRINT_TV = 0.1  # the most the server's probe distribution may differ from the local target's
PROBE_TEXT = "def read_config(path):\n    return {'größe': 1, \"naïve\": [0.5, -2]}  # ✓ done\n"
ON_FAILURE = ("local", "raise")


class RemoteError(EngineError):
    """The server is not the target it must be (model, tokenizer, vocabulary) or cannot do what was asked."""


class RemoteUnavailable(RuntimeError):
    """A verify failed (deadline, refused, malformed reply) and there is no local target to fall back to."""


class _Failure(Exception):
    """One failed call; kind is what the counters file it under (status: the HTTP status, for kind "http")."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind, self.status = kind, status


@dataclass
class RemoteConfig:
    url: str  # http://HOST:PORT of an OpenAI-compatible vLLM server
    model: str | None = None  # the served model name to expect (None: the server must serve exactly one)
    deadline_s: float = 2.0  # a verify not answered within this (per socket operation) fails over
    connect_timeout_s: float = 5.0  # the identity check at load and after a failure
    backoff_s: float = 0.25  # first wait before retrying a failed server; doubles per failure ...
    backoff_max_s: float = 4.0  # ... up to this
    on_failure: str = "local"  # "local": the call runs on the local target; "raise": RemoteUnavailable
    pipeline: bool = False  # one greedy sequence: while a verify is out, draft and send the next round's,
    #                         betting that every draft is accepted (pipeline.py); costs server work on a miss

    def __post_init__(self):
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://HOST:PORT (a vLLM server), got {self.url!r}")
        for name in ("deadline_s", "connect_timeout_s", "backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a number > 0 (seconds), got {v!r}")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_s ({self.backoff_s})")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")


def is_url(target) -> bool:
    return isinstance(target, str) and target.startswith(("http://", "https://"))


class _Http:
    """One keep-alive connection; every error becomes a _Failure with its kind."""

    def __init__(self, url: str):
        p = urlsplit(url)
        self.url, self.https = url.rstrip("/"), p.scheme == "https"
        self.host, self.port = p.hostname, p.port or (443 if self.https else 80)
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method: str, path: str, body: dict | None, timeout: float) -> dict:
        """One request; `timeout` bounds the whole exchange (connect, send, the reply's arrival and its
        reading), each socket wait getting what is left of it."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        end = time.monotonic() + timeout

        def left() -> float:
            t = end - time.monotonic()
            if t <= 0:
                raise TimeoutError("deadline passed")
            return t
        try:
            if self.conn is None:
                self.conn = cls(self.host, self.port, timeout=timeout)
            self.conn.timeout = timeout
            if self.conn.sock is not None:
                self.conn.sock.settimeout(left())
            data = json.dumps(body).encode() if body is not None else None
            self.conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
            self.conn.sock.settimeout(left())
            resp = self.conn.getresponse()
            chunks = []
            while True:  # read in pieces, so a reply that trickles in cannot outlast the deadline
                if self.conn.sock is not None:
                    self.conn.sock.settimeout(left())
                piece = resp.read1(1 << 16)
                if not piece:
                    break
                chunks.append(piece)
            resp.close()  # the reply is read: the connection can take the next request
            raw = b"".join(chunks)
        except (TimeoutError, socket.timeout) as e:
            self.close()
            raise _Failure("deadline", f"{self.url}{path}: no answer within {timeout:g} s ({e})") from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            self.close()
            raise _Failure("connection", f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if resp.status != 200:
            raise _Failure("http", f"{self.url}{path}: HTTP {resp.status}: {raw[:300].decode(errors='replace')}",
                           resp.status)
        try:
            return json.loads(raw)
        except ValueError:
            raise _Failure("malformed", f"{self.url}{path}: the reply is not JSON: {raw[:120]!r}") from None


@dataclass
class Counters:
    """What a RemoteTarget did, over its lifetime (all its decoders)."""
    requests: int = 0  # verify calls the server answered
    fallbacks: int = 0  # calls that ran on the local target instead
    failures: dict = field(default_factory=dict)  # kind -> count: deadline, connection, http, malformed
    reconnects: int = 0  # identity checks passed after a failure
    recomputes: int = 0  # calls asked again without the prefix cache (a skipped row came back)
    prefetched: int = 0  # pipelined: verifies sent for the all-accepted branch before the current one returned
    prefetch_hits: int = 0  # ... of which the bet won: the round found its verify already sent
    prompt_tokens: int = 0  # tokens sent in verify prompts
    cached_tokens: int = 0  # of those, how many the server's prefix cache held
    server_s: float = 0.0  # wall time waiting on the server

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cached_share"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        d["prefetch_hit_rate"] = self.prefetch_hits / self.prefetched if self.prefetched else 0.0
        return d


class RemoteTarget:
    """A vLLM server as a target "engine". manifest: the vocabulary side (a local target's or the draft's
    manifest: vocabulary, tokenizer, EOS), its max context capped at the server's. local: an engine of the
    same target to fall back on (on_failure "local"), or None. An inputs_embeds target (a VLA policy's)
    needs `embedding` (V, E), the table its action ids are embedded with, and has no tokenizer."""

    provider = "remote"

    def __init__(self, config: RemoteConfig, manifest: Manifest, manifest_dir: Path, tokenizer, local=None,
                 embedding: np.ndarray | None = None):
        if config.on_failure == "local" and local is None:
            config = dataclasses.replace(config, on_failure="raise")
        if manifest.input_mode == "embeds":
            want = (manifest.vocab_size, manifest.hidden_size)
            if embedding is None or embedding.shape != want:
                raise ValueError(f"{manifest_dir}: an inputs_embeds target needs its embedding table {want}, got "
                                 f"{None if embedding is None else embedding.shape}")
            embedding = np.ascontiguousarray(embedding, np.float32)
        self.config, self.tok, self.local, self.embedding = config, tokenizer, local, embedding
        self.dir = manifest_dir  # where the vocabulary side came from (errors name it)
        self.counters = Counters()
        self.lock = threading.Lock()  # counters, from the pipelined verifies' threads too
        self.http = _Http(config.url)  # this thread's connection; pipelined verifies use their thread's own
        self._tls = threading.local()
        self._tls.http = self.http
        self._pool: ThreadPoolExecutor | None = None
        self.model: str | None = None  # the served name, once checked
        self.full_distribution: bool | None = None  # the server returns all V logprobs (sampled acceptance)
        self._trusted = False
        self._retry_at = 0.0
        self._backoff = config.backoff_s
        self._recheck: threading.Thread | None = None  # the identity check in flight after a failure
        self._recheck_error: RemoteError | None = None
        self.manifest = manifest
        try:
            self._check_identity()
        except _Failure as e:
            if local is None or config.on_failure == "raise":
                raise RemoteUnavailable(f"{config.url}: cannot reach the server at load ({e}); start it "
                                        f"(`edgespec serve-target MODEL`), or pass local= a target engine folder "
                                        f"and on_failure='local' to decode without it") from None
            self._failed(e)  # start on the local target; the server is retried after the back-off

    # -- the server's identity ------------------------------------------------------------------------
    def _check_identity(self, http: _Http | None = None) -> None:
        """Trust the server only if it serves the expected model with this tokenizer and vocabulary."""
        cfg, timeout, http = self.config, self.config.connect_timeout_s, http or self.http
        models = http.request("GET", "/v1/models", None, timeout)
        try:
            served = {m["id"]: m for m in models["data"]}
        except (KeyError, TypeError):
            raise _Failure("malformed", f"{cfg.url}/v1/models: expected {{'data': [{{'id': ...}}]}}, got "
                                        f"{str(models)[:200]}") from None
        if cfg.model is None and len(served) != 1:
            raise RemoteError(f"{cfg.url} serves {sorted(served)}; say which with model=")
        name = cfg.model or next(iter(served))
        if name not in served:
            raise RemoteError(f"{cfg.url} does not serve model {name!r} (it serves {sorted(served)}): "
                              f"wrong server, or start it with `edgespec serve-target` for that model")
        if self.tok is not None:
            try:
                got = http.request("POST", "/tokenize", {"model": name, "prompt": PROBE_TEXT,
                                                         "add_special_tokens": False}, timeout)
            except _Failure as e:
                if e.status is not None and 400 <= e.status < 500:
                    raise RemoteError(f"{cfg.url} model {name!r} does not tokenize text ({e}): it is not a text "
                                      f"target with {self.dir}'s tokenizer") from None
                raise
            want = self.tok.encode(PROBE_TEXT)
            if got.get("tokens") != want:
                raise RemoteError(f"{cfg.url} model {name!r} tokenizes differently from {self.dir} (probe text: "
                                  f"{str(got.get('tokens'))[:80]} vs {str(want)[:80]}): a different vocabulary; "
                                  f"the draft and the server's target must share one tokenizer")
        vocab = self._served_vocab(name, timeout, http)
        if vocab is not None and vocab != self.manifest.vocab_size:
            raise RemoteError(f"{cfg.url} model {name!r} has a vocabulary of {vocab} tokens, {self.dir} has "
                              f"{self.manifest.vocab_size}: not the same target")
        self._fingerprint(name, timeout, http, full=vocab is not None)
        max_len = served[name].get("max_model_len")
        if isinstance(max_len, int) and max_len < self.manifest.max_context:
            self.manifest = dataclasses.replace(self.manifest, max_context=max_len)
        self.full_distribution = vocab is not None
        self.model = name
        self._trusted = True

    def _probe(self) -> tuple[list[int], dict]:
        """The probe sequence's ids and how a request sends it (ids, or their embeddings for embeds targets)."""
        v = self.manifest.vocab_size
        if self.embedding is not None:
            ids = [(7 * i + 3) % v for i in range(8)]
            return ids, {"prompt_embeds": [_embeds_b64(self.embedding[ids])]}
        ids = self.tok.encode(PROBE_TEXT)[:16] if self.tok is not None else [(7 * i + 3) % v for i in range(8)]
        return ids, {"prompt": ids}

    def _fingerprint(self, name: str, timeout: float, http: _Http, full: bool) -> None:
        """The server's next-token distribution after a probe sequence against the local target's, when there
        is a local target and the server returns full distributions: a different model served under the
        expected name (or the same name after a restart) is refused. An embeds target's probe also checks
        that the server takes embeddings of this width."""
        ids, prompt = self._probe()
        if not full and self.embedding is None:
            return
        body = {"model": name, **prompt, "max_tokens": 1, "temperature": 0.0, "return_tokens_as_token_ids": True,
                "logprobs": -1 if full else 1}
        try:
            r = http.request("POST", "/v1/completions", body, timeout)
        except _Failure as e:
            if e.status is not None and 400 <= e.status < 500:
                raise RemoteError(f"{self.config.url} model {name!r} refused a probe of {len(ids)} embeddings of "
                                  f"width {self.manifest.hidden_size} ({e}); serve {self.dir}'s checkpoint with "
                                  f"--enable-prompt-embeds (edgespec serve-target does)") from None
            raise
        if not full or self.local is None:
            return
        try:
            served = {int(k.split(":")[1]): x for k, x in r["choices"][0]["logprobs"]["top_logprobs"][0].items()}
        except (KeyError, IndexError, TypeError, ValueError):
            raise _Failure("malformed", f"{self.config.url}: a probe reply without top_logprobs") from None
        p = np.full(self.manifest.vocab_size, -np.inf)
        p[list(served)] = list(served.values())
        dec = self.local.decoder(1, self.embedding)
        logits = (dec(None, embeds=self.embedding[ids][None]) if self.embedding is not None
                  else dec(np.asarray([ids], np.int64)))[0, -1].astype(np.float64)
        q = logits - np.logaddexp.reduce(logits)
        tv = 0.5 * float(np.abs(np.exp(p) - np.exp(q)).sum())
        if not tv <= FINGERPRINT_TV:
            raise RemoteError(f"{self.config.url} model {name!r} is not the target in {self.local.dir}: after a "
                              f"probe sequence their next-token distributions differ by {tv:.3f} in total "
                              f"variation (at most {FINGERPRINT_TV} between precisions of one model)")

    def _served_vocab(self, name: str, timeout: float, http: _Http) -> int | None:
        """The server's vocabulary size from one full next-token distribution, or None when it does not
        return full distributions (its max-logprobs is below the vocabulary)."""
        try:
            r = http.request("POST", "/v1/completions", {
                "model": name, "prompt": [0], "max_tokens": 1, "temperature": 0.0, "logprobs": -1,
                "return_tokens_as_token_ids": True}, timeout)
        except _Failure as e:
            if e.kind == "http":
                return None
            raise
        try:
            return len(r["choices"][0]["logprobs"]["top_logprobs"][0])
        except (KeyError, IndexError, TypeError):
            raise _Failure("malformed", f"{self.config.url}: a logprobs reply without top_logprobs") from None

    # -- availability and back-off --------------------------------------------------------------------
    def available(self) -> bool:
        """May the next call go to the server? After a failure: once the back-off has passed and the server
        has passed its identity check again. That check runs on a thread of its own, so a server that hangs
        never stalls decoding (the calls run locally meanwhile); a server that answers as another model
        raises its RemoteError here."""
        if self._trusted:
            return True
        if self._recheck is not None and not self._recheck.is_alive():
            self._recheck = None
            if self._recheck_error is not None:
                e, self._recheck_error = self._recheck_error, None
                raise e
            if self._trusted:
                return True
        if self._recheck is None and time.monotonic() >= self._retry_at:
            self._recheck = threading.Thread(target=self._reconnect, name="edgespec-reconnect", daemon=True)
            self._recheck.start()
        return False

    def _reconnect(self) -> None:
        """The identity check after a failure, on its own thread and connection."""
        http = _Http(self.config.url)
        try:
            self._check_identity(http)
        except _Failure as e:
            self._failed(e)
            return
        except RemoteError as e:
            self._recheck_error = e
            return
        finally:
            http.close()
        with self.lock:
            self.counters.reconnects += 1
        self._backoff = self.config.backoff_s

    def _failed(self, e: _Failure) -> None:
        c = self.counters
        with self.lock:
            c.failures[e.kind] = c.failures.get(e.kind, 0) + 1
        self._trusted = False
        self.http.close()
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, self.config.backoff_max_s)

    # -- one verify ---------------------------------------------------------------------------------
    def verify(self, prompts: list[list[int]], starts: list[int], salt: str, full: bool) -> list[np.ndarray]:
        """prompts[b]: committed tokens + the call's new tokens, which start at starts[b]. Returns, per
        sequence, the target's argmax ids (n,) at the n = len - start new positions (full=False), or its
        log-probabilities (n, V) there (full=True). Raises _Failure."""
        out = self._complete(prompts, starts, salt, full, cached=True)
        if out is None:  # a skipped row came back: ask again, computing everything
            with self.lock:
                self.counters.recomputes += 1
            out = self._complete(prompts, starts, salt, full, cached=False)
            if out is None:
                raise _Failure("malformed", f"{self.config.url}: a prompt-logprob row was not computed even "
                                            f"without the prefix cache")
        return out

    def _complete(self, prompts, starts, salt, full, cached) -> list[np.ndarray] | None:
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True, "cache_salt": salt, "ignore_eos": True}
        if any(len(p) - s > 1 for p, s in zip(prompts, starts)):
            body["prompt_logprobs"] = -1 if full else 1
        if full:
            body.update(logprobs=-1, return_tokens_as_token_ids=True)
        if cached:
            body["vllm_xargs"] = VERIFY_FLAG
        r = self._post(body)
        try:
            return self._parse(r, prompts, starts, full)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise _Failure("malformed", f"{self.config.url}/v1/completions: unexpected reply "
                                        f"({type(e).__name__}: {e}): {str(r)[:200]}") from None

    def _parse(self, r: dict, prompts, starts, full) -> list[np.ndarray] | None:
        v = self.manifest.vocab_size
        choices = sorted(r["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise ValueError(f"{len(choices)} choices for {len(prompts)} prompts")
        out = []
        for ch, p, s in zip(choices, prompts, starts):
            n = len(p) - s
            gen = ch["token_ids"]
            if len(gen) != 1:
                raise ValueError(f"expected 1 generated token, got {len(gen)}")
            rows = ch["prompt_logprobs"][s + 1:] if n > 1 else []  # row i: the distribution at position i-1
            if n > 1 and len(ch["prompt_logprobs"]) != len(p):
                raise ValueError(f"{len(ch['prompt_logprobs'])} prompt-logprob rows for a {len(p)}-token prompt")
            if full:
                last = {int(k.split(":")[1]): x for k, x in ch["logprobs"]["top_logprobs"][0].items()}
                if any(rw is None for rw in rows):
                    return None
                dist = np.empty((n, v), np.float32)
                for i, row in enumerate([{int(k): e["logprob"] for k, e in rw.items()} for rw in rows] + [last]):
                    if len(row) != v:
                        raise RemoteError(f"{self.config.url}: sampled acceptance needs the target's full "
                                          f"distribution at every verified position; the server returned "
                                          f"{len(row)} of {v} log-probabilities (start it with --max-logprobs -1)")
                    if max(row.values()) > 0:
                        return None
                    dist[i, list(row)] = list(row.values())
                out.append(dist)
                continue
            ids = np.empty(n, np.int64)
            for i, row in enumerate(rows):
                if row is None:  # the cache skipped this row (vllm_plugin): never a result
                    return None
                best = [(int(k), e["logprob"]) for k, e in row.items() if e["rank"] == 1]
                if len(best) != 1:
                    raise ValueError(f"prompt-logprob row {s + 1 + i} has no single rank-1 token: {row}")
                if best[0][1] > 0:  # vllm_plugin.SKIPPED_LOGPROB: the cache skipped this row
                    return None
                ids[i] = best[0][0]
            ids[n - 1] = gen[0]
            if ids.min() < 0 or ids.max() >= v:
                raise ValueError(f"token ids outside the vocabulary [0, {v}): {ids.tolist()}")
            out.append(ids)
        self._answered(r, sum(map(len, prompts)))
        return out

    def verify_embeds(self, rows: np.ndarray, n: int, salt: str) -> np.ndarray:
        """rows (L, E): a sequence's committed rows, then its new ones. Returns the target's argmax ids (n,)
        (within the manifest's argmax range) after each of the last n rows. vLLM returns no prompt
        log-probabilities for embedding prompts, so each of those positions is a prompt of its own (the rows
        up to it, one generated token), all n in one call, batched by the server. Raises _Failure."""
        lo, hi = self.manifest.argmax_range
        ends = range(len(rows) - n + 1, len(rows) + 1)
        body = {"model": self.model, "prompt_embeds": [_embeds_b64(rows[:e]) for e in ends], "max_tokens": 1,
                "temperature": 0.0, "return_token_ids": True, "cache_salt": salt, "ignore_eos": True}
        if (lo, hi) != (0, self.manifest.vocab_size):
            body["allowed_token_ids"] = list(range(lo, hi))  # the constrained argmax, as the engine's next_ids
        r = self._post(body)
        try:
            choices = sorted(r["choices"], key=lambda c: c["index"])
            if len(choices) != n or any(len(c["token_ids"]) != 1 for c in choices):
                raise ValueError(f"expected {n} choices of 1 generated token, got "
                                 f"{[len(c['token_ids']) for c in choices]}")
            ids = np.array([c["token_ids"][0] for c in choices], np.int64)
            if ids.min() < lo or ids.max() >= hi:
                raise ValueError(f"token ids outside the argmax range [{lo}, {hi}): {ids.tolist()}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise _Failure("malformed", f"{self.config.url}/v1/completions: unexpected reply "
                                        f"({type(e).__name__}: {e}): {str(r)[:200]}") from None
        self._answered(r, sum(ends))
        return ids

    def _post(self, body: dict) -> dict:
        """One verify call on this thread's connection, its wait counted in server_s. Raises _Failure."""
        t0 = time.perf_counter()
        try:
            return self._http().request("POST", "/v1/completions", body, self.config.deadline_s)
        finally:
            with self.lock:
                self.counters.server_s += time.perf_counter() - t0

    def _answered(self, r: dict, prompt_tokens: int) -> None:
        """Count a verify the server answered: its prompt tokens, and how many its prefix cache held."""
        usage = r.get("usage") or {}
        with self.lock:
            self.counters.prompt_tokens += prompt_tokens
            self.counters.cached_tokens += int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
            self.counters.requests += 1

    def _http(self) -> _Http:
        """The calling thread's connection (one request at a time per connection)."""
        conn = getattr(self._tls, "http", None)
        if conn is None:
            conn = self._tls.http = _Http(self.config.url)
        return conn

    def submit(self, prompt: list[int], start: int, salt: str) -> Future:
        """verify([prompt], [start], salt, False) on a worker thread: returns at once (pipelined rounds)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgespec-verify")
        return self._pool.submit(lambda: self.verify([prompt], [start], salt, False)[0])

    def decoder(self, batch: int = 1, embedding=None) -> "RemoteDecoder":
        """A decoder of `batch` sequences (an inputs_embeds target: one; `embedding`, if given, must be the
        table the target was made with)."""
        if self.embedding is None and embedding is not None:
            raise RemoteError(f"{self.dir} takes token ids; an embedding table is for inputs_embeds targets")
        if self.embedding is not None:
            if batch != 1:
                raise ValueError(f"a remote inputs_embeds target decodes one sequence at a time, got batch {batch}")
            if embedding is not None and not np.array_equal(np.asarray(embedding, np.float32), self.embedding):
                raise ValueError("the embedding table differs from the one this remote target was made with")
        return RemoteDecoder(self, batch)

    def close(self) -> None:
        self.http.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _embeds_b64(rows: np.ndarray) -> str:
    """(L, E) float32 rows as vLLM's prompt_embeds takes them: base64 of a torch.save file."""
    return base64.b64encode(torch_bytes(rows)).decode("ascii")


@dataclass
class Pending:
    """A verify in flight: its new tokens, how many tokens it was sent after, its future (None: run it
    locally when its result is asked for) and when it was sent."""
    new: list[int]
    base: int
    future: Future | None
    t0: float


class TokenCache:
    """A remote decoder's cache: the committed token ids per sequence (their K/V live in the server's
    prefix cache), with KVCache's verbs: reserve, wrote, commit, rewind_to. An inputs_embeds target's also
    keeps the committed rows' embeddings (`rows`, (L, E) per sequence; ids -1 where a row came as an
    embedding, e.g. a VLA prefix)."""

    def __init__(self, batch: int, max_context: int, width: int | None = None):
        self.max_context = max_context
        self.tokens: list[list[int]] = [[] for _ in range(batch)]  # committed
        self.pending: list[list[int]] = [[] for _ in range(batch)]  # written by the last call, not committed
        self.rows = [np.zeros((0, width), np.float32) for _ in range(batch)] if width else None  # committed
        self.pending_rows = [r[:0] for r in self.rows] if width else None
        self._lengths = np.zeros(batch, np.int64)
        self._view = self._lengths.view()
        self._view.flags.writeable = False
        self.local = None  # the local target's KVCache (once a call fell back), which may lag behind
        self.follower = None  # the local target's KVCache while its last call ran there: commits go to it too

    @property
    def lengths(self) -> np.ndarray:
        return self._view

    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return self.max_context

    def reserve(self, rows: int) -> None:
        if rows > self.max_context:
            raise ValueError(f"the remote target needs {rows} positions but its max context is {self.max_context}")

    def write(self, rows: list[list[int]], embeds: list[np.ndarray] | None = None) -> None:
        self.pending = [list(r) for r in rows]
        if self.rows is not None:
            self.pending_rows = list(embeds)

    def wrote(self, s: int) -> None:
        """S rows per sequence of unknown tokens (zeros): for timing only, as KVCache.wrote."""
        self.pending = [[0] * s for _ in self.tokens]
        if self.rows is not None:
            self.pending_rows = [np.zeros((s, r.shape[1]), np.float32) for r in self.rows]

    def commit(self, n) -> None:
        n = np.broadcast_to(np.asarray(n, np.int64), self._lengths.shape)
        if (n < 0).any() or any(int(k) > len(p) for k, p in zip(n, self.pending)):
            raise ValueError(f"commit({n.tolist()}): can keep 0..{[len(p) for p in self.pending]}")
        for b, k in enumerate(n.tolist()):
            self.tokens[b].extend(self.pending[b][:k])
            self.pending[b] = self.pending[b][k:]
            self._lengths[b] = len(self.tokens[b])
            if self.rows is not None:
                self.rows[b] = np.concatenate([self.rows[b], self.pending_rows[b][:k]])
                self.pending_rows[b] = self.pending_rows[b][k:]
        if self.follower is not None:
            self.follower.commit(n)

    def rewind_to(self, lengths) -> None:
        new = np.broadcast_to(np.asarray(lengths, np.int64), self._lengths.shape)
        if (new < 0).any() or (new > self._lengths).any():
            raise ValueError(f"rewind_to({new.tolist()}): lengths must be in 0..{self._lengths.tolist()}")
        for b, k in enumerate(new.tolist()):
            del self.tokens[b][k:]
            self.pending[b] = []
            self._lengths[b] = k
            if self.rows is not None:
                self.rows[b] = self.rows[b][:k]
                self.pending_rows[b] = self.rows[b][:0]
        self.follower = None
        if self.local is not None:  # the local cache may lag behind (it catches up when it is next used)
            self.local.rewind_to(np.minimum(self.local.lengths, new))


class RemoteDecoder:
    """The Decoder interface over a RemoteTarget: `ids(tokens)` / `__call__(tokens)` verify S new tokens per
    sequence after the committed ones; the caller commits what it keeps. Falls back to a local decoder."""

    def __init__(self, engine: RemoteTarget, batch: int):
        self.engine, self.m, self.batch = engine, engine.manifest, batch
        self.embedding = engine.embedding  # (V, E) for an inputs_embeds target, else None
        self.cache = TokenCache(batch, self.m.max_context, None if self.embedding is None else self.m.hidden_size)
        self.local = None  # the local target's Decoder, made at the first fallback
        self.salt = uuid.uuid4().hex  # per generation: the prefix cache only serves this one's own calls
        self.calls, self.engine_s, self.fallbacks = 0, 0.0, 0
        self.trace: list | None = None
        self.trace_name = "engine"
        self._last_ids: np.ndarray | None = None

    vocab_size = property(lambda self: self.m.vocab_size)
    max_context = property(lambda self: self.m.max_context)

    def reset(self) -> None:
        self.cache.rewind_to(0)
        if self.local is not None:
            self.local.reset()
        self.salt = uuid.uuid4().hex
        self.calls, self.engine_s, self.fallbacks, self.trace, self.trace_name = 0, 0.0, 0, None, "engine"

    # -- the calls ----------------------------------------------------------------------------------
    def ids(self, tokens: np.ndarray | None, valid: np.ndarray | None = None, embeds=None,
            last: int | None = None) -> np.ndarray:
        """(B, S) the target's argmax ids at the S new positions (rows past a sequence's valid count: 0).
        An inputs_embeds target takes ids (embedded with its table) or `embeds` (1, S, E), and computes only
        the `last` positions the caller reads (-1 before them)."""
        if self.embedding is not None:
            self._last_ids = self._call_embeds(tokens, valid, embeds, last)
        elif embeds is not None:
            raise RemoteError(f"{self.engine.dir} takes token ids, not embeddings")
        else:
            self._last_ids = self._call(tokens, valid, full=False)
        return self._last_ids

    def __call__(self, tokens: np.ndarray, valid: np.ndarray | None = None, embeds=None) -> np.ndarray:
        """(B, S, V) the target's log-probabilities at the S new positions (as logits: softmax gives the
        target's distribution). Needs a server that returns full distributions."""
        if self.embedding is not None:
            raise RemoteError("a remote inputs_embeds target verifies by ids only (greedy or relaxed acceptance): "
                              "vLLM returns no per-position distributions for embedding prompts")
        if self.engine.full_distribution is False:
            raise RemoteError(f"{self.engine.config.url}: sampled acceptance needs the target's full "
                              f"distribution at every verified position, and this server returns fewer "
                              f"log-probabilities than the vocabulary ({self.m.vocab_size}); restart it with "
                              f"--max-logprobs -1 (edgespec serve-target does), or decode greedily")
        return self._call(tokens, valid, full=True)

    def last_ids(self) -> np.ndarray:
        return self._last_ids

    # -- pipelined calls (one sequence, greedy): pipeline.py ----------------------------------------
    def submit(self, new: list[int], ahead: list[int] = ()) -> "Pending":
        """Send the verify of `new` after the committed tokens and `ahead` (tokens not committed yet that the
        call bets will be); returns at once. `result()` waits for it and writes it as a call would. Without
        the server (back-off), the call will run on the local target at result()."""
        if self.embedding is not None:
            raise RemoteError("pipelined rounds take token ids; this remote target is an inputs_embeds one")
        prefix = self.cache.tokens[0] + list(ahead)
        fut = None
        if self.engine.available():
            fut = self.engine.submit(prefix + list(new), len(prefix), self.salt)
        return Pending(list(new), len(prefix), fut, time.perf_counter())

    def result(self, p: "Pending") -> np.ndarray:
        """(len(new),) the target's argmax ids of a submitted call, whose base must now be exactly the
        committed tokens; its rows are written (commit what is kept)."""
        if p.base != len(self.cache.tokens[0]):
            raise ValueError(f"this verify was sent after {p.base} tokens, but {len(self.cache.tokens[0])} are "
                             f"committed")
        got, where = None, "remote"
        if p.future is not None:
            try:
                got = p.future.result()
            except _Failure as e:
                self.engine._failed(e)
        if got is None:
            got, where = self._local(np.array([p.new], np.int64), None, False)[0], "local"
        self._wrote([p.new], where, p.t0)
        self._last_ids = got[None]
        return got

    def _wrote(self, rows: list[list[int]], where: str, t0: float, embeds: list[np.ndarray] | None = None) -> None:
        """A call's bookkeeping: its rows written (uncommitted) into the token cache, and into the local
        cache's commits when it ran there; counters and the trace event."""
        t1 = time.perf_counter()
        self.cache.write(rows, embeds)
        self.cache.follower = self.local.cache if where == "local" else None
        self.calls += 1
        self.engine_s += t1 - t0
        if self.trace is not None:
            self.trace.append((f"{self.trace_name}.{where} S={len(rows[0])}", t0, t1))

    def hidden_at(self, b: int, position: int):
        raise RemoteError("a remote target does not return its hidden state (the text draft head needs it)")

    def _call(self, tokens, valid, full: bool) -> np.ndarray:
        if tokens is None:
            raise RemoteError("a remote target takes token ids, not embeddings")
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch:
            raise ValueError(f"tokens must be (B={self.batch}, S) ids, got shape {tokens.shape}")
        b, s = tokens.shape
        counts = valid.sum(1).astype(int) if valid is not None else np.full(b, s)
        self.cache.reserve(int(self.cache.lengths.max()) + s)
        rows = [tokens[i, :counts[i]].tolist() for i in range(b)]
        eng = self.engine
        t0 = time.perf_counter()
        got, where = None, "remote"
        if eng.available():
            try:
                got = eng.verify([self.cache.tokens[i] + rows[i] for i in range(b)],
                                 [len(t) for t in self.cache.tokens], self.salt, full)
            except _Failure as e:
                eng._failed(e)
        if got is None:
            got, where = self._local(tokens, valid, full), "local"
        # rows past a sequence's count are padding: they are written (as KVCache's are) but never kept
        self._wrote(tokens.tolist(), where, t0)
        out = np.zeros((b, s) + ((self.m.vocab_size,) if full else ()), np.float32 if full else np.int64)
        for i in range(b):
            out[i, :counts[i]] = got[i]
        return out

    def _call_embeds(self, tokens, valid, embeds, last) -> np.ndarray:
        """ids() on an inputs_embeds target (one sequence): the new rows are `embeds` (1, S, E), or the
        embeddings of `tokens` (1, S)."""
        if valid is not None:
            raise ValueError("a remote inputs_embeds target takes one sequence: no valid mask")
        if embeds is not None:
            x = np.asarray(embeds, np.float32)
            if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.m.hidden_size:
                raise ValueError(f"embeds must be (1, S, {self.m.hidden_size}), got shape {x.shape}")
            ids = [-1] * x.shape[1]
        else:
            t = np.asarray(tokens, np.int64)
            if t.ndim != 2 or t.shape[0] != 1:
                raise ValueError(f"tokens must be (1, S) ids, got shape {t.shape}")
            if t.size and (t.min() < 0 or t.max() >= self.m.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.m.vocab_size}), got {t.tolist()}")
            x, ids = self.embedding[t], t[0].tolist()
        s = x.shape[1]
        n = s if last is None else last
        if not 1 <= n <= s:
            raise ValueError(f"last must be in 1..{s} (the call's new rows), got {last}")
        self.cache.reserve(int(self.cache.lengths[0]) + s)
        eng, t0 = self.engine, time.perf_counter()
        got, where = None, "remote"
        if eng.available():
            try:
                got = eng.verify_embeds(np.concatenate([self.cache.rows[0], x[0]]), n, self.salt)
            except _Failure as e:
                eng._failed(e)
        if got is None:
            got, where = self._local_embeds(x, n), "local"
        self._wrote([ids], where, t0, [x[0]])
        out = np.full((1, s), -1, np.int64)
        out[0, s - n:] = got
        return out

    def _local_embeds(self, x: np.ndarray, n: int) -> np.ndarray:
        """_call_embeds on the local target, after catching up on the committed rows it has not seen."""
        loc = self._local_decoder()
        have = int(loc.cache.lengths[0])
        missing = self.cache.rows[0][have:]
        if len(missing):
            loc.run(None, embeds=missing[None])
            loc.cache.commit(len(missing))
        out = loc.ids(None, embeds=x)[0, -n:]
        self._count_fallback()
        return out

    def _local_decoder(self):
        """The local target's decoder (made at the first fallback); raises RemoteUnavailable without one."""
        eng = self.engine
        if eng.config.on_failure == "raise":
            why = "on_failure is 'raise'" if eng.local is not None else \
                "on_failure is 'raise' (no local target: load with local=ENGINE_DIR)"
            raise RemoteUnavailable(f"{eng.config.url}: the verify failed ({_last_failure(eng)}) and {why}")
        if self.local is None:
            self.local = eng.local.decoder(self.batch, self.embedding)
            self.cache.local = self.local.cache
        return self.local

    def _count_fallback(self) -> None:
        self.fallbacks += 1
        with self.engine.lock:
            self.engine.counters.fallbacks += 1

    def _local(self, tokens, valid, full) -> list[np.ndarray]:
        """The call on the local target, after catching up on the committed tokens it has not seen."""
        loc = self._local_decoder()
        have = loc.cache.lengths
        missing = [self.cache.tokens[i][int(have[i]):] for i in range(self.batch)]
        if any(missing):
            width = max(map(len, missing))
            feed = np.zeros((self.batch, width), np.int64)
            for i, m in enumerate(missing):
                feed[i, :len(m)] = m
            counts = np.array([len(m) for m in missing])
            loc.run(feed, np.arange(width)[None] < counts[:, None] if (counts != width).any() else None)
            loc.cache.commit(counts)
        out = loc(tokens, valid) if full else loc.ids(tokens, valid)
        if full:  # logits -> log-probabilities, as the server returns them
            out = out - np.logaddexp.reduce(out, axis=-1, keepdims=True)
        self._count_fallback()
        counts = valid.sum(1) if valid is not None else np.full(self.batch, tokens.shape[1])
        return [out[i, :counts[i]] for i in range(self.batch)]


def _last_failure(eng: RemoteTarget) -> str:
    return ", ".join(f"{k} x{v}" for k, v in eng.counters.failures.items()) or "unreachable"

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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..contract import Manifest
from ..remote import (FINGERPRINT_TV, PROBE_TEXT, VERIFY_FLAG, Counters, RemoteConfig, RemoteError, RemoteUnavailable,
                      _Failure, _Http)
from ..tensorfile import torch_bytes


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

    def decoder(self, batch: int = 1, embedding=None):
        """A decoder of `batch` sequences (an inputs_embeds target: one; `embedding`, if given, must be the
        table the target was made with)."""
        if self.embedding is None and embedding is not None:
            raise RemoteError(f"{self.dir} takes token ids; an embedding table is for inputs_embeds targets")
        if self.embedding is not None:
            if batch != 1:
                raise ValueError(f"a remote inputs_embeds target decodes one sequence at a time, got batch {batch}")
            if embedding is not None and not np.array_equal(np.asarray(embedding, np.float32), self.embedding):
                raise ValueError("the embedding table differs from the one this remote target was made with")
        from .remote_decoder import RemoteDecoder
        return RemoteDecoder(self, batch)

    def close(self) -> None:
        self.http.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _embeds_b64(rows: np.ndarray) -> str:
    """(L, E) float32 rows as vLLM's prompt_embeds takes them: base64 of a torch.save file."""
    return base64.b64encode(torch_bytes(rows)).decode("ascii")

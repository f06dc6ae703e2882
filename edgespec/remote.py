"""A remote target's settings, errors and HTTP connection (the target itself: backends/remote.py).

    edgespec.load("http://127.0.0.1:8000", draft="engines/demo-draft", local="engines/demo-target",
                  remote=RemoteConfig("http://127.0.0.1:8000", deadline_s=0.5))
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .contract import EngineError

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

"""The OpenAI-compatible HTTP endpoint the agents of a run talk to.

One server per run, on a loopback address and a free port, threaded (each
request waits for its generation in a thread of its own, so many episodes
are served at once). Every episode has a base URL of its own,
``http://127.0.0.1:PORT/episodes/<token>/v1``: the token is 128 random bits,
made for that episode, so one episode's agent cannot reach another's
conversation. Every request must carry the run's key
(``Authorization: Bearer <key>``, the ``api_key`` grpo hands the agent),
made at start with :func:`secrets.token_urlsafe` and never written anywhere.

What it trusts: any process of this machine that has a URL and the key,
i.e. the agent code grpo calls (and whatever it passes them on to). It
binds loopback only, so nothing off the machine reaches it. What it serves:
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
under an episode's URL; anything else answers 404.

Status codes, each with OpenAI's error body (``{"error": {"message", "type",
"param", "code"}}``), so the ``openai`` SDK raises its own exception (it
retries only the 5xx ones, which end the run anyway):

* 400: a request it cannot serve (not JSON, a field of the wrong type,
  ``n`` > 1): the episode ends (``ended_by = "error"``); also when the
  episode's budget (``code = "context_length_exceeded"``) or turn limit
  (``"max_turns_exceeded"``) is spent;
* 401: no key, or the wrong one; 404: no such episode or path;
* 410: the episode is over (its agent returned, timed out or failed);
* 413: a body over 64 MiB; 503: the inference engine failed (the run ends).
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo_core.plugin_api import EpisodeOver
from grpo_plugins.agent.openai_format import RequestError

MAX_BODY = 64 << 20
FINISHED_KEPT = 4096  # tokens of ended episodes remembered, to answer 410 rather than 404
PREFIX = "/episodes/"


class Served:
    """What the endpoint calls for one episode (:class:`~grpo_plugins.agent.environment.AgentEpisode`)."""

    def serve(self, path: str, body: bytes | None) -> tuple[int, Any]:
        """``path`` under ``/v1`` (``"models"``, ``"chat/completions"``, ...);
        ``body`` for a POST. Returns (status, JSON) or (200, list of stream events)."""
        raise NotImplementedError


class Endpoint:
    """The run's server: start once, route requests to episodes, stop at the end."""

    def __init__(self, host: str = "127.0.0.1", log: Callable[[str], None] = print) -> None:
        self.host = host
        self.key = secrets.token_urlsafe(32)
        self.log = log
        self._episodes: dict[str, Served] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            endpoint = self

            class Handler(_Handler):
                owner = endpoint

            server = ThreadingHTTPServer((self.host, 0), Handler)
            server.daemon_threads = True
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="grpo-agent-endpoint", daemon=True
            )
            self._thread.start()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # ------------------------------------------------------------------ episodes

    def open(self, episode: Served) -> str:
        """Register an episode; its base URL."""
        self.start()
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._episodes[token] = episode
        return f"http://{self.host}:{self.port}{PREFIX}{token}/v1"

    def close(self, base_url: str, why: str) -> None:
        """The episode is gone (scored and released): later requests get 410."""
        token = base_url.split(PREFIX, 1)[-1].split("/", 1)[0]
        with self._lock:
            self._episodes.pop(token, None)
            self._finished[token] = why
            while len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)

    def lookup(self, token: str) -> Served:
        with self._lock:
            episode = self._episodes.get(token)
            why = self._finished.get(token)
        if episode is not None:
            return episode
        if why is not None:
            raise RequestError(
                410, f"episode {token[:8]}... is over ({why}): it takes no more requests", code="episode_over"
            )
        raise RequestError(
            404,
            f"no episode {token[:8]}... on this endpoint (each episode has its own base_url)",
            code="unknown_episode",
        )


class _Handler(BaseHTTPRequestHandler):
    owner: Endpoint
    protocol_version = "HTTP/1.1"
    server_version = "grpo-agent-endpoint"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: every request is not worth a console line."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._handle(None)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = self.headers.get("Content-Length")
        try:
            size = int(length or 0)
        except ValueError:
            size = -1
        if size < 0 or size > MAX_BODY:
            self._send(
                413 if size > MAX_BODY else 400,
                RequestError(400, "a JSON body with a Content-Length is required").body(),
            )
            self.close_connection = True
            return
        self._handle(self.rfile.read(size) if size else b"")

    def _handle(self, body: bytes | None) -> None:
        try:
            status, answer = self._route(body)
        except RequestError as exc:
            status, answer = exc.status, exc.body()
        except EpisodeOver as exc:
            status, answer = _over(exc).status, _over(exc).body()
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the server; the agent sees a 500
            status, answer = 500, RequestError(500, f"the endpoint failed: {type(exc).__name__}: {exc}").body()
        if status == 200 and isinstance(answer, list):
            self._stream(answer)
        else:
            self._send(status, answer)

    def _route(self, body: bytes | None) -> tuple[int, Any]:
        auth = self.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.owner.key}".encode()):
            raise RequestError(
                401,
                "missing or wrong API key: use the api_key grpo passed to the agent",
                kind="authentication_error",
                code="invalid_api_key",
            )
        path = self.path.split("?", 1)[0]
        if not path.startswith(PREFIX):
            raise RequestError(404, f"no route {path}: each episode's base_url is {PREFIX}<episode>/v1")
        token, _, rest = path[len(PREFIX) :].partition("/")
        episode = self.owner.lookup(token)
        if not rest.startswith("v1/"):
            raise RequestError(404, f"no route /{rest} under the episode's base_url (.../v1/chat/completions, ...)")
        return episode.serve(rest[3:].rstrip("/"), body)

    def _send(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: list[Any]) -> None:
        """Server-sent events as OpenAI sends them, then ``[DONE]``; the
        connection closes after (no length is known up front)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _over(exc: EpisodeOver) -> RequestError:
    """How a refused turn reaches the agent."""
    if exc.reason == "length":
        return RequestError(400, str(exc), code="context_length_exceeded")
    if exc.reason == "max_turns":
        return RequestError(400, str(exc), code="max_turns_exceeded")
    if exc.reason == "unavailable":
        return RequestError(503, str(exc), kind="server_error", code="engine_unavailable")
    return RequestError(410, str(exc), code="episode_over")


def stamp() -> str:
    """A unique-enough id suffix for answers."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(4)}"

"""One OpenEnv session: a WebSocket connection speaking OpenEnv's protocol.

OpenEnv (``openenv-core``) serves an environment over FastAPI. Its HTTP
``POST /reset`` and ``POST /step`` are stateless: each request builds a fresh
environment and closes it, so no episode can span two of them. A multi-step
episode needs ``/ws``: the server builds one environment instance per
WebSocket connection (its "session", counted against the server's
``max_concurrent_envs``, 1 unless the server says otherwise) and keeps it
until the connection closes. Messages are JSON:
``{"type": "reset", "data": {...reset kwargs}}``,
``{"type": "step", "data": {...action fields}}``, ``{"type": "close"}``;
answers are ``{"type": "observation", "data": {"observation": {...},
"reward": r, "done": d}}`` or ``{"type": "error", "data": {"message": ...,
"code": ...}}``. (Read from openenv-core 0.3.0's ``http_server.py`` and
``env_client.py``; ``openenv`` 0.10 speaks the same messages.)

This module speaks that protocol directly with the ``websockets`` sync
client (no asyncio loop per episode, no openenv import on the trainer side)
and turns every failure into an :class:`OpenEnvError` sentence naming the
server, the episode and the step.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_core.plugin_api import GrpoError


class OpenEnvError(GrpoError):
    """The OpenEnv server answered a reset or a step with an error;
    ``code`` is OpenEnv's error code (``CAPACITY_REACHED``, ...) when it sent one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class OpenEnvUnavailable(OpenEnvError):
    """The OpenEnv server could not be reached, or the connection broke."""

    exit_code = 3


@dataclass
class StepResult:
    """One answer of the server: the observation's own fields (without
    ``reward``/``done``, which OpenEnv sends beside them), its reward and
    whether the episode is over."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


def ws_url(base_url: str) -> str:
    """``http://h:p`` / ``ws://h:p`` (with or without ``/ws``) -> ``ws://h:p/ws``."""
    url = base_url.rstrip("/")
    for old, new in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(old):
            url = new + url[len(old) :]
    if not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url if url.endswith("/ws") else url + "/ws"


def http_url(base_url: str) -> str:
    """``ws://h:p/ws`` / ``http://h:p`` -> ``http://h:p`` (where ``/health`` and ``/schema`` are)."""
    url = base_url.rstrip("/").removesuffix("/ws")
    for old, new in (("wss://", "https://"), ("ws://", "http://")):
        if url.startswith(old):
            url = new + url[len(old) :]
    return url if url.startswith(("http://", "https://")) else "http://" + url


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float):
        return float(value)
    raise ValueError(f"reward {value!r} is not a number")


def _websockets() -> Any:
    try:
        # websockets (openenv-core) is optional: imported only where used, so grpo runs without it
        from websockets.sync import client
    except ImportError:  # pragma: no cover - websockets comes with vllm and openenv-core
        raise OpenEnvUnavailable(
            "the 'openenv' environment talks to its server over WebSocket, but the 'websockets' package is missing: "
            "pip install 'websockets>=13' (or openenv-core)."
        ) from None
    return client


class OpenEnvSession:
    """One WebSocket session with an OpenEnv server: one environment
    instance on the server, used by one episode, steps one after another.

    ``where`` names the episode in error messages (e.g. ``"prompt 3, sample
    1"``); ``server_problem`` says why the server cannot answer (a managed
    server that exited, with its log's tail), ``None`` when it runs;
    ``on_lost`` is told when a connection could not be opened, broke or
    timed out (the adapter then checks the server's health before the next
    episode).
    """

    def __init__(
        self,
        base_url: str,
        *,
        where: str,
        connect_timeout: float,
        message_timeout: float,
        server_problem: Callable[[], str | None] = lambda: None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.url = ws_url(base_url)
        self.where = where
        self.connect_timeout = connect_timeout
        self.message_timeout = message_timeout
        self.server_problem = server_problem
        self.on_lost = on_lost
        self._ws: Any = None
        self._lock = threading.Lock()  # close() may come from another thread than step()
        self._closed = False
        self._lost: str | None = None  # the call at which the connection broke

    def reopened(self) -> OpenEnvSession:
        """A new, unopened session to the same server for the same episode."""
        return OpenEnvSession(
            self.url,
            where=self.where,
            connect_timeout=self.connect_timeout,
            message_timeout=self.message_timeout,
            server_problem=self.server_problem,
            on_lost=self.on_lost,
        )

    # ------------------------------------------------------------------ errors

    def _prefix(self, what: str) -> str:
        return f"OpenEnv server at {self.url}, {self.where}, {what}"

    def _unavailable(self, what: str, detail: str) -> OpenEnvUnavailable:
        self.on_lost()
        problem = self.server_problem()
        suffix = f" ({problem})" if problem else ""
        return OpenEnvUnavailable(f"{self._prefix(what)}: {detail}{suffix}.")

    # ------------------------------------------------------------------ protocol

    def _connect(self, what: str) -> Any:
        if self._ws is not None:
            return self._ws
        client = _websockets()
        problem = self.server_problem()
        if problem:
            raise OpenEnvUnavailable(f"{self._prefix(what)}: the server is not running ({problem}).")
        try:
            # proxy=None: an HTTP(S)_PROXY of the machine must not reroute loopback traffic.
            # Entered as a context manager (closed by close()): websockets 17
            # warns about a bare connect(), and older releases accept both.
            self._ws = client.connect(
                self.url, open_timeout=self.connect_timeout, max_size=None, proxy=None
            ).__enter__()
        except TimeoutError:
            raise self._unavailable(
                what, f"could not connect within {self.connect_timeout:g} s (plugins.openenv.connect_timeout)"
            ) from None
        except (OSError, Exception) as exc:  # refused, reset, bad handshake: all mean "no server here"
            raise self._unavailable(
                what, f"could not connect ({type(exc).__name__}: {exc}); check plugins.openenv.base_url or command"
            ) from None
        return self._ws

    def _exchange(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        # websockets (openenv-core) is optional: imported only where used, so grpo runs without it
        from websockets.exceptions import ConnectionClosed

        with self._lock:
            if self._closed:
                raise OpenEnvError(f"{self._prefix(what)}: the session was already closed.")
            if self._lost is not None:
                # Reconnecting would give a new, un-reset environment on the server.
                raise OpenEnvError(
                    f"{self._prefix(what)}: the session was lost at {self._lost}, so this episode cannot go on."
                )
            ws = self._connect(what)
            try:
                try:
                    ws.send(json.dumps(message))
                except ConnectionClosed:
                    # The server may answer and close at once (no free session):
                    # its answer is still queued, read it before giving up.
                    raw = ws.recv(timeout=1.0)
                else:
                    raw = ws.recv(timeout=self.message_timeout)
            except TimeoutError:
                self._drop(what)
                self.on_lost()
                raise OpenEnvError(
                    f"{self._prefix(what)}: no answer within {self.message_timeout:g} s "
                    "(plugins.openenv.step_timeout, default [episodes] step_timeout)."
                ) from None
            except ConnectionClosed as exc:
                self._drop(what)
                raise self._unavailable(
                    what, f"the connection closed (code {exc.rcvd.code if exc.rcvd else 1006})"
                ) from None
            except OSError as exc:
                self._drop(what)
                raise self._unavailable(what, f"the connection broke ({exc})") from None
        try:
            answer = json.loads(raw)
        except (TypeError, ValueError):
            raise OpenEnvError(f"{self._prefix(what)}: the answer is not JSON: {str(raw)[:200]!r}.") from None
        if not isinstance(answer, dict):
            raise OpenEnvError(f"{self._prefix(what)}: the answer is not a JSON object: {str(raw)[:200]!r}.")
        if answer.get("type") == "error":
            data = answer.get("data") if isinstance(answer.get("data"), dict) else {}
            raise OpenEnvError(f"{self._prefix(what)}: {_error_sentence(data)}", code=str(data.get("code", "UNKNOWN")))
        return answer

    def _result(self, answer: dict[str, Any], what: str) -> StepResult:
        data = answer.get("data")
        if answer.get("type") != "observation" or not isinstance(data, dict):
            raise OpenEnvError(f"{self._prefix(what)}: expected an observation, got {json.dumps(answer)[:200]}.")
        observation = data.get("observation")
        try:
            reward = _reward(data.get("reward"))
        except ValueError as exc:
            raise OpenEnvError(f"{self._prefix(what)}: {exc}.") from None
        return StepResult(observation if isinstance(observation, dict) else {}, reward, bool(data.get("done", False)))

    def reset(self, **kwargs: Any) -> StepResult:
        """Open the session (a new environment on the server) and reset it."""
        return self._result(self._exchange({"type": "reset", "data": kwargs}, "reset"), "reset")

    def step(self, action: dict[str, Any], number: int) -> StepResult:
        """Send one action; ``number`` (1, 2, ...) names the step in errors."""
        what = f"step {number}"
        return self._result(self._exchange({"type": "step", "data": action}, what), what)

    def _drop(self, lost_at: str | None = None) -> None:
        if lost_at is not None and self._ws is not None:
            self._lost = lost_at
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:  # noqa: BLE001 - best effort on a broken connection
                pass

    def close(self) -> None:
        """End the session: the server closes its environment and frees the
        slot. Idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._ws is not None:
                try:
                    self._ws.send(json.dumps({"type": "close"}))
                    # The server answers by closing the connection itself; closing
                    # ours first makes its own close() raise (a traceback in its log).
                    self._ws.recv(timeout=2.0)
                except Exception:  # noqa: BLE001 - closed as expected, or the server is gone already
                    pass
            self._drop()


def _error_sentence(data: dict[str, Any]) -> str:
    """OpenEnv's error answer as a sentence with the fix where one is known."""
    code = str(data.get("code", "UNKNOWN"))
    message = str(data.get("message", "unknown error"))
    if code == "CAPACITY_REACHED":
        active, most = data.get("active_sessions", "?"), data.get("max_sessions", "?")
        return (
            f"the server refused a new session ({active} of {most} in use). grpo opens one session per episode and "
            "runs many at once: start the server with max_concurrent_envs at least the episodes in flight "
            "(its environment class must set SUPPORTS_CONCURRENT_SESSIONS = True), or set "
            "plugins.openenv.capacity_wait to wait for a free one."
        )
    if code == "VALIDATION_ERROR":
        errors = data.get("errors") or []
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors if isinstance(e, dict)
        )
        return (
            f"the server refused the action ({detail or message}). Make the action match the environment's action "
            "class: plugins.openenv.action_field names the field the model's text goes into, "
            "plugins.openenv.action_function builds the whole action."
        )
    if code == "EXECUTION_ERROR":
        return f"the environment raised: {message}."
    return f"{message} (OpenEnv error code {code})."

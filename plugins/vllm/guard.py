"""An API-key check on every path of a vLLM server, loaded *inside* it.

vLLM's ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; its dev-mode endpoints (``/collective_rpc``, which makes the
server reload weights from any path it can read, ``/reset_prefix_cache``)
and ``/metrics`` stay open to anyone who reaches the port. grpo starts TCP
servers with ``--middleware grpo_plugins.vllm.guard.RequireApiKey``: every
request but ``/health`` (the readiness probe, which reveals nothing) must
carry ``Authorization: Bearer <key>``.

The key comes from ``VLLM_API_KEY`` in the server's environment (readable by
its user only), never from the command line (readable by every local user
through ``ps``). This module imports only the standard library: it runs in
the vLLM server's interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class RequireApiKey:
    """Pure ASGI middleware: 401 for any HTTP or websocket request whose
    bearer token is not the key (compared as SHA-256 digests in constant
    time). Refuses to start without a key rather than serve unguarded."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"grpo's API-key guard was loaded without {KEY_ENV} set: refusing to serve unguarded")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest
                )
        return False

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS or self._authorised(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this server needs its API key on every path (grpo)"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

"""A small HTTP client for the endpoints of a vLLM (0.32) OpenAI server that
grpo needs: generation, adapter loading, full-weight reload, cache reset.

Why our own client: TRL's client refuses vLLM 0.32 and syncs weights over
NCCL only; grpo talks to vLLM's HTTP API directly. It uses httpx, which
reaches a server on a Unix domain socket as well as over TCP: a base URL
``unix:/path/to/socket`` (what a managed server listens on by default, see
:mod:`grpo_plugins.vllm.addresses`) or ``http(s)://host:port``. Transient failures
(connection refused, 5xx, a garbled answer) are retried with exponential
backoff until ``timeout`` seconds have passed in total, then become
:class:`~grpo_core.contract.errors.EngineUnavailable` naming the URL and what to check.
A 4xx answer is the caller's fault and is never retried.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from grpo_core.plugin_api import EngineUnavailable, GrpoError

UNIX_PREFIX = "unix:"
NOTHING_ANSWERS = "nothing answers there"
"""Base URLs starting with this name a Unix domain socket: ``unix:/run/x/vllm.sock``."""

# Endpoints that only exist when the server runs with VLLM_SERVER_DEV_MODE=1.
DEV_MODE_HINT = "start the server with VLLM_SERVER_DEV_MODE=1 (grpo vllm-serve does when it is safe)"


class EngineRequestError(GrpoError):
    """The server answered, but refused the request (4xx)."""

    def __init__(self, message: str, status: int, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class ModelNotLoaded(EngineRequestError):
    """The requested model name (e.g. the 'policy' adapter) is not on the
    server: typically the server restarted and lost its adapters."""


class EndpointMissing(EngineRequestError):
    """The server does not offer this endpoint (404 on the path): an older
    vLLM, LoRA updating disabled, or dev mode off."""


def socket_path(base_url: str) -> str | None:
    """The socket file of a ``unix:`` base URL, else ``None`` (TCP)."""
    return base_url[len(UNIX_PREFIX) :] if base_url.startswith(UNIX_PREFIX) else None


class VLLMClient:
    """HTTP client of one vLLM server, over TCP or a Unix domain socket.

    Safe to share between the trainer thread and a prefetch thread: each
    thread gets its own ``httpx.Client``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 240.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.socket = socket_path(self.base_url)
        # Over a socket the host part is only the Host header; the path does the routing.
        self._http_base = "http://localhost" if self.socket else self.base_url
        self.api_key = api_key
        self.timeout = float(timeout)
        self.log = log
        self._local = threading.local()
        self.outages = 0  # how many times the server stopped answering and came back
        # Adapters this client loaded (name -> path), so hygiene leaves them alone.
        self.owned_adapters: dict[str, str] = {}
        # Managed mode: says why the server can never answer (its process
        # exited), so a request fails at once instead of waiting out the timeout.
        self.dead_check: Callable[[], str | None] | None = None

    # ------------------------------------------------------------------ plumbing

    def _session(self) -> httpx.Client:
        session = getattr(self._local, "session", None)
        if session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # No proxy from the environment for a socket (it could only break it).
            transport = httpx.HTTPTransport(uds=self.socket) if self.socket else None
            session = httpx.Client(headers=headers, transport=transport, trust_env=self.socket is None)
            self._local.session = session
        return session

    def close(self) -> None:
        """Close this thread's connections (other threads' close when collected)."""
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None

    def _unavailable(self, path: str, waited: float, last: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"vLLM server at {self.base_url} did not answer {path} properly for {waited:.0f} s "
            f"(last problem: {last}). Check that the server is running (`grpo vllm-serve CONFIG`, "
            "or trl.vllm_managed = true), that trl.vllm_server_host/port or trl.vllm_server_base_url "
            "point at it, and its log; raise trl.vllm_server_timeout if it is just slow."
        )

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        params: dict[str, Any] | None = None,
        parse: Callable[[httpx.Response], Any] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Any:
        """Send one request, retrying transient failures.

        ``parse`` turns a 2xx response into the result; if it raises
        ``ValueError``/``KeyError``/``TypeError`` the answer counts as garbage
        and is retried like a 5xx. Returns the parsed value (or the response).
        """
        total = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        delay = 0.25
        start = time.monotonic()
        failed = False
        url = self._http_base + path
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self._session().request(
                    method,
                    url,
                    json=json,
                    params=params,
                    timeout=httpx.Timeout(max(remaining, 1.0), connect=min(10.0, max(remaining, 1.0))),
                )
            except httpx.ReadTimeout:
                raise EngineUnavailable(
                    f"vLLM server at {self.base_url} accepted {path} but sent no answer within {total:.0f} s. "
                    "Raise trl.vllm_server_timeout, or generate fewer/shorter completions per step."
                ) from None
            except httpx.RequestError as exc:
                last = f"{type(exc).__name__}: {str(exc)[:200]}"
            else:
                if response.status_code < 400:
                    try:
                        result = parse(response) if parse else response
                    except (ValueError, KeyError, TypeError, IndexError) as exc:
                        last = f"unreadable answer ({type(exc).__name__}: {exc}): {response.text[:200]!r}"
                    else:
                        if failed:
                            self.outages += 1
                        return result
                elif response.status_code >= 500:
                    last = f"HTTP {response.status_code}: {response.text[:300]}"
                else:
                    raise self._client_error(path, response)
            failed = True
            dead = self.dead_check() if self.dead_check else None
            if dead:
                raise EngineUnavailable(f"vLLM server at {self.base_url} is gone: {dead}")
            if not retry or time.monotonic() + delay > deadline:
                raise self._unavailable(path, time.monotonic() - start, last)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _client_error(self, path: str, response: httpx.Response) -> EngineRequestError:
        status, body = response.status_code, response.text[:1000]
        if status == 401:
            return EngineRequestError(
                f"vLLM server at {self.base_url} refused {path}: wrong or missing API key. Set [vllm] api_key "
                "to the key the server was started with.",
                status,
                body,
            )
        if status == 404 and "does not exist" in body:
            return ModelNotLoaded(f"vLLM server at {self.base_url}: {body}", status, body)
        if status in (404, 405) and ('"Not Found"' in body or '"Method Not Allowed"' in body):
            return EndpointMissing(
                f"vLLM server at {self.base_url} has no endpoint {path} (HTTP {status}).", status, body
            )
        return EngineRequestError(
            f"vLLM server at {self.base_url} refused {path} (HTTP {status}): {body}", status, body
        )

    # ------------------------------------------------------------------ endpoints

    def health(self, timeout: float = 2.0) -> bool:
        """One quick probe of /health; never raises."""
        try:
            return self._session().get(self._http_base + "/health", timeout=timeout).status_code == 200
        except httpx.RequestError:
            return False

    def wait_healthy(self, timeout: float | None = None) -> None:
        self.request("GET", "/health", timeout=timeout)

    def models(self) -> list[dict[str, Any]]:
        """Served models: the base model and every loaded LoRA adapter
        (adapters carry a ``parent``)."""
        return self.request("GET", "/v1/models", parse=lambda r: list(r.json()["data"]))

    def completions(self, payload: dict[str, Any], parse: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """POST /v1/completions. ``parse`` validates the JSON (garbage -> retry)."""
        return self.request("POST", "/v1/completions", payload, parse=lambda r: (parse or (lambda d: d))(r.json()))

    def load_lora_adapter(self, name: str, path: str, inplace: bool = True) -> None:
        try:
            self.request(
                "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": inplace}
            )
        except EndpointMissing as exc:
            raise EngineRequestError(
                f"vLLM server at {self.base_url} cannot load LoRA adapters at runtime. Start it with "
                "--enable-lora --max-lora-rank <lora_r> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                "(grpo vllm-serve does this when adapter = 'lora').",
                exc.status,
                exc.body,
            ) from None
        self.owned_adapters[name] = path

    def unload_lora_adapter(self, name: str) -> None:
        self.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        self.owned_adapters.pop(name, None)

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Run ``method`` on every worker (dev mode only)."""
        try:
            return self.request(
                "POST",
                "/collective_rpc",
                {"method": method, "kwargs": kwargs or {}},
                timeout=timeout,
                parse=lambda r: r.json() if r.content else None,
            )
        except EndpointMissing as exc:
            raise EngineRequestError(
                f"vLLM server at {self.base_url} has no /collective_rpc: {DEV_MODE_HINT}.", exc.status
            ) from None

    def pause(self) -> None:
        """POST /pause?mode=abort&clear_cache=false (dev mode): every request in flight ends
        now with ``finish_reason = "abort"`` and what it sampled so far;
        requests arriving while paused are queued until :meth:`resume`
        (vllm/entrypoints/rl/online/api_router.py; plugins/vllm/inflight.py
        says why not ``mode=keep``). Sent once, never retried."""
        try:
            # clear_cache=false: vLLM's cache clearing made each pause take 5-10 s here (an idle server, measured
            # with curl); the loads drop stale prefixes themselves (reset_prefix_cache after a full reload; a LoRA
            # adapter's blocks are cached under its own id)
            self.request("POST", "/pause", params={"mode": "abort", "clear_cache": "false"}, retry=False)
        except EndpointMissing as exc:
            raise EngineRequestError(
                f"vLLM server at {self.base_url} has no /pause (trl.in_flight_weight_updates needs it): "
                f"{DEV_MODE_HINT}.",
                exc.status,
            ) from None

    def resume(self) -> None:
        """POST /resume: queued requests run, new ones are scheduled again."""
        self.request("POST", "/resume")

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks computed with older weights (dev mode only)."""
        return bool(self.request("POST", "/reset_prefix_cache", parse=lambda r: r.json().get("success", True)))

    def weight_version(self) -> str | None:
        """The weight tag the server holds (dev mode); ``None`` without dev mode."""
        try:
            return self.request("GET", "/weight_info", parse=lambda r: str(r.json()["weight_version"]))
        except EndpointMissing:
            return None

    def set_weight_version(self, tag: str) -> bool:
        """Label the server's weights, so a restarted server (which forgets the
        label) can be told apart from one that still holds our weights."""
        try:
            self.request("POST", "/update_weight_version", {"new_version": tag})
            return True
        except EndpointMissing:
            return False

    def openapi_fields(self, schema: str = "CompletionRequest") -> set[str] | None:
        """Field names the server accepts in ``schema`` (from /openapi.json)."""
        try:
            spec = self.request("GET", "/openapi.json", parse=lambda r: r.json())
            return set(spec["components"]["schemas"][schema]["properties"])
        except (GrpoError, KeyError, TypeError):
            return None


def adoption_refusal(base_url: str, api_key: str | None) -> str | None:
    """Why ``grpo run`` must not adopt the server answering at ``base_url``
    on its own (``trl.vllm_managed`` unset), or ``None`` if it may.

    On a shared node any user can start something on the default port, and a
    server grpo adopts decides what the trainer learns from. So an answering
    server is adopted only if it proves it holds our key: it refuses a
    made-up key and accepts ours. Without a configured key nothing is proven."""
    ours = VLLMClient(base_url, api_key, timeout=10)
    if not ours.health():
        return NOTHING_ANSWERS
    if not api_key:
        return (
            "a server answers there, but no API key is configured (nor left there by a `grpo vllm-serve` of this "
            "user) to check that it is yours"
        )
    made_up = VLLMClient(base_url, "grpo-probe-" + secrets.token_hex(16), timeout=10)
    try:
        wrong = made_up._session().get(made_up._http_base + "/v1/models", timeout=10).status_code
        right = ours._session().get(ours._http_base + "/v1/models", timeout=10).status_code
    except httpx.RequestError as exc:
        return f"it did not answer /v1/models ({type(exc).__name__})"
    finally:
        made_up.close()
        ours.close()
    if wrong != 401 or right != 200:
        return f"it does not check our API key (HTTP {wrong} with a made-up key, {right} with ours)"
    return None

"""``grpo.weight_sync:full_http`` and ``lora_http``: weights over the
network, no shared filesystem.

``full_http``: the trainer serves the weights it changed (merged ``W +
delta`` of the LoRA-adapted modules, or every weight for full fine-tuning;
the same set ``full_filesystem`` writes, in the engine's dtype) as one
safetensors body from a small HTTP server in its own process, held in
memory; each vLLM server pulls it (``/collective_rpc`` ->
:mod:`grpo_plugins.vllm.worker_ext`) and loads it in place. Nothing is
written to disk on either side.

``lora_http``: the adapter alone (what ``lora_filesystem`` writes, a few MB
where merged weights are most of the model), served the same way; each
server's worker pulls it into a private folder on the server's own machine
and the server loads it from there as a LoRA adapter. The trainer's disk is
never read by the server. Either way the vLLM servers may run on other
hosts with no filesystem in common.

Who can fetch the weights: the HTTP server binds ``[plugins.full_http]
host`` (loopback by default; a trainer whose servers run elsewhere binds an
address they reach, and ``advertise_host`` names it if it differs), and
answers only requests carrying a token made up for this run (sent to the
vLLM servers inside the ``/collective_rpc`` request, never logged). The
newest version stays served until the next sync: a server that restarts
pulls it again.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_core.plugin_api import (
    ADAPTER_FROM_URL,
    WEIGHTS_FROM_URL,
    ConfigError,
    InferenceEngine,
    SyncResult,
    adapter_body,
    hookimpl,
    in_dtype,
    make_scratch_dir,
    merged_weights,
    remove_scratch_dir,
    save_adapter,
)

if TYPE_CHECKING:
    from grpo_core.plugin_api import RunContext

PATH_PREFIX = "/grpo-weights/v"


def safetensors_bytes(state: dict[str, Any], dtype: str | None) -> bytes:
    """``state`` as one safetensors body, cast to ``dtype`` (when given)
    with tied weights (lm_head = embed_tokens) stored once."""
    # heavy (safetensors): loaded on first use, not with this module
    from safetensors.torch import save

    seen: set[int] = set()
    unique: dict[str, Any] = {}
    for key, tensor in in_dtype(state, dtype).items():  # tied tensors stay one storage through the cast
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        unique[key] = tensor.contiguous()
    return save(unique, metadata={"format": "pt"})


class WeightServer:
    """Serves the newest weights at ``/grpo-weights/v<version>`` to holders
    of the token; one background thread per request (several vLLM servers
    pull at once)."""

    def __init__(self, host: str, port: int) -> None:
        self.token = secrets.token_urlsafe(32)
        self.version: int | None = None
        self.body = b""
        self.fetches = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                auth = self.headers.get("Authorization", "")
                if not hmac.compare_digest(auth.encode(), f"Bearer {server.token}".encode()):
                    self.send_error(401)
                    return
                with server._lock:
                    version, body = server.version, server.body
                if version is None or self.path != f"{PATH_PREFIX}{version}":
                    self.send_error(404, "not the newest weights")
                    return
                with (
                    server._lock
                ):  # counted before the body goes: the fetcher may answer its caller as soon as it has it
                    server.fetches += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the token is not logged
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="grpo-weight-server", daemon=True)
        self.thread.start()

    def publish(self, version: int, body: bytes) -> str:
        """Serve ``body`` as ``version`` (the previous one is forgotten);
        returns its path."""
        with self._lock:
            self.version, self.body = version, body
        return f"{PATH_PREFIX}{version}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            self.body = b""


class _HttpSync:
    """What ``full_http`` and ``lora_http`` share: the settings, the weight
    server (started at the first sync), the URL the engine fetches."""

    kind = ""

    class Settings(BaseModel):
        """``[plugins.full_http]`` / ``[plugins.lora_http]``."""

        model_config = ConfigDict(extra="forbid")
        host: str = Field(
            "127.0.0.1", description="Address the trainer's weight server binds (0.0.0.0: every interface)."
        )
        port: int = Field(0, ge=0, le=65535, description="Its port; 0 picks a free one.")
        advertise_host: str | None = Field(
            None,
            description="The address the vLLM servers use to reach the trainer. Default: host (this machine's name "
            "when host is 0.0.0.0).",
        )

    def __init__(self, context: RunContext, settings: _HttpSync.Settings | None = None) -> None:
        self.context = context
        self.settings = settings or self.Settings()
        self.server: WeightServer | None = None  # started at the first sync
        self._lock = threading.Lock()

    @classmethod
    def _refuse_colocate(cls, config: Any, instead: str) -> None:
        if config.trl.vllm_mode == "colocate":
            raise ConfigError(
                f"weight sync '{cls.kind}' sends weights to vLLM servers over HTTP, but trl.vllm_mode = 'colocate' "
                f"runs vLLM inside the trainer: {instead}."
            )

    def url_base(self, port: int) -> str:
        s = self.settings
        host = s.advertise_host or (socket.getfqdn() if s.host in ("0.0.0.0", "", "::") else s.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _publish(self, version: int, body: bytes) -> str:
        if self.server is None:
            self.server = WeightServer(self.settings.host, self.settings.port)
        return self.url_base(self.server.port) + self.server.publish(version, body)

    def _needs_engine(self, engine: InferenceEngine | None) -> InferenceEngine:
        if engine is None:
            raise ConfigError(
                f"weight sync '{self.kind}' sends weights to an inference engine, but the rollout has none: set "
                "trl.use_vllm = true (or choose the rollout's own weight sync)."
            )
        return engine

    def _send(self, version: int, make_body: Callable[[], bytes], load: Callable[[str, str], None]) -> SyncResult:
        """Serve ``make_body()`` as ``version`` and have the engine ``load(url, token)`` it, timed."""
        with self._lock:
            start = time.perf_counter()
            body = make_body()
            url = self._publish(version, body)
            packed = time.perf_counter()
            assert self.server is not None
            load(url, self.server.token)
            end = time.perf_counter()
        return SyncResult(
            version,
            end - start,
            f"{self.kind}: pack {packed - start:.2f}s, load {end - packed:.2f}s "
            f"({len(body) / 2**20:.1f} MiB from {url})",
        )

    @hookimpl
    def grpo_train_end(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None


class FullHttpSync(_HttpSync):
    """Full weights served over HTTP for vLLM servers on other hosts.

    ``grpo.weight_sync:full_http``."""

    kind = "full_http"
    required_capabilities = frozenset({WEIGHTS_FROM_URL})

    @staticmethod
    def grpo_validate_config(config: Any) -> list[str]:
        FullHttpSync._refuse_colocate(config, "use plugins.weight_sync = 'vllm_in_memory' (the default there)")
        return []

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        engine = self._needs_engine(engine)
        return self._send(
            version,
            lambda: safetensors_bytes(merged_weights(model, engine.fused_modules()), engine.weight_dtype),
            engine.load_weights_from_url,
        )


class LoraHttpSync(_HttpSync):
    """The LoRA adapter served over HTTP for vLLM servers on other hosts.

    ``grpo.weight_sync:lora_http``."""

    kind = "lora_http"
    required_capabilities = frozenset({ADAPTER_FROM_URL})
    sends = "adapter"  # the base stays as the engine loaded it (a quantised base works)

    @staticmethod
    def grpo_validate_config(config: Any) -> list[str]:
        LoraHttpSync._refuse_colocate(config, "leave plugins.weight_sync unset (the colocated engine syncs in memory)")
        if config.adapter != "lora":
            raise ConfigError(
                "weight sync 'lora_http' sends a LoRA adapter to the engine, but no adapter is trained: set "
                "adapter = 'lora', or plugins.weight_sync = 'full_http' (full weights over HTTP)."
            )
        return []

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        engine = self._needs_engine(engine)

        def body() -> bytes:
            staging = make_scratch_dir("grpo-lora-http-")
            try:
                save_adapter(model, staging, self.kind)
                return adapter_body(staging)
            finally:
                remove_scratch_dir(staging)

        return self._send(version, body, engine.load_adapter_from_url)

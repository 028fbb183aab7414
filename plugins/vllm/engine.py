"""The vLLM server as an :class:`~grpo_core.contract.types.InferenceEngine`.

:class:`VLLMServerEngine` is what the ``vllm`` rollout owns and what any
weight sync for it receives: the HTTP client, the managed server process (if
grpo started it), server hygiene, restarts, and which model name and weight
label the server holds. A restarted server forgets its adapters and weights;
the engine notices (the process exited, the weight label changed, or the
adapter is unknown) and re-applies the last load before it samples again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from grpo_core.plugin_api import (
    ADAPTER_FROM_PATH,
    ADAPTER_FROM_URL,
    ADAPTER_LOADS,
    CONTINUES_FROM_IDS,
    CONTROL_ENDPOINTS,
    PAUSES_GENERATION,
    SCORES_TOKENS,
    WEIGHTS_FROM_PATH,
    WEIGHTS_FROM_URL,
    WEIGHTS_OVER_NCCL,
    ConfigError,
    ControlEndpoint,
    EngineScore,
    EngineUnavailable,
)
from grpo_plugins.vllm.addresses import configured_api_key, is_loopback
from grpo_plugins.vllm.client import (
    NOTHING_ANSWERS,
    EndpointMissing,
    EngineRequestError,
    VLLMClient,
    adoption_refusal,
)
from grpo_plugins.vllm.command_line import (
    SERVED_MODEL_NAME,
    WORKER_EXTENSION,
    managed_spec,
)
from grpo_plugins.vllm.engine_settings import known_dtype
from grpo_plugins.vllm.external import (
    OLD_TRL_PROTOCOL,
    ServerFacts,
    logprobs_problem,
    old_trl_protocol,
    read_facts,
)
from grpo_plugins.vllm.key_handoff import handed_key
from grpo_plugins.vllm.probe_gate import ProbeGate
from grpo_plugins.vllm.server import LOG_NAME, ManagedServer
from grpo_plugins.vllm.worker_ext import RETIE_METHOD

if TYPE_CHECKING:
    from grpo_core.plugin_api import RunContext

POLICY_ADAPTER = "policy"
OWN_TAG_PREFIX = "grpo-"
# vLLM fuses these projections into one weight (qkv_proj, gate_up_proj).
PACKED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def server_url(context: RunContext) -> str:
    trl = context.config.trl
    if trl.vllm_server_base_url:
        return trl.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if trl.vllm_server_host in ("0.0.0.0", "") else trl.vllm_server_host
    return f"http://{host}:{trl.vllm_server_port}"


def server_to_adopt(url: str, api_key: str | None) -> tuple[str | None, str | None]:
    """``(key, None)`` if ``grpo run`` may use the server answering at
    ``url`` with ``key``, else ``(None, why not)``: a server someone else
    started must prove it holds our key (configured, or left by this user's
    ``grpo vllm-serve``), whoever's file named it."""
    refusal = adoption_refusal(url, api_key)
    return (api_key, None) if refusal is None else (None, refusal)


def prompt_logprobs(data: Mapping[str, Any], ids: list[int], where: str) -> list[float]:
    """The log-prob of each of ``ids[1:]`` in a ``/v1/completions`` answer
    asked with ``prompt_logprobs``. Raises ``ValueError`` on an answer that
    does not fit the request (the client retries those), ``EngineRequestError``
    for a server that returns logits instead of log-probs."""
    entries = data["choices"][0]["prompt_logprobs"]
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise ValueError(f"expected prompt_logprobs for {len(ids)} tokens, got {type(entries).__name__}")
    out = [float(entry[str(token)]["logprob"]) for entry, token in zip(entries[1:], ids[1:], strict=True)]
    if any(value > 1e-3 for value in out):
        raise EngineRequestError(
            f"{where} returns positive prompt log-probs: it was started with a --logprobs-mode that "
            "returns logits; start it with --logprobs-mode processed_logprobs (grpo vllm-serve does).",
            400,
        )
    return out


class ServerControl:
    """A :class:`~grpo_core.contract.types.ControlEndpoint` over one server's client:
    its API key and socket, no retries (a control request may not be
    idempotent)."""

    def __init__(self, client: VLLMClient, description: str) -> None:
        self._client = client
        self.description = description

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> Any:
        response = self._client.request(
            method, path, None if body is None else dict(body), timeout=timeout, retry=False
        )
        return response.json() if response.content else None


class VLLMServerEngine:
    """One vLLM OpenAI server, managed (grpo started it) or external.

    Unset ``url``/``managed``/``replica``: the single server the config
    names (``trl.vllm_server_base_url`` or host/port, adopted or started as
    ``trl.vllm_managed`` says). A pool (:mod:`grpo_plugins.vllm.pool`) builds
    its members with ``url`` (an external server of
    ``trl.vllm_server_base_urls``) or ``replica`` (managed server ``i`` of
    ``[vllm] data_parallel_size``)."""

    capabilities = frozenset(
        {
            WEIGHTS_FROM_PATH,
            ADAPTER_FROM_PATH,
            ADAPTER_FROM_URL,
            WEIGHTS_FROM_URL,
            WEIGHTS_OVER_NCCL,
            CONTROL_ENDPOINTS,
            SCORES_TOKENS,
            PAUSES_GENERATION,
            CONTINUES_FROM_IDS,
        }
    )

    def __init__(self, context: RunContext, *, url: str | None = None, replica: int | None = None) -> None:
        self.context = context
        cfg = context.config
        trl = cfg.trl
        self.log = context.log
        self.timeout = float(trl.vllm_server_timeout or 240)
        self.server: ManagedServer | None = None
        self._lock = threading.RLock()
        self.gate = ProbeGate()  # generation shares the server; a sync check's probe has it alone
        self._prepared = False
        self._base = SERVED_MODEL_NAME  # an external server's own name for it is read in ensure_ready
        self._served = self._base
        self.facts = ServerFacts()  # what an external server says about itself (ensure_ready)
        self._label: str | None = None
        self._loads = 0
        self.restarts = 0  # managed restarts so far: a request that failed before one may try again
        self._last_load: Callable[[], None] | None = None
        self.applied = 0  # loads and re-applications so far: a request that failed before one need not re-apply
        self._retie_missing = False  # the server lacks grpo's worker extension
        self.run_id = f"{id(self):x}"[-8:]
        api_key = configured_api_key(cfg)
        if url is not None:  # one external server of several: never adopted blindly, never started
            managed = False
            api_key = api_key or handed_key(url, self.log)
        elif replica is not None:
            managed = True
        else:
            managed = trl.vllm_managed
            url = server_url(context)
            if managed is not True:
                api_key = api_key or handed_key(url, self.log)
            if managed is None:
                api_key, refusal = server_to_adopt(url, api_key)
                managed = refusal is not None
                if not managed:
                    self.log(f"vLLM: using the server already answering at {url}")
                elif refusal != NOTHING_ANSWERS:
                    self.log(
                        f"vLLM: not using the server at {url}: {refusal}; starting a private one (set "
                        "trl.vllm_managed = false to use that server, and [vllm] api_key if it checks one; "
                        "a `trl vllm-serve` checks none)"
                    )
        if managed:
            if trl.vllm_server_base_url or trl.vllm_server_base_urls:
                raise ConfigError(
                    "trl.vllm_managed = true starts its own server; remove trl.vllm_server_base_url(s) "
                    "(or set trl.vllm_managed = false to use those servers)."
                )
            # A private Unix socket, or TCP with a key made for this run.
            spec = managed_spec(cfg, context.engine_requirements, replica=replica)
            for warning in spec.warnings:
                self.log("WARNING: " + warning)
            log_name = LOG_NAME if replica is None else LOG_NAME.replace(".log", f"-{replica}.log")
            self.server = ManagedServer(spec, context.output_dir / log_name, log=self.log)
            self.server.start()  # does not block: readiness is awaited at first use
            url, api_key = spec.base_url, spec.api_key
        assert url is not None
        self.client = VLLMClient(url, api_key, timeout=self.timeout, log=self.log)
        if self.server is not None:
            self.client.dead_check = self.server.dead_reason
        elif trl.vllm_managed is False and not self.client.health():
            if old_trl_protocol(url):
                raise EngineRequestError(OLD_TRL_PROTOCOL.format(url=url), 404)
            # Said now, not after the model has loaded (it may just be starting up too).
            self.log(
                f"WARNING: nothing answers at {url} yet; after loading the model grpo waits up to "
                f"{self.timeout:.0f} s (trl.vllm_server_timeout) for it. Start it with `grpo vllm-serve CONFIG`, "
                "or set trl.vllm_managed = true."
            )

    # ------------------------------------------------------------------ InferenceEngine

    @property
    def description(self) -> str:
        return f"vLLM server at {self.client.base_url}" + (" (managed)" if self.server is not None else "")

    @property
    def served_model(self) -> str:
        return self._served

    @property
    def weight_label(self) -> str | None:
        return self._label

    @property
    def same_host(self) -> bool:
        if self.server is not None or self.client.socket is not None:  # a Unix socket is always on this host
            return True
        return is_loopback(urlparse(self.client.base_url).hostname or "")

    @property
    def weight_dtype(self) -> str | None:
        """Known for a server grpo started from the config; an external
        server may have been started with any dtype."""
        if self.server is None:
            return self.facts.dtype
        return known_dtype(self.context.config)

    @property
    def cpu_cores(self) -> frozenset[int] | None:
        """The CPU cores a managed server's engine is pinned to ([vllm]
        engine_cpus; by default half the cores under async_prefetch): the
        trainer keeps off them. ``None``: no split."""
        return self.server.spec.engine_cpus if self.server is not None else None

    def healthy(self) -> bool:
        return self.client.health()

    @property
    def ready(self) -> bool:
        """:meth:`ensure_ready` has succeeded once (the server answered)."""
        return self._prepared

    def ensure_ready(self) -> None:
        """Wait for the server, then clean what earlier runs left: foreign
        adapters unloaded, foreign full weights replaced by the base model,
        prefix cache reset. Runs once; later calls return at once."""
        with self._lock:
            if self._prepared:
                return
            if self.server is not None:
                self.server.wait_ready(max(self.timeout, 300.0))
            else:
                self.client.wait_healthy()
            self._clean_server()
            self._prepared = True

    def restart_if_dead(
        self, reapplying: str = "the managed server was restarted; re-applying the last weight sync"
    ) -> bool:
        """Managed mode: bring a server that exited back up and give it the
        last weights again (``reapplying`` is what the log says then). The
        lock keeps the prefetch thread and the trainer thread from restarting
        it twice."""
        with self._lock:
            if self.server is None or self.server.alive():
                return False
            self.log(
                "vLLM: " + (self.server.dead_reason() or "managed server is gone").splitlines()[0] + "; restarting it"
            )
            self.server.stop()
            self.server.start()
            self.server.wait_ready(max(self.timeout, 300.0))
            self.restarts += 1
            self.reapply(reapplying)
            return True

    def back_since(self, restarts: int) -> bool:
        """After a request failed with ``EngineUnavailable``: whether the
        server is up again since :attr:`restarts` read ``restarts``, restarted
        now by this thread or already by another (the prefetch thread and the
        trainer's both find a dead server; the first restarts it, with the
        last load re-applied). ``False``: nothing came back, the error stands."""
        return self.restart_if_dead() or self.restarts != restarts

    def load_weights_from_path(self, path: Path) -> None:
        def load() -> None:
            self.client.collective_rpc("reload_weights", {"weights_path": str(path)})
            self._retie_output_embeddings()
            self.client.reset_prefix_cache()
            self._served = self._base

        self._load("full", load)

    def load_adapter(self, path: Path) -> None:
        def load() -> None:
            self.client.load_lora_adapter(POLICY_ADAPTER, str(path), inplace=True)
            self._served = POLICY_ADAPTER

        self._load("lora", load)

    def load_adapter_from_url(self, url: str, token: str) -> None:
        """The server's first worker fetches the adapter into a private folder
        on the server's machine (:mod:`grpo_plugins.vllm.worker_ext`), which
        the server then loads as the policy adapter: it never reads the
        trainer's disk."""

        def load() -> None:
            answer = self.client.collective_rpc(
                "grpo_fetch_adapter", {"url": url, "token": token, "keep": self.adapter_folders_kept()}
            )
            paths = [str(p) for p in (answer or {}).get("results") or [] if p]
            if not paths:
                raise EngineRequestError(
                    f"vLLM server at {self.client.base_url} did not fetch the adapter from {url} (answer: {answer!r}); "
                    f"it needs --worker-extension-cls {WORKER_EXTENSION} (grpo vllm-serve and managed servers have "
                    "it).",
                    500,
                )
            self.client.load_lora_adapter(POLICY_ADAPTER, paths[0], inplace=True)
            self._served = POLICY_ADAPTER

        self._load("lora", load)

    def adapter_folders_kept(self) -> int:
        """How many fetched adapter folders the server keeps: the new one,
        the one it serves until the new one is loaded, and one for each
        batch ``async_prefetch`` may still be sampling under an older
        adapter (vLLM re-reads an in-place adapter at every step, see
        :func:`grpo_plugins.vllm.worker_ext.write_adapter`)."""
        trl = self.context.config.trl
        return 2 + (int(trl.prefetch_depth or 1) if trl.async_prefetch else 0)

    def load_weights_from_url(self, url: str, token: str) -> None:
        """Each worker fetches the safetensors bytes from ``url`` and loads
        them in place (:mod:`grpo_plugins.vllm.worker_ext`): no file on
        either side."""

        def load() -> None:
            answer = self.client.collective_rpc("grpo_load_weights_from_url", {"url": url, "token": token})
            loaded = (answer or {}).get("results") or []
            if not loaded or not all(str(n).isdigit() and int(n) > 0 for n in loaded):
                raise EngineRequestError(
                    f"vLLM server at {self.client.base_url} did not load the weights from {url} (answer: {answer!r}); "
                    f"it needs --worker-extension-cls {WORKER_EXTENSION} (grpo vllm-serve and managed servers have "
                    "it).",
                    500,
                )
            self.client.reset_prefix_cache()
            self._served = self._base

        self._load("full", load)

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"{self.description} cannot take weights in memory; use load_weights_from_path")

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        return PACKED_GROUPS

    def control_endpoints(self) -> list[ControlEndpoint]:
        """This server, taking authenticated control requests (the ``nccl``
        sync's weight-transfer routes)."""
        return [ServerControl(self.client, self.description)]

    def score_tokens(self, token_ids: Sequence[int]) -> list[EngineScore]:
        """This server's log-prob of each token given its prefix, under the
        model it serves now: one ``/v1/completions`` request with the ids as
        the prompt, ``prompt_logprobs: 0`` and one generated token. vLLM
        computes prompt log-probs from the full softmax whatever the
        sampling parameters (the same under ``processed_logprobs`` and
        ``raw_logprobs``; a ``*_logits`` server returns logits, refused
        here), and never from its prefix cache."""
        ids = [int(t) for t in token_ids]
        self.ensure_ready()

        def score() -> list[EngineScore]:
            model = self._served
            payload = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
            with self.gate.probe():  # never batched with generation: vLLM's CPU LoRA path crashes then (probe_gate.py)
                scores = self.client.completions(payload, parse=lambda d: prompt_logprobs(d, ids, self.description))
            return [EngineScore(self.description, scores, model)]

        restarts = self.restarts
        try:
            return score()
        except EngineUnavailable:  # a managed server that died under the probe: ask it again once it is back
            if not self.back_since(restarts):
                raise
            return score()

    # ------------------------------------------------------------------ weights

    def _load(self, kind: str, load: Callable[[], None]) -> None:
        """Run one load (restarting a dead managed server once), remember it
        for re-application, and label the server's weights."""
        self.ensure_ready()
        with self._lock:
            self._loads += 1
            tag = f"{OWN_TAG_PREFIX}{kind}-{self.run_id}-{self._loads}"

            def apply() -> None:
                load()
                self.applied += 1
                self._label = tag if self.client.set_weight_version(tag) else None

            try:
                apply()
            except EngineUnavailable:
                if self.server is None or self.server.alive():
                    raise
                self._last_load = apply
                self.restart_if_dead("re-applying this weight sync to the restarted server")
                return
            self._last_load = apply

    def reapply(self, message: str, *, seen: int | None = None) -> None:
        """Give a server that lost our weights the last load again, saying
        ``message`` first. ``seen``: the :attr:`applied` count a failed
        request was sent under; when weights were applied since (another of
        the requests in flight together got there first), there is nothing
        to do: each re-application of ``lora_http`` fetches a new adapter
        folder, and a burst of them would outrun the folders the requests
        still read (:func:`grpo_plugins.vllm.worker_ext.write_adapter`)."""
        with self._lock:
            if self._last_load is None or (seen is not None and seen != self.applied):
                return
            self.log(f"vLLM: {message}")
            self._last_load()

    def weights_lost(self) -> bool:
        """The server holds other weights than our last load (it restarted
        behind our back)."""
        if self._label is None or self._last_load is None:
            return False
        current = self.client.weight_version()
        return current is not None and current != self._label

    def ensure_weights(self) -> None:
        """Before generating: a server that died is restarted, and one that
        lost our weights gets them again."""
        restarts = self.restarts
        try:
            if not self.restart_if_dead() and self.weights_lost():
                self.reapply(
                    "the server holds other weights than the last sync (restarted?); re-applying the last weight sync"
                )
        except EngineUnavailable:  # it died while we asked
            if not self.back_since(restarts):
                raise

    def _retie_output_embeddings(self) -> None:
        """Refresh a tied LM head after a reload (worker_ext.py says
        why). A server started without grpo's worker extension (a stock
        ``vllm serve``) cannot: said once, since only a sync that changes the
        embeddings (full fine-tuning) is affected."""
        if self._retie_missing:
            return
        try:
            self.client.request("POST", "/collective_rpc", {"method": RETIE_METHOD, "kwargs": {}}, retry=False)
        except (EngineRequestError, EngineUnavailable) as exc:
            if self.server is not None:
                raise  # grpo started this server with the extension: a real failure
            self._retie_missing = True
            self.log(
                f"WARNING: {self.description} has no grpo worker extension ({str(exc).splitlines()[0][:200]}); "
                "after a full fine-tuning sync a model with tied embeddings may sample with its old LM head on "
                "vLLM's CPU backend. Start the server with `grpo vllm-serve` (or --worker-extension-cls "
                f"{WORKER_EXTENSION})."
            )

    def _models(self) -> list[dict[str, Any]]:
        """``/v1/models``; a server of TRL's older protocol is refused in one line."""
        try:
            return self.client.models()
        except EndpointMissing:
            if old_trl_protocol(self.client.base_url):
                raise EngineRequestError(OLD_TRL_PROTOCOL.format(url=self.client.base_url), 404) from None
            raise

    def _learn_external(self, models: list[dict[str, Any]]) -> None:
        """Read what a server started by hand is (:mod:`.external`): the
        name it serves the base model under, and refuse one whose log-probs
        or LoRA layers this run cannot use, naming the flag to restart with."""
        self.facts = facts = read_facts(self.client, models)
        if facts.base_model:
            self._base = self._served = facts.base_model
        where = self.description
        if not facts.dev_mode:
            self.log(
                f"vLLM: {where} has no /server_info (dev mode off): its --logprobs-mode, dtype and LoRA "
                "settings cannot be checked; full-weight syncs need VLLM_SERVER_DEV_MODE=1 too"
            )
            return
        problem = logprobs_problem(facts.logprobs_mode, float(self.context.config.trl.temperature or 1.0), where)
        if problem:
            raise ConfigError(problem)
        cfg = self.context.config
        if ADAPTER_LOADS & self.context.engine_requirements:
            rank = int(cfg.lora_r or 0)
            sync = (
                f"'{cfg.plugins.weight_sync}'"
                if cfg.plugins.weight_sync
                else "'lora_filesystem' (trl.vllm_lora_sync = true)"
            )
            if not facts.lora:
                raise ConfigError(
                    f"{where} has no LoRA layers, and weight sync {sync} loads "
                    f"the adapter into it: restart it with --enable-lora --max-lora-rank {rank} and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (`trl vllm-serve` passes extra flags on "
                    "to vLLM), or set trl.vllm_lora_sync = false to send the merged weights instead."
                )
            if facts.max_lora_rank is not None and rank > int(facts.max_lora_rank):
                raise ConfigError(
                    f"{where} takes LoRA ranks up to {facts.max_lora_rank} (--max-lora-rank), but lora_r = {rank}: "
                    f"restart it with --max-lora-rank {rank}."
                )

    def _clean_server(self) -> None:
        client = self.client
        base_root = None
        models = self._models()
        if self.server is None:
            self._learn_external(models)
        for model in models:
            if model.get("parent") is None:
                base_root = base_root or model.get("root")
                continue
            if client.owned_adapters.get(model["id"]) == model.get("root"):
                continue
            try:
                client.unload_lora_adapter(model["id"])
            except EngineRequestError as exc:
                if exc.status != 404:
                    raise
                continue  # gone since the list was read: another handle of the same server unloaded it
            self.log(f"vLLM: unloaded adapter '{model['id']}' left on the server by an earlier run")
        tag = client.weight_version()
        if tag is not None and tag.startswith(OWN_TAG_PREFIX + "full-") and tag != self._label:
            if not base_root:
                raise EngineUnavailable(f"vLLM server at {client.base_url} does not report its base model path")
            client.collective_rpc("reload_weights", {"weights_path": base_root})
            self._retie_output_embeddings()
            client.set_weight_version("default")
            self.log(f"vLLM: restored base weights from {base_root} (an earlier run had replaced them, tag {tag})")
        try:
            client.reset_prefix_cache()
        except EndpointMissing:
            self.log("vLLM: server has no /reset_prefix_cache (dev mode off); prefix cache not reset")

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()  # also deletes the private socket directory
            self.log("vLLM: managed server stopped")

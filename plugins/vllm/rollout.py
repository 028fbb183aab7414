"""The ``vllm`` rollout: completions sampled by a vLLM server over HTTP.

Server choice: ``trl.vllm_server_base_url``, else ``trl.vllm_server_host`` and
``trl.vllm_server_port``. Managed mode (``trl.vllm_managed = true``, or unset
and nothing answers there) starts a server from the ``[vllm]`` table and
stops it at the end of training.

Services shared with the vLLM weight syncs (through ``context.services``):

* ``vllm.client``  - the :class:`VLLMClient` (published here)
* ``vllm.prepare`` - waits until the server is up and cleans what earlier
  runs left on it (published here; idempotent)
* ``vllm.restart`` - restarts a managed server that exited; True if it did
  (published here)
* ``vllm.model``   - the model name to request (``'base'``; a LoRA sync sets
  ``'policy'``)
* ``vllm.weight_tag`` / ``vllm.resync`` - the label the last sync gave the
  server's weights, and how to redo that sync (published by the sync). A
  server that restarted forgets both its adapters and the label: the rollout
  notices (label changed, or 404 on ``'policy'``) and re-syncs before it
  generates again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from grpo_core import hookimpl
from grpo_core.errors import ConfigError, EngineUnavailable
from grpo_core.types import Completion, Prompt, RolloutGroup, SamplingSettings
from grpo_plugins.vllm.client import EndpointMissing, ModelNotLoaded, VLLMClient
from grpo_plugins.vllm.sampling import sampling_fields
from grpo_plugins.vllm.server import LOG_NAME, SERVED_MODEL_NAME, ManagedServer, server_spec

if TYPE_CHECKING:
    from grpo_core.context import RunContext

MAX_PROMPTS_PER_REQUEST = 256
OWN_TAG_PREFIX = "grpo-"
FULL_TAG_PREFIX = "grpo-full-"


def server_url(context: RunContext) -> str:
    trl = context.config.trl
    if trl.vllm_server_base_url:
        return trl.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if trl.vllm_server_host in ("0.0.0.0", "") else trl.vllm_server_host
    return f"http://{host}:{trl.vllm_server_port}"


class VLLMRollout:
    """``grpo.rollout:vllm``."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        cfg = context.config
        trl = cfg.trl
        if trl.vllm_mode == "colocate":
            raise ConfigError(
                "plugins.rollout = 'vllm' talks to a vLLM server, but trl.vllm_mode = 'colocate'. Remove "
                "plugins.rollout (colocate mode picks 'vllm_colocate'), or set trl.vllm_mode = 'server'."
            )
        self.timeout = float(trl.vllm_server_timeout or 240)
        self.server: ManagedServer | None = None
        self._prepared = False
        self._lock = threading.RLock()
        self._calls = 0
        self._known_fields: set[str] | None = None
        managed = trl.vllm_managed
        url = server_url(context)
        if managed is None:
            managed = not VLLMClient(url, cfg.vllm.api_key).health()
            if not managed:
                context.log(f"vLLM: using the server already answering at {url}")
        if managed:
            if trl.vllm_server_base_url:
                raise ConfigError(
                    "trl.vllm_managed = true starts its own server; remove trl.vllm_server_base_url "
                    "(or set trl.vllm_managed = false to use that server)."
                )
            spec = server_spec(cfg)
            for warning in spec.warnings:
                context.log("WARNING: " + warning)
            self.server = ManagedServer(spec, context.output_dir / LOG_NAME, log=context.log)
            self.server.start()  # does not block: readiness is awaited at first use
            url = spec.base_url
        self.client = VLLMClient(url, cfg.vllm.api_key, timeout=self.timeout, log=context.log)
        if self.server is not None:
            self.client.dead_check = self.server.dead_reason
        elif trl.vllm_managed is False and not self.client.health():
            # Said now, not after the model has loaded (it may just be starting up too).
            context.log(
                f"WARNING: nothing answers at {url} yet; after loading the model grpo waits up to "
                f"{self.timeout:.0f} s (trl.vllm_server_timeout) for it. Start it with `grpo vllm-serve CONFIG`, "
                "or set trl.vllm_managed = true."
            )
        services = context.services
        services["vllm.client"] = self.client
        services["vllm.prepare"] = self.prepare
        services["vllm.restart"] = self._restart_if_dead
        services.setdefault("vllm.model", SERVED_MODEL_NAME)

    # ------------------------------------------------------------------ server hygiene

    def prepare(self) -> None:
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

    def _clean_server(self) -> None:
        client, log = self.client, self.context.log
        base_root = None
        for model in client.models():
            if model.get("parent") is None:
                base_root = base_root or model.get("root")
                continue
            if client.owned_adapters.get(model["id"]) == model.get("root"):
                continue
            client.unload_lora_adapter(model["id"])
            log(f"vLLM: unloaded adapter '{model['id']}' left on the server by an earlier run")
        tag = client.weight_version()
        if tag is not None and tag.startswith(FULL_TAG_PREFIX) and tag != self.context.services.get("vllm.weight_tag"):
            if not base_root:
                raise EngineUnavailable(f"vLLM server at {client.base_url} does not report its base model path")
            client.collective_rpc("reload_weights", {"weights_path": base_root})
            client.set_weight_version("default")
            log(f"vLLM: restored base weights from {base_root} (an earlier run had replaced them, tag {tag})")
        try:
            client.reset_prefix_cache()
        except EndpointMissing:
            log("vLLM: server has no /reset_prefix_cache (dev mode off); prefix cache not reset")

    @hookimpl
    def grpo_train_start(self) -> None:
        self.prepare()

    @hookimpl
    def grpo_train_end(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.context.log("vLLM: managed server stopped")

    # ------------------------------------------------------------------ weights after a restart

    def _restart_if_dead(self) -> bool:
        """Managed mode: bring a server that exited back up. True if restarted.

        Published as ``vllm.restart`` so a weight sync that finds the server
        gone can bring it back too; the lock keeps the prefetch thread and
        the trainer thread from restarting it twice."""
        with self._lock:
            if self.server is None or self.server.alive():
                return False
            self.context.log("vLLM: " + (self.server.dead_reason() or "managed server is gone").splitlines()[0] + "; restarting it")
            self.server.stop()
            self.server.start()
            self.server.wait_ready(max(self.timeout, 300.0))
            return True

    def _weights_lost(self) -> bool:
        tag = self.context.services.get("vllm.weight_tag")
        if not tag or "vllm.resync" not in self.context.services:
            return False
        current = self.client.weight_version()
        return current is not None and current != tag

    def _ensure_weights(self) -> None:
        """Before generating: a server that died is restarted, and one that
        lost our weights (restarted behind our back) gets them again."""
        try:
            if self._restart_if_dead():
                self._resync("the managed server was restarted")
            elif self._weights_lost():
                self._resync("the server holds other weights than the last sync (restarted?)")
        except EngineUnavailable:  # it died while we asked
            if not self._restart_if_dead():
                raise
            self._resync("the managed server was restarted")

    def _resync(self, why: str) -> None:
        resync = self.context.services.get("vllm.resync")
        if resync is None:
            return
        self.context.log(f"vLLM: {why}; re-applying the last weight sync")
        resync()

    # ------------------------------------------------------------------ generation

    def _payload(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.context.services.get("vllm.model", SERVED_MODEL_NAME),
            "prompt": prompt_ids,
            "return_token_ids": True,
            **sampling_fields(sampling, n, self._calls),
        }
        if sampling.guided_regex:
            payload["structured_outputs"] = {"regex": sampling.guided_regex}
        if sampling.extra:
            self._check_extra(sampling.extra)
            payload.update(sampling.extra)
        return payload

    def _check_extra(self, extra: dict[str, Any]) -> None:
        """vLLM silently ignores unknown request fields; refuse them instead."""
        if self._known_fields is None:
            self._known_fields = self.client.openapi_fields("CompletionRequest") or set()
        if not self._known_fields:
            return
        unknown = sorted(set(extra) - self._known_fields)
        if unknown:
            raise ConfigError(
                f"trl.generation_kwargs: vLLM's /v1/completions does not know {unknown}; it would ignore them. "
                "Use vLLM SamplingParams names (e.g. stop_token_ids, min_tokens, presence_penalty)."
            )

    @staticmethod
    def _parse(data: dict[str, Any], prompt_ids: list[list[int]], n: int) -> list[list[Completion]]:
        """Choices -> completions per prompt. Raises ValueError on an answer
        that does not fit the request (the client retries those)."""
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompt_ids) * n:
            raise ValueError(f"expected {len(prompt_ids) * n} choices, got {len(choices)}")
        out: list[list[Completion]] = [[] for _ in prompt_ids]
        for pos, choice in enumerate(choices):
            p = pos // n
            if choice.get("prompt_token_ids") not in (None, prompt_ids[p]):
                raise ValueError(f"choice {choice['index']} answers a different prompt")
            token_ids = [int(t) for t in choice["token_ids"]]
            raw = (choice.get("logprobs") or {}).get("token_logprobs")
            logprobs = [float(x) for x in raw] if raw is not None else None
            if logprobs is not None and len(logprobs) != len(token_ids):
                raise ValueError(f"choice {choice['index']}: {len(logprobs)} log-probs for {len(token_ids)} tokens")
            out[p].append(Completion(token_ids, str(choice["text"]), logprobs, choice.get("finish_reason") == "length"))
        return out

    def _request(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings) -> list[list[Completion]]:
        payload = self._payload(prompt_ids, n, sampling)
        return self.client.completions(payload, parse=lambda d: self._parse(d, prompt_ids, n))

    def _generate_chunk(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings) -> list[list[Completion]]:
        for attempt in range(3):
            last = attempt == 2
            outages = self.client.outages
            try:
                result = self._request(prompt_ids, n, sampling)
            except ModelNotLoaded:
                if last or "vllm.resync" not in self.context.services:
                    raise
                self._resync("the server does not know the policy adapter (restarted?)")
                continue
            except EngineUnavailable:
                if last or not self._restart_if_dead():
                    raise
                self._resync("the managed server was restarted")
                continue
            # Answered after an outage: the server may have restarted in between
            # and sampled from base weights without complaint (full-weight sync).
            if self.client.outages != outages and self._weights_lost() and not last:
                self._resync("the server came back without our weights")
                continue
            return result
        raise AssertionError("unreachable")

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        self.prepare()
        self._ensure_weights()
        completions: list[list[Completion]] = []
        for start in range(0, len(prompts), MAX_PROMPTS_PER_REQUEST):
            chunk = [list(p.prompt_ids) for p in prompts[start : start + MAX_PROMPTS_PER_REQUEST]]
            completions += self._generate_chunk(chunk, num_generations, sampling)
        self._calls += 1
        return [RolloutGroup(prompt, comps, policy_version) for prompt, comps in zip(prompts, completions, strict=True)]

"""The ``vllm`` rollout: completions sampled by a vLLM server over HTTP.

Server choice: ``trl.vllm_server_base_url``, else ``trl.vllm_server_host`` and
``trl.vllm_server_port``. Managed mode (``trl.vllm_managed = true``, or unset
and nothing answers there) starts a server from the ``[vllm]`` table and
stops it at the end of training.

Several servers: ``trl.vllm_server_base_urls`` (external), or managed
``[vllm] data_parallel_size`` > 1. The engine is always a
:class:`~grpo_plugins.vllm.pool.VLLMEnginePool` (one server is a pool of
one), handed to the weight sync through ``grpo_inference_engine``. A
generation call splits its prompts into near-equal contiguous shares, one
per live server (whole groups: all ``n`` completions of a prompt come from
one server), and sends them in parallel; the share of a server that fails
is dropped from it and re-sent to the others. Requests are independent HTTP
calls, so several may be in flight at once (``concurrent_generate``):
streaming scoring overlaps them with scoring.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from grpo_core.plugin_api import (
    ADAPTER_FROM_PATH,
    ADAPTER_FROM_URL,
    CONTINUES_FROM_IDS,
    CONTROL_ENDPOINTS,
    PAUSES_GENERATION,
    SCORES_TOKENS,
    WEIGHTS_FROM_PATH,
    WEIGHTS_FROM_URL,
    WEIGHTS_OVER_NCCL,
    Completion,
    ConfigError,
    EngineUnavailable,
    InferenceEngine,
    Prompt,
    RolloutGroup,
    SamplingSettings,
    hookimpl,
    visible_gpus,
)
from grpo_plugins.vllm.client import ModelNotLoaded
from grpo_plugins.vllm.engine import VLLMServerEngine
from grpo_plugins.vllm.inflight import choices_by_prompt, generate_across_updates
from grpo_plugins.vllm.placement import placement_problems, unchecked_gpus_note
from grpo_plugins.vllm.pool import VLLMEnginePool
from grpo_plugins.vllm.sampling import generation_extra, sampling_fields
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig, RunContext

MAX_PROMPTS_PER_REQUEST = 256
# Seeded calls send one request per prompt (see _generate_share); this many at once.
MAX_SEEDED_REQUESTS_IN_FLIGHT = 64


class VLLMRollout:
    """Generation on vLLM servers, managed by grpo or external.

    ``grpo.rollout:vllm``."""

    engine_capabilities = frozenset(
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
    concurrent_generate = True

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.engine = VLLMEnginePool(context)
        self.client = self.engine.live()[0].client  # the first server (for questions every server answers alike)
        self._counter_lock = threading.Lock()
        self._calls = 0
        self._known_fields: set[str] | None = None
        self.in_flight = bool(context.config.trl.in_flight_weight_updates)  # requests go on across weight updates

    @staticmethod
    def grpo_validate_config(config: GRPOConfig, num_processes: int = 1) -> list[str]:
        if config.trl.vllm_mode == "colocate":
            raise ConfigError(
                "plugins.rollout = 'vllm' talks to a vLLM server, but trl.vllm_mode = 'colocate'. Remove "
                "plugins.rollout (colocate mode picks 'vllm_colocate'), or set trl.vllm_mode = 'server'."
            )
        trl, v = config.trl, vllm_settings(config)
        external = bool(trl.vllm_server_base_urls) or trl.vllm_managed is False
        if (v.devices is not None or v.trainer_devices is not None) and external:
            raise ConfigError(
                "[vllm] devices / trainer_devices place the servers grpo starts, but this run uses external servers "
                "(trl.vllm_server_base_urls, or trl.vllm_managed = false): start those on the GPUs you want "
                "(CUDA_VISIBLE_DEVICES=... grpo vllm-serve CONFIG) and remove the keys, or let grpo start them."
            )
        gpus = visible_gpus() if v.devices is not None or v.trainer_devices is not None else 0
        problems = placement_problems(config, num_processes, gpus)
        if problems:
            raise ConfigError(" ".join(problems))
        unchecked = unchecked_gpus_note(config, gpus)
        if trl.vllm_server_base_urls is not None and not trl.vllm_server_base_urls:
            raise ConfigError("trl.vllm_server_base_urls is empty: list at least one server, or remove the key.")
        if trl.vllm_server_base_urls and trl.vllm_server_base_url:
            raise ConfigError(
                "trl.vllm_server_base_url and trl.vllm_server_base_urls are both set: keep one (the list may hold one "
                "URL)."
            )
        if trl.vllm_server_base_urls and trl.vllm_managed:
            raise ConfigError(
                "trl.vllm_managed = true starts its own servers; remove trl.vllm_server_base_urls (or set "
                "trl.vllm_managed = false)."
            )
        return [unchecked] if unchecked else []

    @hookimpl
    def grpo_inference_engine(self) -> InferenceEngine:
        return self.engine

    @hookimpl
    def grpo_train_start(self) -> None:
        self.engine.ensure_ready()

    @hookimpl
    def grpo_step_end(self, metrics: dict[str, float]) -> None:
        if self.in_flight:  # what the step's in-flight updates cost (plugins/vllm/inflight.py: COSTS)
            metrics.update(self.engine.in_flight.take_costs())

    @hookimpl
    def grpo_train_end(self) -> None:
        regenerated = self.engine.in_flight.regenerated
        if regenerated:
            self.context.log(
                f"vLLM: in-flight weight updates: {regenerated} sample(s) generated again (an answer read across a "
                "pause, with nothing aborted, cannot tell which weights sampled it)"
            )
        self.engine.shutdown()

    # ------------------------------------------------------------------ generation

    def _payload(
        self,
        engine: VLLMServerEngine,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        call: int,
        first: int,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": engine.served_model,
            "prompt": prompt_ids,
            "return_token_ids": True,
            **sampling_fields(sampling, n, call, first),
        }
        if sampling.guided_regex:
            payload["structured_outputs"] = {"regex": sampling.guided_regex}
        if sampling.extra:
            self._check_extra(sampling.extra)
            payload.update(generation_extra(sampling))
        return payload

    def _check_extra(self, extra: dict[str, Any]) -> None:
        """vLLM silently ignores unknown request fields; refuse them instead."""
        if self._known_fields is None:
            self._known_fields = self.engine.live()[0].client.openapi_fields("CompletionRequest") or set()
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

    def _request(
        self,
        engine: VLLMServerEngine,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        call: int,
        first: int,
    ) -> list[list[Completion]]:
        payload = self._payload(engine, prompt_ids, n, sampling, call, first)
        if self.in_flight:
            return self._request_across_updates(engine, payload, prompt_ids, n)
        with engine.gate.generation():
            return engine.client.completions(payload, parse=lambda d: self._parse(d, prompt_ids, n))

    def _request_across_updates(
        self, engine: VLLMServerEngine, payload: dict[str, Any], prompt_ids: list[list[int]], n: int
    ) -> list[list[Completion]]:
        """One request that goes on across in-flight weight updates
        (:mod:`grpo_plugins.vllm.inflight`): each completion records the
        policy version of every token. A continuation names the model the
        engine serves now (the adapter, after a first LoRA load), asks for
        what is left of ``max_tokens`` (and of ``min_tokens``) and drops the
        seed (every continuation of a request would share it)."""
        max_tokens = int(payload["max_tokens"])

        def send(prompts: list[list[int]], count: int, already: int) -> list[list[dict[str, Any]]]:
            body = {**payload, "prompt": prompts, "n": count, "model": engine.served_model}
            if already:
                body["max_tokens"] = max_tokens - already
                body.pop("seed", None)
                if isinstance(body.get("min_tokens"), int):
                    body["min_tokens"] = max(0, body["min_tokens"] - already)
            with engine.gate.generation():
                return engine.client.completions(body, parse=lambda d: choices_by_prompt(d, prompts, count))

        results = generate_across_updates(self.engine.in_flight, send, prompt_ids, n, max_tokens)
        return [
            [
                Completion(p.token_ids, p.text, p.logprobs, p.finish_reason == "length", token_versions=p.versions)
                for p in partials
            ]
            for partials in results
        ]

    def _generate_chunk(
        self,
        engine: VLLMServerEngine,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        call: int,
        first: int,
    ) -> list[list[Completion]]:
        """One request (retried on a restart or lost weights); ``first`` is
        the call-wide index of its first prompt, which its seed derives from."""
        client = engine.client
        for attempt in range(3):
            last = attempt == 2
            outages = client.outages
            restarts = engine.restarts
            applied = engine.applied
            try:
                result = self._request(engine, prompt_ids, n, sampling, call, first)
            except ModelNotLoaded:
                if last:
                    raise
                # requests in flight together all fail so: the first re-applies, the others just retry
                engine.reapply(
                    "the server does not know the policy adapter (restarted?); re-applying the last weight sync",
                    seen=applied,
                )
                continue
            except EngineUnavailable:
                # Requests in flight together all fail when the server dies; the first to get
                # here restarts it, the others find it restarted and try again.
                if last or not engine.back_since(restarts):
                    raise
                continue
            # Answered after an outage: the server may have restarted in between
            # and sampled from base weights without complaint (full-weight sync).
            if client.outages != outages and engine.weights_lost() and not last:
                engine.reapply(
                    "the server came back without our weights; re-applying the last weight sync", seen=applied
                )
                continue
            return result
        raise AssertionError("unreachable")

    def _generate_share(
        self,
        engine: VLLMServerEngine,
        prompts: list[Prompt],
        indices: list[int],
        n: int,
        sampling: SamplingSettings,
        call: int,
    ) -> list[list[Completion]]:
        """One server's share of a call. Unseeded, prompts go in batched
        requests. Seeded, each prompt is a request of its own with a seed of
        its own (vLLM gives all prompts of a request one seed: see
        :func:`prompt_seed`), all in flight at once so the server still
        batches them; the seed follows the prompt's index in the call, so a
        prompt re-sent to another server of a pool samples the same."""
        if sampling.seed is None:
            completions: list[list[Completion]] = []
            for start in range(0, len(prompts), MAX_PROMPTS_PER_REQUEST):
                chunk = [list(p.prompt_ids) for p in prompts[start : start + MAX_PROMPTS_PER_REQUEST]]
                completions += self._generate_chunk(engine, chunk, n, sampling, call, 0)
            return completions
        if len(prompts) == 1:
            return self._generate_chunk(engine, [list(prompts[0].prompt_ids)], n, sampling, call, indices[0])
        workers = min(len(prompts), MAX_SEEDED_REQUESTS_IN_FLIGHT)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo-vllm-prompt") as pool:
            futures = [
                pool.submit(self._generate_chunk, engine, [list(p.prompt_ids)], n, sampling, call, i)
                for p, i in zip(prompts, indices)
            ]
            return [future.result()[0] for future in futures]

    def _generate_spread(
        self, prompts: list[Prompt], n: int, sampling: SamplingSettings, call: int
    ) -> list[list[Completion]]:
        """Whole groups, spread over the live servers in parallel; a share
        whose server fails goes to the servers left (the pool drops the
        failed one, or raises when none is left)."""
        results: list[list[Completion] | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            shares = [(engine, [todo[i] for i in part]) for engine, part in self.engine.shares(len(todo), call)]

            def share(engine: VLLMServerEngine, idx: list[int]) -> list[list[Completion]]:
                return self._generate_share(engine, [prompts[i] for i in idx], idx, n, sampling, call)

            if len(shares) == 1:  # one server: no thread
                outcomes: list[tuple[VLLMServerEngine, list[int], Any]] = []
                try:
                    outcomes.append((*shares[0], share(*shares[0])))
                except EngineUnavailable as exc:
                    outcomes.append((*shares[0], exc))
            else:
                with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="grpo-vllm-share") as pool:
                    futures = [(engine, idx, pool.submit(share, engine, idx)) for engine, idx in shares]
                outcomes = [(engine, idx, future.exception() or future.result()) for engine, idx, future in futures]
            jobs = []
            for engine, idx, outcome in outcomes:
                if isinstance(outcome, EngineUnavailable):
                    self.engine.drop(engine, outcome)  # raises when it was the last server
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    jobs.append((engine, idx, outcome))
            for _, idx, done in jobs:
                for i, comps in zip(idx, done, strict=True):
                    results[i] = comps
            todo = [i for i in todo if results[i] is None]
        return results  # type: ignore[return-value]

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        self.engine.ensure_ready()
        self.engine.ensure_weights()
        with self._counter_lock:  # concurrent calls each get their own seed offset
            call = self._calls
            self._calls += 1
        completions = self._generate_spread(prompts, num_generations, sampling, call)
        return [RolloutGroup(prompt, comps, policy_version) for prompt, comps in zip(prompts, completions, strict=True)]

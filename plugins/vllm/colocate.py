"""``trl.vllm_mode = "colocate"``: vLLM inside the trainer process.

One ``vllm.LLM`` lives next to the trainer's model. Its engine core runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which is what makes the
weight sync cheap: the new weights go from the trainer's tensors straight
into vLLM's through ``reload_weights`` with an iterator, with no file, no
HTTP and no second copy of the model on disk. It also skips request
serialisation and the API server's own process (benchmarks/RESULTS.md
compares the two modes).

* ``grpo.rollout:vllm_colocate`` - :class:`VLLMColocateRollout`, which owns
  the engine (:class:`ColocatedEngine`, an ``InferenceEngine`` that takes
  weights in memory) and hands it out through ``grpo_inference_engine``.
* ``grpo.weight_sync:vllm_in_memory`` - :class:`InMemorySync`.

Sleep mode (``trl.vllm_enable_sleep_mode``) frees the engine's GPU memory
between generations (level 1: weights to host memory, KV cache dropped), for
a trainer that needs the memory in between. vLLM refuses it on CPU; there it
is a config error. The GPU path follows vLLM's documented sleep/wake_up API
but has not been run on a GPU by this project yet.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from grpo_core.plugin_api import (
    SCORES_TOKENS,
    WEIGHTS_IN_MEMORY,
    Completion,
    ConfigError,
    ControlEndpoint,
    EngineScore,
    EngineUnavailable,
    InferenceEngine,
    Prompt,
    RolloutGroup,
    SamplingSettings,
    SyncResult,
    hookimpl,
    in_dtype,
    merged_weights,
    resolve_model_dir,
)
from grpo_plugins.vllm.cpu_kernels import install as install_cpu_kernels
from grpo_plugins.vllm.engine import PACKED_GROUPS
from grpo_plugins.vllm.engine_settings import (
    block_size,
    cpu_kernels,
    cpu_kvcache_gib,
    enforce_eager,
    ir_op_priority,
    known_dtype,
    max_model_len,
    resolve_dtype,
)
from grpo_plugins.vllm.machine import cuda_available
from grpo_plugins.vllm.placement import TRAINER_SHARE_MAX
from grpo_plugins.vllm.sampling import generation_extra, sampling_fields
from grpo_plugins.vllm.settings import vllm_settings
from grpo_plugins.vllm.worker_ext import retie_output_embeddings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig, RunContext

# A LoRA sync reloads only the adapted modules; vLLM warns about every
# module it was not given (100+ lines per sync). That is intended here.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)

# vLLM's loader logs each tensor that it narrows to the engine's dtype.
_WEIGHT_LOADER_LOGGER = "vllm.model_executor.models.utils"


class NarrowedWeightFilter(logging.Filter):
    """Drops vLLM's "Attempted to load weight ... with dtype ... into
    parameter with dtype ..." warnings. A float32 checkpoint loaded into the
    bf16 engine that ``[vllm] dtype`` chose gives one per tensor (122 for
    SmolLM2) on the trainer's console at every start: the narrowing is the
    configured dtype, not a fault. vLLM's other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Attempted to load weight %s with dtype")


def quiet_narrowed_weight_warnings() -> None:
    """Install :class:`NarrowedWeightFilter` on vLLM's weight-loading logger, once."""
    logger = logging.getLogger(_WEIGHT_LOADER_LOGGER)
    if not any(isinstance(f, NarrowedWeightFilter) for f in logger.filters):
        logger.addFilter(NarrowedWeightFilter())


class ColocatedEngine:
    """One in-process ``vllm.LLM``, started on first use.

    Every call takes one lock: vLLM's ``LLM`` is not thread-safe, and with
    ``async_prefetch`` the producer thread generates while the trainer
    thread may want to sync weights. It lives and dies with the trainer's
    process, so it never restarts behind the trainer's back.
    """

    capabilities = frozenset({WEIGHTS_IN_MEMORY, SCORES_TOKENS})
    served_model = "base"
    same_host = True

    def __init__(self, cfg: GRPOConfig, log: Any = print) -> None:
        self.cfg = cfg
        self.log = log
        self.llm: Any = None
        self.sleep_mode = bool(cfg.trl.vllm_enable_sleep_mode)
        self._asleep = False
        self._lock = threading.RLock()
        self._packed: tuple[tuple[str, ...], ...] | None = None
        self._loads = 0

    @property
    def description(self) -> str:
        return "vLLM engine in the trainer's process (vllm_mode = 'colocate')"

    @property
    def weight_label(self) -> str | None:
        return f"grpo-memory-{self._loads}" if self._loads else None

    @property
    def weight_dtype(self) -> str | None:
        """The dtype the engine holds its weights in: the running engine's
        own (so a GPU's ``auto`` is known too), else the one it starts with."""
        if self.llm is not None:
            dtype = getattr(getattr(self.llm.llm_engine, "model_config", None), "dtype", None)
            if dtype is not None:
                return str(dtype).removeprefix("torch.")
        return known_dtype(self.cfg)

    def ensure_ready(self) -> None:
        self.start()

    def healthy(self) -> bool:
        return self.llm is not None

    def restart_if_dead(self) -> bool:
        return False  # in-process: if it died, so did the trainer

    def load_weights_from_path(self, path: Any) -> None:
        raise NotImplementedError(f"{self.description} takes weights in memory (load_weights)")

    def load_adapter(self, path: Any) -> None:
        raise NotImplementedError(f"{self.description} serves merged weights; it loads no adapters")

    def load_adapter_from_url(self, url: str, token: str) -> None:
        raise NotImplementedError(f"{self.description} serves merged weights; it loads no adapters")

    def load_weights_from_url(self, url: str, token: str) -> None:
        raise NotImplementedError(f"{self.description} takes weights in memory (load_weights), not over the network")

    def fused_modules(self) -> tuple[tuple[str, ...], ...]:
        return self.packed_groups()

    def control_endpoints(self) -> list[ControlEndpoint]:
        raise NotImplementedError(
            f"the {self.description} is no server: it takes no control requests (weight sync 'nccl' needs a vLLM "
            "server: trl.vllm_mode = 'server'; in colocate mode use [plugins] weight_sync = 'vllm_in_memory')"
        )

    # ------------------------------------------------------------------ lifecycle

    def _configure_environment(self) -> None:
        """vLLM reads these when the engine is built."""
        # In-process engine core: weights can be handed over as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the trainer's console is for training
        if not cuda_available():
            # Trainer and engine take turns on the same cores: give the engine all of them.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            kvcache = cpu_kvcache_gib(self.cfg)
            if kvcache is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache)

    def start(self) -> None:
        with self._lock:
            if self.llm is not None:
                return
            self._configure_environment()
            try:
                # vLLM is optional and slow to import: only when this engine runs
                from vllm import LLM
            except ImportError as exc:
                raise ConfigError(
                    f"trl.vllm_mode = 'colocate' needs vLLM in the trainer's environment ({exc}). Install "
                    "grpo[vllm] (GPU) or grpo[vllm-cpu]."
                ) from None
            # vLLM's modules live as long as the process: leave them out of the full collections vLLM makes
            # while it starts (7, ~0.3 s each over this heap; vLLM itself unfreezes at shutdown)
            gc.freeze()
            cfg, v = self.cfg, vllm_settings(self.cfg)
            kwargs: dict[str, Any] = {
                "model": resolve_model_dir(cfg.base_model),
                "dtype": resolve_dtype(v.dtype),
                "max_model_len": max_model_len(cfg),
                "seed": cfg.seed,
                "gpu_memory_utilization": v.gpu_memory_utilization,
                "tensor_parallel_size": v.tensor_parallel_size,
                # The sampler's log-probs after temperature/top-k/top-p: what
                # the trainer reproduces by dividing its logits by temperature.
                "logprobs_mode": "processed_logprobs",
                "enable_sleep_mode": self.sleep_mode,
                "enforce_eager": enforce_eager(cfg),
                "trust_remote_code": cfg.trust_remote_code,  # never the model's own code unless the config says so
            }
            if v.enable_prefix_caching is not None:
                kwargs["enable_prefix_caching"] = v.enable_prefix_caching
            # grpo's CPU kernels (cpu_kernels.py): the engine runs in this process, so they are installed here,
            # or vLLM's put back where an earlier engine in this process had grpo's
            wanted = cpu_kernels(cfg)
            if not cuda_available() and install_cpu_kernels(enabled=wanted) and wanted:
                self.log("vLLM: grpo's CPU sampler, RMSNorm and rank kernels in the engine ([vllm] cpu_kernels)")
                priority = ir_op_priority(cfg)
                if priority is not None:
                    kwargs["ir_op_priority"] = priority
            blocks = block_size(cfg)
            if blocks is not None:
                kwargs["block_size"] = blocks
            quiet_narrowed_weight_warnings()
            started = time.perf_counter()
            self.log("vLLM: starting the colocated engine in this process")
            try:
                self.llm = LLM(**kwargs)
            except Exception as exc:  # vLLM raises many types; the message is what helps
                raise EngineUnavailable(
                    f"vLLM could not start in-process (vllm_mode = 'colocate'): {type(exc).__name__}: {exc}"
                ) from exc
            for name in _RELOAD_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
            self.log(f"vLLM: colocated engine ready after {time.perf_counter() - started:.0f} s")

    def shutdown(self) -> None:
        with self._lock:
            if self.llm is None:
                return
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None
            )
            if shutdown is not None:
                shutdown()
            self.llm = None

    def _awake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep_if_enabled(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = True

    # ------------------------------------------------------------------ work

    def sampling_params(self, fields: dict[str, Any], sampling: SamplingSettings) -> Any:
        # vLLM is optional and slow to import: only when this engine runs
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        params = dict(fields)
        if sampling.guided_regex:
            params["structured_outputs"] = StructuredOutputsParams(regex=sampling.guided_regex)
        params.update(generation_extra(sampling))
        try:
            return SamplingParams(**params)
        except TypeError as exc:
            raise ConfigError(
                f"trl.generation_kwargs: vLLM's SamplingParams refused them ({exc}). Use SamplingParams names "
                "(e.g. stop_token_ids, min_tokens, presence_penalty)."
            ) from None

    def generate(self, prompt_ids: list[list[int]], params: Any) -> list[Any]:
        with self._lock:
            self.start()
            self._awake()
            try:
                return self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
            finally:
                self._sleep_if_enabled()

    def score_tokens(self, token_ids: Any) -> list[EngineScore]:
        """The engine's log-prob of each token given its prefix, from the
        weights it holds now (``prompt_logprobs``: the full softmax, never
        the prefix cache)."""
        # vLLM is optional and slow to import: only when this engine runs
        from vllm import SamplingParams

        ids = [int(t) for t in token_ids]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        output = self.generate([ids], params)[0]
        entries = output.prompt_logprobs or []
        if len(entries) != len(ids):
            raise EngineUnavailable(
                f"{self.description} returned prompt log-probs for {len(entries)} of {len(ids)} tokens"
            )
        return [
            EngineScore(
                self.description,
                [float(entry[token].logprob) for entry, token in zip(entries[1:], ids[1:], strict=True)],
                self.served_model,
            )
        ]

    def packed_groups(self) -> tuple[tuple[str, ...], ...]:
        """Which HF projections vLLM fuses into one weight, from the loaded
        model itself (e.g. ``qkv_proj`` <- q, k, v); grpo's default list if
        the model does not say."""
        if self._packed is None:
            self.start()

            def read(worker: Any) -> dict[str, list[str]]:
                return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})

            try:
                mapping = self.llm.collective_rpc(read)[0]
                self._packed = (
                    tuple(tuple(members) for members in mapping.values() if len(members) > 1) or PACKED_GROUPS
                )
            except Exception:  # an executor without callable RPC: the default holds for Llama-family models
                self._packed = PACKED_GROUPS
        return self._packed

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Copy ``weights`` (HF names) into the engine in place; weights not
        given keep their values. Cached prefixes were computed with the old
        weights, so the prefix cache is dropped."""
        with self._lock:
            self.start()
            self._awake()
            try:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": iter(weights.items()), "is_checkpoint_format": True}
                )
                self.llm.collective_rpc(retie_output_embeddings)  # a tied LM head's packed copy (CPU)
                self.llm.reset_prefix_cache()
                self._loads += 1
            finally:
                self._sleep_if_enabled()


def _completions(output: Any) -> list[Completion]:
    comps = []
    for sample in sorted(output.outputs, key=lambda o: o.index):
        ids = [int(t) for t in sample.token_ids]
        logprobs = (
            [float(lp[t].logprob) for lp, t in zip(sample.logprobs, ids, strict=True)] if sample.logprobs else None
        )
        comps.append(Completion(ids, str(sample.text), logprobs, sample.finish_reason == "length"))
    return comps


class VLLMColocateRollout:
    """Generation with vLLM inside the trainer's process, on its GPU.

    ``grpo.rollout:vllm_colocate``."""

    engine_capabilities = frozenset({WEIGHTS_IN_MEMORY, SCORES_TOKENS})
    concurrent_generate = False  # one in-process engine, one call at a time

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.engine = ColocatedEngine(context.config, context.log)
        self._calls = 0

    @staticmethod
    def grpo_validate_config(config: GRPOConfig) -> list[str]:
        if config.trl.vllm_enable_sleep_mode and not cuda_available():
            raise ConfigError(
                "trl.vllm_enable_sleep_mode = true: vLLM offers sleep mode on CUDA GPUs only, and this machine has "
                "none. Remove it: on CPU the engine's memory is ordinary host memory."
            )
        if config.trl.async_prefetch:
            raise ConfigError(
                "trl.async_prefetch overlaps generation with training, but trl.vllm_mode = 'colocate' runs vLLM in "
                "the trainer's process on the same device, so they would only take turns: use vllm_mode = 'server' "
                "(a managed server, still one command) or trl.async_prefetch = false."
            )
        warnings = []
        v = vllm_settings(config)
        if v.devices is not None or v.trainer_devices is not None:
            warnings.append(
                "[vllm] devices / trainer_devices place managed vLLM servers; they have no effect with "
                "trl.vllm_mode = 'colocate', where vLLM runs in the trainer's process on its GPU."
            )
        if v.gpu_memory_utilization > TRAINER_SHARE_MAX:
            warnings.append(
                f"[vllm] gpu_memory_utilization = {v.gpu_memory_utilization} with trl.vllm_mode = 'colocate': vLLM "
                f"takes that much of the GPU the trainer runs on, leaving it {1 - v.gpu_memory_utilization:.0%} for "
                f"the model, gradients, optimizer state and activations; keep it at most {TRAINER_SHARE_MAX} (the "
                "default there is 0.3, TRL's)."
            )
        return warnings

    @hookimpl
    def grpo_inference_engine(self) -> InferenceEngine:
        return self.engine

    @hookimpl
    def grpo_train_start(self) -> None:
        self.engine.start()

    @hookimpl
    def grpo_train_end(self) -> None:
        self.engine.shutdown()

    @hookimpl
    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        # One SamplingParams per prompt: each prompt gets a seed of its own (see prompt_seed).
        params = [
            self.engine.sampling_params(sampling_fields(sampling, num_generations, self._calls, i), sampling)
            for i in range(len(prompts))
        ]
        outputs = self.engine.generate([list(p.prompt_ids) for p in prompts], params)
        self._calls += 1
        return [
            RolloutGroup(prompt, _completions(out), policy_version)
            for prompt, out in zip(prompts, outputs, strict=True)
        ]


class InMemorySync:
    """The trainer's weights copied into the colocated vLLM engine in memory.

    ``grpo.weight_sync:vllm_in_memory``: a LoRA merged in, only what
    training changes, into an engine in the same process."""

    required_capabilities = frozenset({WEIGHTS_IN_MEMORY})

    def __init__(self, context: RunContext) -> None:
        self.context = context

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        if engine is None:
            raise ConfigError(
                "weight sync 'vllm_in_memory' copies weights into a colocated vLLM engine, and the rollout has none: "
                "set trl.use_vllm = true and trl.vllm_mode = 'colocate' (or plugins.rollout = 'vllm_colocate')."
            )
        start = time.perf_counter()
        weights = in_dtype(merged_weights(model, engine.fused_modules()), engine.weight_dtype)
        engine.load_weights(weights)
        seconds = time.perf_counter() - start
        return SyncResult(version, seconds, f"vllm_in_memory: {len(weights)} tensors in {seconds:.2f}s")

"""Checks a config must pass before anything heavy happens.

Schema validation (:mod:`grpo_core.config.loader`) catches typos and wrong
types; this module catches *combinations* the reference warns about and
options whose feature grpo does not have yet. :func:`check_config` returns
warnings (the run can go ahead) and raises :class:`ConfigError` for a config
that cannot run, listing every problem at once with its fix.

Options not implemented yet
---------------------------
:data:`NOT_IMPLEMENTED` lists the reference options grpo refuses instead of
silently ignoring. Remove an entry when its feature lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from grpo_core.config.compat import compat_warnings
from grpo_core.config.schema import GRPOConfig
from grpo_core.errors import ConfigError, NotImplementedYet

if TYPE_CHECKING:
    from grpo_core.plugin_host import PluginHost


@dataclass(frozen=True)
class _Unimplemented:
    key: str
    is_set: Callable[[GRPOConfig], bool]
    detail: str


# Shrink this list as features land (and add a test that the option works).
NOT_IMPLEMENTED: tuple[_Unimplemented, ...] = (
    _Unimplemented("fp8", lambda c: c.fp8, "FP8 training needs GPU FP8 kernels"),
    _Unimplemented("torch_compile", lambda c: c.torch_compile, "the training step is not compiled"),
    _Unimplemented("fsdp", lambda c: bool(c.fsdp), "multi-GPU FSDP training is not built"),
    _Unimplemented("fsdp_config", lambda c: bool(c.fsdp_config), "multi-GPU FSDP training is not built"),
    _Unimplemented("deepspeed", lambda c: c.deepspeed is not None, "DeepSpeed is not integrated"),
    _Unimplemented("trl.use_liger_loss", lambda c: c.trl.use_liger_loss is True, "the Liger fused GRPO loss is not integrated"),
    _Unimplemented(
        "trl.log_completions",
        lambda c: c.trl.log_completions,
        "it logs to Weights & Biases, which grpo does not ship; use trl.num_completions_to_print",
    ),
    _Unimplemented("val_set_size", lambda c: c.val_set_size > 0, "there is no evaluation loop yet; set it to 0.0"),
    _Unimplemented("use_wandb", lambda c: c.use_wandb, "grpo logs to the console and output_dir/metrics.jsonl only"),
)

def implementation_names(cfg: GRPOConfig) -> dict[str, str]:
    """The implementation each extension point will load, by name: the
    trainer's own choice (:func:`grpo_core.training.selection.chosen_implementations`),
    so the checks judge exactly what will run."""
    from grpo_core.training.selection import chosen_implementations

    return chosen_implementations(cfg)


def _source_key(cfg: GRPOConfig, point: str) -> str:
    """The config key that chose ``point``'s implementation, for messages."""
    if getattr(cfg.plugins, point) is not None:
        return f"plugins.{point}"
    return {
        "rollout": "trl.use_vllm",
        "advantage_aggregation": "trl.multi_objective_aggregation",
        "is_correction": "trl.vllm_importance_sampling_mode",
        "weight_sync": "trl.use_vllm / trl.vllm_lora_sync",
        "replay": "plugins.replay",
    }[point]


def _zero_stage(deepspeed: str) -> int | None:
    """ZeRO stage of a DeepSpeed config file, or a guess from its name."""
    path = Path(deepspeed)
    try:
        stage = json.loads(path.read_text(encoding="utf-8")).get("zero_optimization", {}).get("stage")
        return int(stage) if stage is not None else None
    except (OSError, ValueError, AttributeError, TypeError):
        name = path.name.lower().replace("-", "").replace("_", "")
        return 3 if "zero3" in name or "z3" in name else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _generation_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    trl = cfg.trl
    n = int(trl.num_generations or 0)
    if n < 2:
        errors.append(
            f"trl.num_generations = {n}: GRPO compares completions within a group, so it needs at least 2 "
            "per prompt (8 is typical)."
        )
        return
    if trl.generation_batch_size is not None:
        batch, source = trl.generation_batch_size, f"trl.generation_batch_size = {trl.generation_batch_size}"
    else:
        batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
        source = (
            f"micro_batch_size ({cfg.micro_batch_size}) x gradient_accumulation_steps "
            f"({cfg.gradient_accumulation_steps}) = {batch}"
        )
    if batch % n:
        fits = ", ".join(str(d) for d in _divisors(batch)) or "none"
        if trl.generation_batch_size is not None:
            fix = f"trl.generation_batch_size = {max(1, batch // n) * n}"
        else:
            fix = f"gradient_accumulation_steps = {n // _gcd(n, cfg.micro_batch_size)}"
        errors.append(
            f"the generation batch, {source} completions, is not divisible by trl.num_generations = {n}: every "
            f"prompt needs a whole group. Make the batch a multiple of {n} (e.g. {fix}) or set "
            f"trl.num_generations to a divisor of {batch} ({fits})."
        )
    if trl.temperature == 0:
        errors.append(
            f"trl.temperature = 0 (greedy) samples {n} identical completions per prompt, so every advantage is 0 "
            "and nothing is learned: use a temperature > 0 (0.7-1.0)."
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _reward_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    trl = cfg.trl
    funcs = trl.reward_funcs or []
    if not funcs:
        errors.append(
            "trl.reward_funcs is empty: name at least one reward function, a registered name (see `grpo plugins`) "
            "or an import path such as 'rewards.accuracy_reward'."
        )
    if trl.reward_weights is not None and len(trl.reward_weights) != len(funcs):
        errors.append(
            f"trl.reward_weights has {len(trl.reward_weights)} weight(s) but trl.reward_funcs has {len(funcs)} "
            "function(s): give one weight per function, in the same order, or drop reward_weights (all 1.0)."
        )
    if len(set(funcs)) != len(funcs):
        warnings.append("trl.reward_funcs lists the same function twice: its reward counts double.")


def _async_checks(cfg: GRPOConfig, names: dict[str, str], errors: list[str], warnings: list[str]) -> None:
    trl = cfg.trl
    if trl.async_prefetch and names["rollout"] == "transformers":
        errors.append(
            "trl.async_prefetch generates in a background thread, but the transformers rollout (trl.use_vllm = "
            "false) samples from the model being trained and cannot: set trl.use_vllm = true (a vLLM server "
            "generates) or trl.async_prefetch = false."
        )
    if trl.async_prefetch and names["rollout"] == "vllm_colocate":
        errors.append(
            "trl.async_prefetch overlaps generation with training, but trl.vllm_mode = 'colocate' runs vLLM in "
            "the trainer's process on the same device, so they would only take turns: use vllm_mode = 'server' "
            "(a managed server, still one command) or trl.async_prefetch = false."
        )
    if trl.async_prefetch and trl.vllm_importance_sampling_correction is False:
        warnings.append(
            "trl.async_prefetch samples from weights one sync behind; enable "
            "trl.vllm_importance_sampling_correction to correct for it."
        )
    if trl.async_prefetch and cfg.fsdp:
        warnings.append(
            "async_prefetch with FSDP can deadlock (background collectives across ranks); set "
            "trl.async_prefetch = false if training hangs."
        )
    if trl.vllm_lora_sync and cfg.adapter is None:
        errors.append(
            "trl.vllm_lora_sync syncs a LoRA adapter, but no adapter is trained: set adapter = 'lora' or "
            "trl.vllm_lora_sync = false (full weights are synced then)."
        )
    if trl.vllm_lora_sync and not trl.use_vllm:
        warnings.append("trl.vllm_lora_sync has no effect without trl.use_vllm.")
    if trl.vllm_lora_sync and names["weight_sync"] == "vllm_in_memory":
        warnings.append(
            "trl.vllm_lora_sync has no effect with trl.vllm_mode = 'colocate': the engine lives in the trainer's "
            "process and receives merged weights in memory."
        )
    if trl.replay_buffer_size > 0 and not trl.replay_recompute_logps:
        warnings.append(
            "trl.replay_recompute_logps = false: replayed groups keep stale log-probabilities (an importance-"
            "sampling mismatch); keep the default true unless you know why."
        )
    if trl.importance_sampling_level == "sequence" and trl.use_liger_loss:
        warnings.append(
            "trl.importance_sampling_level = 'sequence' is numerically fragile with the Liger loss; use 'token'."
        )
    if trl.mask_truncated_completions and trl.max_completion_length is not None and trl.max_completion_length < 64:
        warnings.append(
            f"trl.mask_truncated_completions with max_completion_length {trl.max_completion_length}: most "
            "completions may be truncated and masked, leaving little to learn from."
        )
    if trl.epsilon_high is not None and trl.epsilon is not None and trl.epsilon_high < trl.epsilon:
        warnings.append(f"trl.epsilon_high ({trl.epsilon_high}) is below trl.epsilon ({trl.epsilon}).")


def _training_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    if not cfg.datasets:
        errors.append("datasets is empty: add at least one [[datasets]] entry with a path.")
    for i, ds in enumerate(cfg.datasets):
        looks_local = ds.path.startswith((".", "/", "~")) or Path(ds.path).suffix in {".json", ".jsonl", ".csv", ".parquet"}
        if looks_local and not Path(ds.path).expanduser().exists():
            warnings.append(f"datasets[{i}].path '{ds.path}' does not exist (relative to {Path.cwd()}).")
    if cfg.bf16 is True and cfg.fp16:
        errors.append("bf16 and fp16 are both true: choose one.")
    kwargs = cfg.gradient_checkpointing_kwargs or {}
    if cfg.deepspeed and kwargs.get("use_reentrant") is False and _zero_stage(cfg.deepspeed) == 3:
        errors.append(
            "DeepSpeed ZeRO-3 with gradient_checkpointing_kwargs.use_reentrant = false fails during recomputation "
            "(CheckpointError): set use_reentrant = true."
        )
    if kwargs and not cfg.gradient_checkpointing:
        warnings.append("gradient_checkpointing_kwargs is set but gradient_checkpointing is false.")


def _unimplemented(cfg: GRPOConfig) -> list[NotImplementedYet]:
    return [NotImplementedYet(item.key, item.detail) for item in NOT_IMPLEMENTED if item.is_set(cfg)]


def _plugin_checks(cfg: GRPOConfig, host: PluginHost, names: dict[str, str], errors: list[str]) -> None:
    """Each chosen implementation is published and allowed (not imported:
    loading happens when the run needs it)."""
    from grpo_core.plugin_host import group_for

    for point, name in names.items():
        published = host.published(group_for(point))
        info = published.get(name)
        if info is None:
            available = ", ".join(sorted(published)) or "none"
            errors.append(
                f"{_source_key(cfg, point)} chooses {point} implementation '{name}', but no installed package "
                f"publishes it under '{group_for(point)}' (available: {available})."
            )
        elif info.error:
            errors.append(f"{point} implementation '{name}' of distribution '{info.distribution}': {info.error}.")


def check_config(cfg: GRPOConfig, host: PluginHost | None = None) -> list[str]:
    """Return warnings for ``cfg``; raise :class:`ConfigError` listing every
    problem that stops it from running.

    With ``host``, also check that each chosen implementation is installed
    and allowed, and ask every registered plugin's ``grpo_validate_config``
    (register always-on plugins first to include theirs).
    """
    errors: list[str] = []
    warnings: list[str] = []
    names = implementation_names(cfg)
    _reward_checks(cfg, errors, warnings)
    _generation_checks(cfg, errors, warnings)
    _async_checks(cfg, names, errors, warnings)
    _training_checks(cfg, errors, warnings)
    if host is not None:
        _plugin_checks(cfg, host, names, errors)
    warnings += compat_warnings(cfg)
    unimplemented = _unimplemented(cfg)
    if unimplemented and not errors and len(unimplemented) == 1:
        raise unimplemented[0]
    errors += [str(e) for e in unimplemented]
    if errors:
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{len(errors)} problems in the config:\n" + "\n".join(f"  - {e}" for e in errors))
    if host is not None:
        warnings += _plugin_warnings(host.hook.grpo_validate_config(config=cfg))
    return warnings


def _plugin_warnings(results: list[Any]) -> list[str]:
    out: list[str] = []
    for result in results or []:
        if result is None:
            continue
        if isinstance(result, str):
            out.append(result)
        else:
            out.extend(str(item) for item in result)
    return out

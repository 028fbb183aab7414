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

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.config.batch_shape import (
    generation_batch_size,
    global_step_batch,
    steps_per_generation,
)
from grpo_core.config.compat import compat_warnings
from grpo_core.config.environment_names import route_table
from grpo_core.config.eval_schedule import eval_enabled
from grpo_core.config.implementations import chosen_implementations, environment_implementations, source_key
from grpo_core.config.loss_rules import loss_level_warnings, vespo_correction_problem
from grpo_core.config.reward_weights import reward_weights
from grpo_core.config.schema import DEFAULT_SAVE_STEPS, GRPOConfig
from grpo_core.contract.errors import ConfigError, NotImplementedYet, PluginError
from grpo_core.contract.extension_points import BY_NAME, EXTENSION_POINTS, REWARD_GROUP, declared
from grpo_core.contract.types import (
    CONTINUES_FROM_IDS,
    CONTROL_ENDPOINTS,
    PAUSES_GENERATION,
    SAMPLES_TRAINER_MODEL,
    SCORES_TOKENS,
    WEIGHTS_IN_MEMORY,
)
from grpo_core.host.plugin_host import (
    PluginHost,
    own_checks,
    settings_key,
    split_qualified,
    table_ref,
    validate_settings,
)
from grpo_core.host.traits import ChosenTraits
from grpo_core.modeling.compile import CompileOptions, compile_problem
from grpo_core.modeling.fp8 import fp8_problem
from grpo_core.modeling.precision import cpu_flags
from grpo_core.modeling.quantization import bitsandbytes_problem, cpu_kernel_note
from grpo_core.observability.alerts import ALERT_NAMES
from grpo_core.observability.tracking import check_report_to
from grpo_core.runtime.gpus import gpu_count_source, visible_gpus
from grpo_core.runtime.processes import world_size
from grpo_core.validation.dataset_sources import dataset_source_problems
from grpo_core.validation.output_dir import output_dir_checks
from grpo_core.validation.references import code_problems, path_problems, reward_name_problems


@dataclass(frozen=True)
class _Unimplemented:
    key: str
    is_set: Callable[[GRPOConfig], bool]
    detail: str


# Shrink this list as features land (and add a test that the option works).
NOT_IMPLEMENTED: tuple[_Unimplemented, ...] = (
    _Unimplemented(
        "trl.sync_ref_model",
        lambda c: bool(c.trl.sync_ref_model) and c.adapter == "lora" and float(c.trl.beta or 0) > 0,
        "with adapter = 'lora' the KL reference is the base model with the adapter disabled, which has no weights of "
        "its own to mix the policy into; set trl.sync_ref_model = false, or train full weights (no adapter) to sync "
        "the reference",
    ),
)


def implementation_names(cfg: GRPOConfig) -> dict[str, str]:
    """The implementation each extension point will load, by name: the
    trainer's own choice, so the checks judge exactly what will run."""
    return chosen_implementations(cfg)


ChosenClasses = dict[str, tuple[Any, Any]]
"""Each extension point's chosen implementation, imported once: ``(entry
point info, class)`` by point name."""


def import_chosen(cfg: GRPOConfig, host: PluginHost, names: dict[str, str]) -> tuple[ChosenClasses, list[str]]:
    """Import every chosen implementation (never build it) and check it
    against the contract; return the classes that passed and, for the
    others, the error that names the key and the fix."""
    classes: ChosenClasses = {}
    problems: list[str] = []
    for point in EXTENSION_POINTS:
        try:
            classes[point.name] = host.implementation_class(point.name, names[point.name], key=source_key(cfg, point))
        except (PluginError, ConfigError) as exc:
            problems.append(str(exc))
    point = BY_NAME["environment"]
    for extra in environment_implementations(cfg)[1:]:  # several environments: each checked like the first
        try:
            classes[f"{EXTRA_ENVIRONMENT}{extra}"] = host.implementation_class(point.name, extra, key=point.config_key)
        except (PluginError, ConfigError) as exc:
            problems.append(str(exc))
    return classes, problems


EXTRA_ENVIRONMENT = "environment:"
"""How :data:`ChosenClasses` keys the environments after the first of a list."""


def environment_classes(classes: ChosenClasses) -> list[tuple[str, Any]]:
    """Every chosen environment implementation: (its name, its class), first the first."""
    return [
        (info.name, cls)
        for key, (info, cls) in classes.items()
        if key == "environment" or key.startswith(EXTRA_ENVIRONMENT)
    ]


def chosen_traits(names: dict[str, str], classes: ChosenClasses) -> ChosenTraits:
    """What the imported implementations declare, for the rules below."""

    def cls_of(point: str) -> Any:
        return classes[point][1] if point in classes else None

    rollout, sync, loss = cls_of("rollout"), cls_of("weight_sync"), cls_of("policy_loss")
    offered = (
        frozenset(declared(rollout, BY_NAME["rollout"], "engine_capabilities")) if rollout is not None else frozenset()
    )
    return ChosenTraits(
        names=names,
        engine_in_process=WEIGHTS_IN_MEMORY in offered,
        sync_sends=str(declared(sync, BY_NAME["weight_sync"], "sends")) if sync is not None else None,
        loss_uses_hidden_states=loss is not None and bool(declared(loss, BY_NAME["policy_loss"], "uses_hidden_states")),
    )


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
    step = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    if trl.generation_batch_size is not None and trl.steps_per_generation is not None:
        errors.append(
            f"trl.generation_batch_size = {trl.generation_batch_size} and trl.steps_per_generation = "
            f"{trl.steps_per_generation} are both set: they say the same thing (generation_batch_size = "
            "micro_batch_size x steps_per_generation), so set only one, as in TRL."
        )
        return
    if trl.steps_per_generation is not None:
        batch = cfg.micro_batch_size * trl.steps_per_generation
        source = (
            f"micro_batch_size ({cfg.micro_batch_size}) x trl.steps_per_generation ({trl.steps_per_generation}) = "
            f"{batch}"
        )
    elif trl.generation_batch_size is not None:
        batch, source = trl.generation_batch_size, f"trl.generation_batch_size = {trl.generation_batch_size}"
    else:
        batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
        source = (
            f"micro_batch_size ({cfg.micro_batch_size}) x gradient_accumulation_steps "
            f"({cfg.gradient_accumulation_steps}) = {batch}"
        )
    if batch % step:
        # TRL's meaning: one generation feeds batch / step optimizer steps. A
        # generation smaller than a step, or one that ends inside a step, is
        # TRL-legal but not built here: refused by name, never reinterpreted.
        key = "trl.steps_per_generation" if trl.steps_per_generation is not None else "trl.generation_batch_size"
        multiple = max(1, batch // step) * step
        value = multiple // cfg.micro_batch_size if key == "trl.steps_per_generation" else multiple
        errors.append(
            f"the generation batch, {source} completions, is not a multiple of micro_batch_size x "
            f"gradient_accumulation_steps = {step}: each generation must feed a whole number of optimizer steps "
            f"(a generation smaller than a step, or one ending inside a step, is not supported). Set {key} = {value} "
            f"({multiple // step} step(s) per generation), or change gradient_accumulation_steps."
        )
    if batch % n:
        fits = ", ".join(str(d) for d in _divisors(batch)) or "none"
        if trl.steps_per_generation is not None:
            k = n // _gcd(n, cfg.micro_batch_size)  # micro_batch_size x steps_per_generation divisible by n
            fix = f"trl.steps_per_generation = {-(-trl.steps_per_generation // k) * k}"
        elif trl.generation_batch_size is not None:
            fix = f"trl.generation_batch_size = {max(1, batch // n) * n}"
        else:
            fix = f"gradient_accumulation_steps = {n // _gcd(n, cfg.micro_batch_size)}"
        unset = [k for k in ("micro_batch_size", "gradient_accumulation_steps") if k not in cfg.model_fields_set]
        defaults = (
            f" ({' and '.join(f'{k} = {getattr(cfg, k)}' for k in unset)}: grpo's default"
            f"{'s' if len(unset) > 1 else ''}, the reference guide's; TRL's per_device_train_batch_size defaults to "
            "8, so a config written for TRL sets micro_batch_size = 8 to keep its batch)"
            if "micro_batch_size" in unset
            else ""
        )
        errors.append(
            f"the generation batch, {source} completions{defaults}, is not divisible by trl.num_generations = {n}: "
            f"every prompt needs a whole group. Make the batch a multiple of {n} (e.g. {fix}) or set "
            f"trl.num_generations to a divisor of {batch} ({fits})."
        )
    if trl.temperature == 0:
        errors.append(
            f"trl.temperature = 0 (greedy) samples {n} identical completions per prompt, so every advantage is 0 "
            "and nothing is learned: use a temperature > 0 (0.7-1.0)."
        )


def _process_checks(cfg: GRPOConfig, names: dict[str, str], world: int, errors: list[str]) -> None:
    """With N training processes each rank trains on its own share of every
    generation batch, made of whole groups: the global batch must split into
    N equal shares of whole groups and each share into whole optimizer steps."""
    if world <= 1:
        return

    n = int(cfg.trl.num_generations or 0)
    batch, step = generation_batch_size(cfg, world), global_step_batch(cfg, world)
    if n < 2 or not batch:
        return
    if batch % step:
        errors.append(
            f"with {world} processes one optimizer step trains on micro_batch_size x gradient_accumulation_steps x "
            f"{world} = {step} completions, and the generation batch ({batch}, trl.generation_batch_size is global "
            f"as in TRL) is not a multiple of it: set trl.generation_batch_size = {max(1, batch // step) * step}."
        )
    elif (batch // world) % n:
        errors.append(
            f"with {world} processes each process trains on {batch // world} of the {batch} completions per "
            f"generation, which is not a whole number of groups of trl.num_generations = {n} (groups stay whole "
            f"on a process: advantages are per group). Make micro_batch_size x gradient_accumulation_steps a "
            f"multiple of {n}, or set trl.generation_batch_size to a multiple of {n * world}."
        )


def _gpu_count_checks(world: int, errors: list[str], warnings: list[str]) -> None:
    """With GPUs, each training process of a machine trains on the GPU of its
    local rank (accelerate's placement, which ``grpo run --num-processes``
    uses): more processes there than visible GPUs cannot start. Inside a
    launched run the machine's share is known (``LOCAL_WORLD_SIZE``): an
    error. Before one, the processes may be spread over several machines: a
    warning. Without GPUs the processes share the CPU: nothing to count."""
    gpus = visible_gpus()
    local_text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    local = int(local_text) if local_text.isdigit() and int(local_text) > 0 else None
    if gpus == 0 or (local or world) <= gpus:
        return
    plural = "s" if gpus != 1 else ""
    if local is not None:
        errors.append(
            f"{local} training processes on this machine (LOCAL_WORLD_SIZE) each train on the GPU of their local "
            f"rank (GPUs 0-{local - 1}), but the machine shows {gpus} GPU{plural} ({gpu_count_source()}): start at "
            f"most {gpus} on it, or make more GPUs visible."
        )
    else:
        warnings.append(
            f"{world} training processes, each on the GPU of its local rank, but the machine shows {gpus} "
            f"GPU{plural} ({gpu_count_source()}): one machine cannot start them all (`grpo run --num-processes "
            f"{world}` starts them here, GPUs 0-{world - 1}); across machines each starts its share (at most {gpus}), "
            "and each process checks its machine when it starts."
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _reward_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    trl = cfg.trl
    funcs = trl.reward_funcs or []
    try:
        reward_weights(cfg)
    except ConfigError as exc:
        errors.append(str(exc))
    if len(set(funcs)) != len(funcs):
        warnings.append("trl.reward_funcs lists the same function twice: its reward counts double.")


def _loss_checks(cfg: GRPOConfig, names: dict[str, str], errors: list[str], warnings: list[str]) -> None:
    """TRL 1.16's rules on the loss type with the importance-sampling options."""
    loss_type = str(cfg.trl.loss_type or "dapo")
    warnings += loss_level_warnings(loss_type, str(cfg.trl.importance_sampling_level or "token"))
    problem = vespo_correction_problem(loss_type, names["is_correction"])
    if problem is not None:
        errors.append(problem)


def _async_checks(cfg: GRPOConfig, traits: ChosenTraits, errors: list[str], warnings: list[str]) -> None:
    trl = cfg.trl
    if trl.async_prefetch and trl.vllm_importance_sampling_correction is False:
        warnings.append(
            "trl.async_prefetch samples from weights one sync behind; enable "
            "trl.vllm_importance_sampling_correction to correct for it."
        )
    if trl.in_flight_weight_updates:
        errors += in_flight_problems(cfg)
        if cfg.verify_weight_sync in ("every", "every_probe"):
            warnings.append(
                f"verify_weight_sync = '{cfg.verify_weight_sync}' with trl.in_flight_weight_updates: each sync is "
                "checked with the probe (async batches cannot stand in for it), which waits until no generation "
                "request is in flight, so every sync waits for the batch being generated (11.8-13.8 s a step in "
                "benchmarks/RESULTS.md); set verify_weight_sync = 'first' to check the first sync only."
            )
    if trl.vllm_lora_sync and cfg.adapter is None:
        errors.append(
            "trl.vllm_lora_sync syncs a LoRA adapter, but no adapter is trained: set adapter = 'lora' or "
            "trl.vllm_lora_sync = false (full weights are synced then)."
        )
    if trl.vllm_lora_sync and not trl.use_vllm:
        warnings.append("trl.vllm_lora_sync has no effect without trl.use_vllm.")
    if trl.vllm_lora_sync and trl.use_vllm and cfg.adapter is not None and traits.sync_sends == "merged_weights":
        where = " (the engine lives in the trainer's process)" if traits.engine_in_process else ""
        warnings.append(
            f"trl.vllm_lora_sync has no effect: weight sync '{traits.names['weight_sync']}' sends merged weights, not "
            f"the adapter{where}."
        )
    if trl.replay_buffer_size > 0 and not trl.replay_recompute_logps:
        warnings.append(
            "trl.replay_recompute_logps = false: replayed groups keep stale log-probabilities (an importance-"
            "sampling mismatch); keep the default true unless you know why."
        )
    if trl.mask_truncated_completions and trl.max_completion_length is not None and trl.max_completion_length < 64:
        warnings.append(
            f"trl.mask_truncated_completions with max_completion_length {trl.max_completion_length}: most "
            "completions may be truncated and masked, leaving little to learn from."
        )
    if trl.epsilon_high is not None and trl.epsilon is not None and trl.epsilon_high < trl.epsilon:
        warnings.append(f"trl.epsilon_high ({trl.epsilon_high}) is below trl.epsilon ({trl.epsilon}).")


OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")


def continuation_problems(cfg: GRPOConfig, key: str, cut: str) -> list[str]:
    """What a generation continued as a new request (prompt + the ids so far)
    cannot carry: vLLM applies these to each request's own output, so the
    continuation would not be the same sampling (``cut`` says how it is cut)."""
    trl = cfg.trl
    problems = []
    if trl.vllm_guided_decoding_regex:
        problems.append(
            f"{key} cannot run with trl.vllm_guided_decoding_regex: {cut}, and vLLM would start the regular "
            "expression again there. Remove one of the two."
        )
    extra = trl.generation_kwargs or {}
    penalties = [k for k in OUTPUT_PENALTIES if extra.get(k)]
    if penalties:
        problems.append(
            f"{key} cannot run with trl.generation_kwargs {penalties}: vLLM counts them over the output only, and "
            f"{cut} with its output so far in the prompt. Remove them, or use repetition_penalty (it counts prompt "
            "and output alike)."
        )
    if extra.get("stop"):
        problems.append(
            f"{key} cannot run with trl.generation_kwargs 'stop' (stop strings): vLLM looks for them in each "
            f"request's output, and {cut}, so one that straddles the cut would be missed. Use stop token ids "
            "(trl.generation_kwargs stop_token_ids) instead."
        )
    return problems


def in_flight_problems(cfg: GRPOConfig) -> list[str]:
    """What ``trl.in_flight_weight_updates`` cannot run with: a generation
    cut by a pause goes on as a new request whose prompt ends with the
    tokens sampled so far, which is only the same sampling when nothing
    depends on where the output began."""
    trl = cfg.trl
    problems = []
    if not trl.async_prefetch:
        problems.append(
            "trl.in_flight_weight_updates needs trl.async_prefetch = true: without it nothing is generating while "
            "the weights are synced, so there is nothing to update in flight."
        )
    problems += continuation_problems(
        cfg, "trl.in_flight_weight_updates", "a generation cut by a weight update goes on as a new request"
    )
    return problems


def partial_rollout_problems(cfg: GRPOConfig, world: int, multi_call: bool) -> list[str]:
    """What ``trl.partial_rollout_token_budget`` cannot run with: a sample
    goes on in a later batch as a new request whose prompt ends with its
    tokens so far, and a batch is the groups that finished in it
    (:mod:`grpo_core.generation.partial_rollouts`)."""
    trl = cfg.trl
    key = "trl.partial_rollout_token_budget"
    problems = []
    if multi_call:
        problems.append(
            f"{key} is not implemented for multi-turn episodes or trl.rollout_func: their completions are put "
            f"together from several generation calls, which partial rollouts cannot cut and resume. Remove {key}."
        )
    if trl.streaming_partial_batch:
        problems.append(
            f"{key} cannot run with trl.streaming_partial_batch: partial rollouts already score each group in the "
            "batch where it finishes. Set trl.streaming_partial_batch = false."
        )
    if world > 1:
        problems.append(
            f"{key} is not implemented for {world} training processes: a batch is the groups that finished in it, "
            "which varies from batch to batch and cannot always be shared out evenly. Train with one process, or "
            f"remove {key}."
        )
    problems += continuation_problems(cfg, key, "a sample continued in a later batch is a new request")
    return problems


def partial_rollout_warnings(cfg: GRPOConfig) -> list[str]:
    budget, limit = cfg.trl.partial_rollout_token_budget, cfg.trl.max_completion_length
    if budget is not None and limit is not None and budget >= limit:
        return [
            f"trl.partial_rollout_token_budget ({budget}) is not below trl.max_completion_length ({limit}): every "
            "sample finishes in its own batch, so nothing is carried over."
        ]
    return []


def _no_effect_checks(cfg: GRPOConfig, traits: ChosenTraits, warnings: list[str]) -> None:
    """Options that are valid but do nothing in this combination: named, so
    none is ignored silently."""
    trl = cfg.trl
    if trl.vllm_enable_sleep_mode and not traits.engine_in_process:
        warnings.append(
            f"trl.vllm_enable_sleep_mode has no effect with rollout '{traits.names['rollout']}': only an engine in the "
            "trainer's process (trl.vllm_mode = 'colocate') sleeps between generations; a vLLM server keeps its memory."
        )
    if trl.sync_ref_model and not float(trl.beta or 0) > 0:
        warnings.append(
            "trl.sync_ref_model has no effect with trl.beta = 0: there is no reference model to update (set beta > 0 "
            "for a KL penalty)."
        )
    if trl.vllm_mode is not None and not trl.use_vllm:
        warnings.append(f"trl.vllm_mode = '{trl.vllm_mode}' has no effect without trl.use_vllm = true.")


def _written(table: Any, *keys: str) -> list[str]:
    """The ``keys`` the user wrote in ``table`` (the loader's filled-in defaults are not among them)."""
    return [key for key in keys if key in table.model_fields_set]


def _ignored_option_checks(cfg: GRPOConfig, world: int, warnings: list[str]) -> None:
    """Options the user set that this combination never reads: each named
    where it was written (a default grpo filled in is never warned about)."""
    trl = cfg.trl
    if _written(trl, "prefetch_depth") and not trl.async_prefetch:
        warnings.append(
            f"trl.prefetch_depth = {trl.prefetch_depth} has no effect without trl.async_prefetch = true: "
            "a synchronous run generates each batch when it is needed, nothing ahead."
        )
    if _written(trl, "streaming_min_groups") and not trl.streaming_partial_batch:
        warnings.append(
            f"trl.streaming_min_groups = {trl.streaming_min_groups} has no effect without "
            "trl.streaming_partial_batch = true: the batch is scored in one piece."
        )
    is_keys = _written(trl, "vllm_importance_sampling_mode", "vllm_importance_sampling_cap")
    if is_keys and cfg.plugins.is_correction is None and not trl.vllm_importance_sampling_correction:
        warnings.append(
            f"{' and '.join('trl.' + k for k in is_keys)} {'have' if len(is_keys) > 1 else 'has'} no effect: the "
            f"importance-sampling correction is off (trl.vllm_importance_sampling_correction = "
            f"{str(trl.vllm_importance_sampling_correction).lower()}"
            f"{'' if trl.use_vllm else ', its default without trl.use_vllm'}). Set "
            "trl.vllm_importance_sampling_correction = true to apply it, or drop the key."
        )
    if (
        cfg.plugins.is_correction is not None
        and "vllm_importance_sampling_correction" in trl.model_fields_set
        and not trl.vllm_importance_sampling_correction
    ):
        warnings.append(
            f"trl.vllm_importance_sampling_correction = false has no effect: plugins.is_correction = "
            f"'{cfg.plugins.is_correction}' chooses the correction, and it runs."
        )
    if _written(trl, "use_bias_correction_kl") and not float(trl.beta or 0) > 0:
        warnings.append("trl.use_bias_correction_kl has no effect with trl.beta = 0: there is no KL term to correct.")
    ref_keys = _written(trl, "ref_model_mixup_alpha", "ref_model_sync_steps")
    if ref_keys and not trl.sync_ref_model:
        warnings.append(
            f"{' and '.join('trl.' + k for k in ref_keys)} {'have' if len(ref_keys) > 1 else 'has'} no "
            "effect without trl.sync_ref_model = true: the reference model is never updated."
        )
    if not trl.use_vllm and cfg.plugins.rollout is None:
        server_keys = _written(
            trl,
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_server_base_url",
            "vllm_server_base_urls",
        )
        if server_keys:
            warnings.append(
                f"{', '.join('trl.' + k for k in server_keys)} {'have' if len(server_keys) > 1 else 'has'} "
                "no effect with trl.use_vllm = false: no vLLM server is used (set trl.use_vllm = true)."
            )
        if _written(trl, "vllm_sync_interval") and cfg.plugins.weight_sync is None:
            warnings.append(
                f"trl.vllm_sync_interval = {trl.vllm_sync_interval} has no effect with trl.use_vllm = false: the "
                "rollout samples the trainer's own model, which is always current, so there are no weights to sync."
            )
    if _written(trl, "skip_zero_advantage_batches") and trl.skip_zero_advantage_batches and float(trl.beta or 0) > 0:
        warnings.append(
            f"trl.skip_zero_advantage_batches has no effect with trl.beta = {trl.beta}: a micro-batch whose advantages "
            "are all 0 still has a KL gradient, so none is skipped."
        )
    _accumulation_note(cfg, world, warnings)


def _accumulation_note(cfg: GRPOConfig, world: int, warnings: list[str]) -> None:
    """``generation_batch_size`` with accumulation: both count (TRL's meaning),
    and a user who set both may expect one generation per optimizer step."""
    trl = cfg.trl
    if trl.generation_batch_size is None or cfg.gradient_accumulation_steps == 1:
        return

    step, steps = global_step_batch(cfg, world), steps_per_generation(cfg, world)
    if steps <= 1 or trl.generation_batch_size % step:  # one step per generation; a misfit is an error already
        return
    warnings.append(
        f"trl.generation_batch_size = {trl.generation_batch_size} with gradient_accumulation_steps = "
        f"{cfg.gradient_accumulation_steps}: each generation feeds {steps} optimizer steps of {step} completions "
        f"(micro_batch_size {cfg.micro_batch_size} x {cfg.gradient_accumulation_steps} accumulated micro-batches"
        f"{f' x {world} processes' if world > 1 else ''}), as in TRL; steps after the first train on completions "
        "sampled before the earlier updates. For one generation per step set trl.generation_batch_size = "
        f"{step}."
    )


def _training_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    if not cfg.datasets:
        errors.append("datasets is empty: add at least one [[datasets]] entry with a path.")
    periodic = bool(cfg.save_steps) and cfg.save_steps < cfg.max_steps
    if not periodic and cfg.num_epochs is None and cfg.max_steps > DEFAULT_SAVE_STEPS:
        why = "save_steps = 0" if not cfg.save_steps else f"save_steps = {cfg.save_steps} >= max_steps"
        warnings.append(
            f"{why}: no checkpoint before step {cfg.max_steps} (only at the end, and on Ctrl-C/SIGTERM), so a crash "
            f"loses every step: set save_steps (e.g. {DEFAULT_SAVE_STEPS}, the default) to resume from one."
        )
    if cfg.bf16 is True and cfg.fp16:
        errors.append("bf16 and fp16 are both true: choose one.")
    if cfg.gradient_checkpointing_kwargs and not cfg.gradient_checkpointing:
        warnings.append("gradient_checkpointing_kwargs is set but gradient_checkpointing is false.")


ATTN_IMPLEMENTATIONS = {
    "eager",
    "sdpa",
    "sdpa_float32",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
    "paged_attention",
}
"""transformers' names, and grpo's ``sdpa_float32`` (grpo_core/modeling/attention.py)."""


def _model_checks(cfg: GRPOConfig, traits: ChosenTraits, errors: list[str], warnings: list[str]) -> None:
    """Model-loading keys Axolotl users bring: attention, k-bit loading, epochs, packing."""
    attn = cfg.attn_implementation
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS and "/" not in attn:
        errors.append(
            f"attn_implementation = '{attn}' is not an attention implementation transformers knows: use one of "
            f"{', '.join(sorted(ATTN_IMPLEMENTATIONS))} (or a hub kernel 'org/repo')."
        )
    if attn is not None and (cfg.flash_attention or cfg.sdp_attention is not None):
        errors.append(
            "attn_implementation and flash_attention / sdp_attention are both set: keep attn_implementation only."
        )
    if cfg.sample_packing:
        errors.append(
            "sample_packing = true is not supported: a GRPO batch is completions generated during the run, padded per "
            "micro-batch; packing them is not built. Set sample_packing = false or remove it."
        )
    if cfg.num_epochs is not None and "max_steps" in cfg.model_fields_set:
        warnings.append(
            f"max_steps = {cfg.max_steps} takes precedence over num_epochs = {cfg.num_epochs:g} (as in Axolotl)."
        )
    bits = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit" if cfg.load_in_8bit else None
    if cfg.load_in_4bit and cfg.load_in_8bit:
        errors.append("load_in_4bit and load_in_8bit are both true: choose one.")
    if bits is None:
        if cfg.bnb_config_kwargs:
            warnings.append("bnb_config_kwargs has no effect without load_in_4bit or load_in_8bit.")
        return
    if cfg.adapter is None:
        errors.append(
            f"{bits} quantises the frozen base weights, so it needs a LoRA adapter to train: set adapter = 'lora'."
        )
    if traits.sync_sends == "merged_weights":
        errors.append(
            f"{bits}: weight sync '{traits.names['weight_sync']}' sends merged full weights, which a quantised base "
            "cannot give: set trl.vllm_lora_sync = true (vLLM serves the base model with the adapter loaded)."
        )
    problem = bitsandbytes_problem()
    if problem is not None:
        errors.append(f"{bits} cannot run here: {problem}")
    note = cpu_kernel_note(cfg.load_in_4bit, torch.cuda.is_available(), cpu_flags())
    if note is not None:
        warnings.append(note)


def _speed_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    """torch_compile, fp8, the Liger loss: each refused where it cannot run, naming what it needs."""
    problem = compile_problem(CompileOptions.of(cfg))
    if problem is not None:
        errors.append(problem)
    if cfg.fp8:
        problem = fp8_problem()
        if problem is not None:
            errors.append(problem)
    if not cfg.torch_compile and (cfg.torch_compile_backend or cfg.torch_compile_mode):
        warnings.append("torch_compile_backend / torch_compile_mode have no effect without torch_compile = true.")


def _observability_checks(cfg: GRPOConfig, host: PluginHost | None, errors: list[str], warnings: list[str]) -> None:
    """Evaluation data, alert names and trackers (see grpo_core.generation.evaluation / alerts / tracking)."""
    try:
        eval_enabled(cfg)
    except ConfigError as exc:
        errors.append(str(exc))
    if cfg.test_datasets and cfg.val_set_size > 0:
        warnings.append(
            "test_datasets and val_set_size are both set: evaluation uses test_datasets and val_set_size "
            "splits nothing off."
        )
    if cfg.val_set_size >= 1 and cfg.val_set_size != int(cfg.val_set_size):
        errors.append(
            f"val_set_size = {cfg.val_set_size}: a count must be a whole number (or give a fraction below 1)."
        )
    unknown = sorted(set(cfg.alerts.silence) - set(ALERT_NAMES))
    if unknown:
        errors.append(f"alerts.silence names unknown alert(s) {unknown}; known: {', '.join(ALERT_NAMES)}.")
    if host is not None:
        errors.extend(check_report_to(cfg, host))


def _unimplemented(cfg: GRPOConfig) -> list[NotImplementedYet]:
    return [NotImplementedYet(item.key, item.detail) for item in NOT_IMPLEMENTED if item.is_set(cfg)]


def engine_capability_problems(cfg: GRPOConfig, classes: ChosenClasses) -> list[str]:
    """What the chosen rollout's engine cannot do for the chosen weight sync
    and options: each capability is a name the rollout class declares
    (``engine_capabilities``), read once here."""
    problems: list[str] = []
    offered: set[str] = set()
    rollout_ref = ""
    if "rollout" in classes:
        rollout, rollout_cls = classes["rollout"]
        offered = declared(rollout_cls, BY_NAME["rollout"], "engine_capabilities")
        rollout_ref = f"rollout '{rollout.name}' ({source_key(cfg, BY_NAME['rollout'])})"
    if "weight_sync" in classes:
        sync, sync_cls = classes["weight_sync"]
        required = declared(sync_cls, BY_NAME["weight_sync"], "required_capabilities")
        sync_ref = f"weight sync '{sync.name}' ({source_key(cfg, BY_NAME['weight_sync'])})"
        missing = required - offered
        if "rollout" in classes and missing:
            problems.append(
                f"{sync_ref} needs {sorted(missing)} from the rollout's inference engine, but {rollout_ref} offers "
                f"{sorted(offered) or 'none'}: choose a weight sync made for that rollout (see `grpo plugins`), or "
                "remove plugins.weight_sync to get the default one."
            )
        if cfg.trl.in_flight_weight_updates and CONTROL_ENDPOINTS in required:
            problems.append(
                f"trl.in_flight_weight_updates pauses the engine around the weight sync's load calls, but {sync_ref} "
                "drives the servers itself through their control endpoints, so no pause would bracket its update: "
                "choose a sync that loads through the engine (full_filesystem, lora_filesystem, full_http, "
                "lora_http), or set trl.in_flight_weight_updates = false."
            )
    if "rollout" not in classes:
        return problems
    if cfg.trl.in_flight_weight_updates and PAUSES_GENERATION not in offered:
        problems.append(
            f"trl.in_flight_weight_updates pauses the inference engine mid-generation to load new weights, but "
            f"{rollout_ref} declares no '{PAUSES_GENERATION}' capability. Only the vLLM server rollout has one: vLLM "
            "in the trainer's process (vllm_mode = 'colocate') and the transformers rollout generate in the "
            "trainer's own process and refuse trl.async_prefetch, so nothing is generating while their weights "
            "change and every batch already has one version. Set trl.in_flight_weight_updates = false, or use a "
            "vLLM server (trl.use_vllm = true, trl.vllm_mode = 'server'; managed, it is still one command)."
        )
    if cfg.trl.partial_rollout_token_budget and CONTINUES_FROM_IDS not in offered:
        problems.append(
            f"trl.partial_rollout_token_budget continues unfinished samples in a later batch from their exact ids, "
            f"but {rollout_ref} declares no '{CONTINUES_FROM_IDS}' capability (only the vLLM server rollout, "
            "managed or external, does; vLLM in the trainer's process and the transformers rollout are not "
            "supported yet): remove trl.partial_rollout_token_budget, or use a vLLM server (trl.use_vllm = true, "
            "trl.vllm_mode = 'server')."
        )
    if (
        "verify_weight_sync" in cfg.model_fields_set
        and cfg.verify_weight_sync != "never"
        and not offered & {SCORES_TOKENS, SAMPLES_TRAINER_MODEL}
    ):
        problems.append(
            f"verify_weight_sync = '{cfg.verify_weight_sync}' checks each weight sync by having the engine score "
            f"tokens, but {rollout_ref} declares no '{SCORES_TOKENS}' capability: remove verify_weight_sync (then "
            "unverified syncs are only logged) or set it to 'never'."
        )
    return problems


def _plugin_checks(
    cfg: GRPOConfig,
    host: PluginHost,
    classes: ChosenClasses,
    num_processes: int,
    errors: list[str],
    warnings: list[str],
) -> None:
    """Check each imported implementation against its settings, the other
    choices and its own rules, so that "OK" means ``grpo run`` gets past
    wiring (:func:`import_chosen` reported the ones that did not import)."""
    tables = cfg.plugins.settings_tables()
    used: set[str] = set()  # the [plugins.<key>] tables some chosen implementation reads
    for key in [p.name for p in EXTENSION_POINTS] + [k for k in classes if k.startswith(EXTRA_ENVIRONMENT)]:
        if key not in classes:
            continue
        info, cls = classes[key]
        table = settings_key(tables, info) or info.name
        used.add(table)
        try:
            validate_settings(cls, table, cfg.plugins.settings_table(table))
            warnings += own_checks(cls, cfg, num_processes)
        except (PluginError, ConfigError) as exc:
            errors.append(str(exc))
    errors += engine_capability_problems(cfg, classes)
    names_used = {info.name for info, _ in classes.values()}
    for spec in cfg.trl.reward_funcs or []:
        if split_qualified(spec)[1] in host.published(REWARD_GROUP):
            try:
                info, func = host.import_entry_point(REWARD_GROUP, spec, "trl.reward_funcs")
                table = settings_key(tables, info) or info.name
                used.add(table)
                validate_settings(func, table, cfg.plugins.settings_table(table))
                names_used.add(info.name)
            except (PluginError, ConfigError) as exc:
                errors.append(str(exc))
    published = {n for point in EXTENSION_POINTS for n in host.published(point.group)} | set(
        host.published(REWARD_GROUP)
    )
    chosen = {split_qualified(n)[1] for n in implementation_names(cfg).values()} | {
        split_qualified(spec)[1] for spec in cfg.trl.reward_funcs or []
    }  # a chosen name that is not installed is reported where it is chosen
    for name in sorted(set(tables) - used):
        if split_qualified(name)[1] not in published | chosen:
            close = difflib.get_close_matches(split_qualified(name)[1], sorted(published), n=1, cutoff=0.6)
            errors.append(
                f"[{table_ref(name)}] configures '{name}', which no installed package publishes: "
                + (f"did you mean [{table_ref(close[0])}]? " if close else "")
                + "a [plugins.<name>] table holds the settings of the implementation or reward function of that "
                "name (`grpo plugins` lists them)."
            )
            continue
        warnings.append(
            f"[{table_ref(name)}] configures '{name}', which this run does not use (implementations: "
            f"{', '.join(sorted(names_used))}): it has no effect."
        )


ENVIRONMENT_REWARD = "environment"
"""The reward function that returns an episode's environment reward."""


def environment_is_episodic(cfg: GRPOConfig, host: PluginHost) -> bool:
    """Whether the config's environments run multi-turn episodes (a class
    declares ``episodic``; imported, not built)."""
    return any(_episodic(cls) for _, cls in chosen_environment_classes(cfg, host))


def chosen_environment_classes(cfg: GRPOConfig, host: PluginHost) -> list[tuple[str, Any]]:
    """Every chosen environment implementation as (name, class), imported;
    one that does not import is left out (the checks report it)."""
    point = BY_NAME["environment"]
    found = []
    for i, name in enumerate(environment_implementations(cfg)):
        try:
            info, cls = host.implementation_class(
                point.name, name, key=source_key(cfg, point) if i == 0 else point.config_key
            )
        except (PluginError, ConfigError):
            continue
        found.append((info.name, cls))
    return found


def _episodic(environment_cls: Any | None) -> bool:
    return environment_cls is not None and bool(declared(environment_cls, BY_NAME["environment"], "episodic"))


def add_environment_reward(cfg: GRPOConfig, environment_cls: Any | None | list[Any]) -> None:
    """An environment that declares ``provides_reward`` scores its episodes:
    add the ``environment`` reward function (weight 1, as TRL adds
    ``get_reward``) to ``trl.reward_funcs`` unless the config lists it.
    ``environment_cls``: the chosen environment's class (:func:`import_chosen`),
    or the classes of several, ``None`` when it could not be imported (the
    import's error is reported)."""
    candidates = environment_cls if isinstance(environment_cls, list) else [environment_cls]
    if not any(_provides_reward(cfg, cls) for cls in candidates):
        return
    funcs = list(cfg.trl.reward_funcs or [])
    if ENVIRONMENT_REWARD in funcs:
        return
    if cfg.trl.reward_weights is not None and len(cfg.trl.reward_weights) == len(funcs):
        cfg.trl.reward_weights = [*cfg.trl.reward_weights, 1.0]
    cfg.trl.reward_funcs = [*funcs, ENVIRONMENT_REWARD]


def _declared_for(cfg: GRPOConfig, cls: Any, point: str, attribute: str) -> bool:
    """An implementation's declared flag, which may be decided from the config (``f(config) -> bool``)."""
    value = declared(cls, BY_NAME[point], attribute)
    return bool(value(cfg) if callable(value) else value)


def _turn_credit_checks(cfg: GRPOConfig, classes: ChosenClasses, errors: list[str]) -> None:
    """An ``advantage_aggregation`` that credits each turn (``needs_turn_rewards``)
    needs multi-turn episodes whose environment gives a reward per turn, that
    reward among the reward functions, and a loss that takes per-token
    advantages: each missing piece is refused by name, before anything loads."""
    if "advantage_aggregation" not in classes:
        return
    info, aggregation = classes["advantage_aggregation"]
    if not _declared_for(cfg, aggregation, "advantage_aggregation", "needs_turn_rewards"):
        return
    chosen = f"{source_key(cfg, BY_NAME['advantage_aggregation'])} = '{info.name}'"
    environment = classes["environment"][1] if "environment" in classes else None
    if "environment" in classes and not _episodic(environment):
        errors.append(
            f"{chosen} credits each turn of a multi-turn episode, but this run is single-turn (no environment: "
            "plugins.environment, trl.tools or trl.environment_factory): give it an environment, or remove "
            "plugins.advantage_aggregation for the default (one advantage per completion)."
        )
        return
    for name, cls in environment_classes(classes):  # with several environments, every one must give them
        if not _declared_for(cfg, cls, "environment", "turn_rewards"):
            errors.append(
                f"{chosen} needs a reward per turn, but environment '{name}' "
                f"({source_key(cfg, BY_NAME['environment'])}) does not declare turn_rewards (its replies carry no "
                "per-turn reward; an agent's episodes never do: the agent returns one reward per episode): use an "
                "environment that gives EnvironmentReply.reward each turn, or remove plugins.advantage_aggregation "
                "for the default (one advantage per completion)."
            )
    if ENVIRONMENT_REWARD not in (cfg.trl.reward_funcs or []):
        errors.append(
            f"{chosen} reads the per-turn rewards through the '{ENVIRONMENT_REWARD}' reward function, which "
            f"trl.reward_funcs does not list: add '{ENVIRONMENT_REWARD}' to trl.reward_funcs."
        )
    if "policy_loss" in classes and not _declared_for(
        cfg, classes["policy_loss"][1], "policy_loss", "per_token_advantages"
    ):
        errors.append(
            f"{chosen} gives one advantage per token, which policy loss '{classes['policy_loss'][0].name}' "
            f"({source_key(cfg, BY_NAME['policy_loss'])}) cannot take: set trl.use_liger_loss = false (the built-in "
            "loss takes them), or remove plugins.advantage_aggregation."
        )


def _provides_reward(cfg: GRPOConfig, environment_cls: Any | None) -> bool:
    if not _episodic(environment_cls):
        return False
    provides = declared(environment_cls, BY_NAME["environment"], "provides_reward")
    if callable(provides):  # decided from the config (never by importing the user's code)
        provides = provides(cfg)
    return bool(provides)


BackendRules = Callable[[GRPOConfig, ChosenTraits], list[str]]
"""The training backends' own rules: what in ``cfg`` a backend cannot run
(:func:`grpo_core.parallel.config_problems`). The config layer sits
below the backends and never imports them, so the caller passes them in."""


def check_config(
    cfg: GRPOConfig,
    host: PluginHost | None = None,
    num_processes: int | None = None,
    backend_rules: BackendRules | None = None,
    trains: bool = True,
) -> list[str]:
    """Return warnings for ``cfg``; raise :class:`ConfigError` listing every
    problem that stops it from running.

    Each chosen implementation is imported and checked (contract, settings,
    engine capabilities, its own ``grpo_validate_config``); with ``host``,
    every plugin registered on it is asked too (register always-on plugins
    first to include theirs). ``num_processes``: the training processes
    the run will have (default: this process's launcher environment).
    ``backend_rules``: the training backends' problems with ``cfg``, judged
    with the same traits and reported in the same list;
    :func:`grpo_core.validation.run_check.check_run_config` passes them, as
    ``grpo run`` and ``grpo config check`` do. ``trains``: judge what
    ``output_dir`` holds too (a live run in it, checkpoints a fresh start
    would overwrite); false for a command that trains nothing.
    """

    errors: list[str] = []
    warnings: list[str] = []
    world = num_processes or world_size()
    plugins = host or PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None)
    names = implementation_names(cfg)
    classes, import_problems = import_chosen(cfg, plugins, names)
    errors += import_problems
    environment_cls = classes["environment"][1] if "environment" in classes else None
    add_environment_reward(cfg, [cls for _, cls in environment_classes(classes)])
    try:  # two environments serving one row name
        route_table(cfg, environment_classes(classes))
    except ConfigError as exc:
        errors.append(str(exc))
    traits = chosen_traits(names, classes)
    errors += path_problems(cfg)
    registered = set(plugins.published(REWARD_GROUP))
    for found_errors, found_warnings in (
        dataset_source_problems(cfg),
        code_problems(cfg, plugins, registered),
        reward_name_problems(cfg, plugins, registered),
    ):
        errors += found_errors
        warnings += found_warnings
    _reward_checks(cfg, errors, warnings)
    if cfg.trl.rollout_func and (cfg.trl.tools or cfg.trl.environment_factory or _episodic(environment_cls)):
        errors.append(
            "trl.rollout_func and an environment (trl.tools, trl.environment_factory or plugins.environment) both "
            "drive the rollout: keep one (an environment runs the episodes itself; a rollout_func runs its own loop, "
            "with trainer.generate for the engine and env_mask for what the environment wrote)."
        )
    if cfg.trl.in_flight_weight_updates and cfg.trl.rollout_func:
        errors.append(
            "trl.in_flight_weight_updates cannot run with trl.rollout_func: the function builds each completion's "
            "token ids itself from its trainer.generate calls, and its result has no field for the policy version of "
            "each token, so grpo cannot tell which weights sampled which tokens. Set trl.in_flight_weight_updates = "
            "false, or run the multi-turn loop as an environment (plugins.environment, trl.environment_factory or "
            "trl.tools), whose episodes carry each token's version."
        )
    if cfg.trl.partial_rollout_token_budget:
        errors += partial_rollout_problems(cfg, world, bool(cfg.trl.rollout_func or _episodic(environment_cls)))
        warnings += partial_rollout_warnings(cfg)
    _generation_checks(cfg, errors, warnings)
    _loss_checks(cfg, names, errors, warnings)
    _turn_credit_checks(cfg, classes, errors)
    _process_checks(cfg, names, world, errors)
    _gpu_count_checks(world, errors, warnings)
    if backend_rules is not None:
        errors += backend_rules(cfg, traits)
    _async_checks(cfg, traits, errors, warnings)
    _training_checks(cfg, errors, warnings)
    if trains:
        output_dir_checks(cfg, errors, warnings)  # what output_dir already holds: a live run, checkpoints
    _no_effect_checks(cfg, traits, warnings)
    _ignored_option_checks(cfg, world, warnings)
    _model_checks(cfg, traits, errors, warnings)
    _speed_checks(cfg, errors, warnings)
    _observability_checks(cfg, host, errors, warnings)
    _plugin_checks(cfg, plugins, classes, world, errors, warnings)
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
        warnings += _plugin_warnings(host.hook.grpo_validate_config(config=cfg, num_processes=world))
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

"""Hook specifications: every hook a grpo plugin may implement.

An extension point's hooks are implemented by the one implementation a
config chooses (``firstresult``: its return value is the result); lifecycle
hooks by every registered plugin. The manual (how implementations are
published, built and checked, the attributes the core reads, the order of a
step) is ``docs/plugins.md``; the attributes themselves are typed in
:mod:`grpo_core.contract.declarations`. A plugin imports ``hookimpl`` from
:mod:`grpo_core.plugin_api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # imported for annotations only: keep plugin import cheap
    import torch

    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import (
        Completion,
        Episode,
        InferenceEngine,
        PolicyLossInputs,
        Prompt,
        RewardFunction,
        RolloutGroup,
        SamplingSettings,
        ScoredGroup,
        SyncResult,
        TrainingProgress,
    )

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# -------------------------------------------------------------------------------- rollout (grpo.rollout)


@hookspec(firstresult=True)
def grpo_rollout_generate(
    prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
) -> list[RolloutGroup]:
    """Sample completions for a batch of prompts (from a background thread with ``async_prefetch``).

    :param prompts: The prompts, templated and tokenised (``prompt.prompt_ids``).
    :param num_generations: Completions to sample per prompt.
    :param sampling: How to sample; with ``seed`` set each completion draws from its own seeded stream.
    :param policy_version: The weight version the engine holds; stamp every group with it.
    :return: One :class:`RolloutGroup` per prompt, in order, each with ``num_generations`` completions
        (token ids, text, the sampler's log-probs when the engine has them, ``truncated``).
        Raise :class:`EngineUnavailable` when the engine stays unreachable after your retries.
    """


@hookspec(firstresult=True)
def grpo_inference_engine() -> InferenceEngine | None:
    """Called once after the rollout is built, by a rollout that samples from an engine of its own.

    :return: The engine handle the chosen weight sync receives as ``engine``.
    """


# -------------------------------------------------------------------------------- environment (grpo.environment)


@hookspec(firstresult=True)
def grpo_environment_episode(prompt: Prompt, sample: int) -> Episode | None:
    """Called for each sample of each prompt when episodes are on; the core drives every turn through the rollout.

    :param prompt: The prompt; ``prompt.columns`` is the dataset row (TRL's ``reset(**row)``).
    :param sample: Which of the prompt's ``num_generations`` samples (``0 ..``).
    :return: A new, independent :class:`Episode` (``reset()``, ``step(text) -> EnvironmentReply``), or a
        :class:`DrivenEpisode` (``drive(model)``: it calls the model itself through an :class:`EpisodeModel`).
        With several environments the row's ``environment`` column picks the implementation (its ``names``).
    """


# -------------------------------------------------------------------------------- reward (grpo.plugins)


@hookspec(firstresult=True)
def grpo_load_reward(spec: str, context: RunContext) -> RewardFunction | None:
    """Called for a ``trl.reward_funcs`` entry that no ``grpo.reward`` entry point names.

    :param spec: The entry (a ``module.function`` path, a reward-model path, a URL, ...).
    :param context: The run.
    :return: A callable in TRL's convention (``f(prompts=, completions=, completion_ids=, **columns)``
        returning one float or ``None`` per completion; may be a coroutine function), or ``None``
        if this plugin does not understand ``spec``.
    """


# -------------------------------------------------------------------------------- advantage_aggregation


@hookspec(firstresult=True)
def grpo_aggregate_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    scale_rewards: str,
    completions: list[Completion],
    reward_names: list[str],
) -> torch.Tensor | list[list[float]]:
    """Called once per scored batch to combine rewards into group-relative advantages.

    :param rewards: ``[num_completions, num_functions]`` float, ``NaN`` where a function returned
        ``None``; rows group by group, ``group_size`` consecutive rows each.
    :param weights: ``[num_functions]`` reward weights.
    :param group_size: Completions per group.
    :param scale_rewards: ``"group"``, ``"batch"`` or ``"none"``: divide by the group's std, the batch's, or not.
    :param completions: The rows' completions, in order (an episode's turns and per-turn rewards:
        :class:`~grpo_core.contract.types.EpisodeStats`).
    :param reward_names: The reward functions' names, one per column.
    :return: ``[num_completions]`` advantages without ``NaN`` (0 where every reward is ``NaN``); or, to
        credit tokens apart (per turn), one list per completion with one float per entry of its
        ``token_ids`` (an implementation reading per-turn rewards declares ``needs_turn_rewards``).
    """


# -------------------------------------------------------------------------------- is_correction


@hookspec(firstresult=True)
def grpo_is_correction(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Called per micro-batch, before the loss, to correct for completions sampled by a stale or other policy.

    :param trainer_logps: ``[batch, len]`` the trainer's log-probs of the sampled tokens (no grad).
    :param sampler_logps: ``[batch, len]`` the engine's log-probs of the same tokens (``NaN`` where none).
    :param mask: ``[batch, len]`` 0/1 completion mask (0 on padding and on environment tokens).
    :return: ``(weights, mask, metrics)``: per-token multipliers of the policy-gradient term (the
        ratio ``pi_trainer / pi_sampler``, capped or zeroed), the mask the loss normalises by
        (usually the one given), scalars logged as ``is/<key>``.
    """


# -------------------------------------------------------------------------------- weight_sync


@hookspec(firstresult=True)
def grpo_sync_weights(model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
    """Called on rank 0 every ``trl.vllm_sync_interval`` steps and once before the first rollout.

    :param model: The trainer's unwrapped model (a PEFT model when an adapter is trained).
    :param version: The new policy version; rollouts requested after this returns carry it.
    :param engine: The rollout's engine handle, ``None`` when the rollout samples the trainer's
        model; use only the ``required_capabilities`` you declared.
    :return: What was done and how long it took (:class:`SyncResult`), once the engine serves the
        new weights. The core may verify that and call again with the same arguments.
    """


# -------------------------------------------------------------------------------- policy_loss


@hookspec(firstresult=True)
def grpo_policy_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Called per micro-batch; the core calls ``backward`` on the loss.

    :param inputs: The micro-batch: run the policy through ``inputs.logprobs`` (or
        ``inputs.hidden_states`` when you declare ``uses_hidden_states``), apply ``inputs.is_weights``.
    :return: ``(loss, metrics)``: a scalar scaled so that ``inputs.accumulation_steps`` micro-batches
        sum to one optimizer step's gradient; metrics averaged over the step's micro-batches.
    """


# -------------------------------------------------------------------------------- replay


@hookspec(firstresult=True)
def grpo_replay_prompts(prompts: list[Prompt], progress: TrainingProgress) -> list[Prompt]:
    """Called before each batch is generated (e.g. to swap in prompts deferred earlier).

    :param prompts: The batch's prompts from the dataset.
    :param progress: Where the run stands.
    :return: The prompts to sample, same length.
    """


@hookspec(firstresult=True)
def grpo_replay_groups(groups: list[ScoredGroup], progress: TrainingProgress) -> list[ScoredGroup]:
    """Called after each batch is scored (e.g. to replace groups without signal by remembered ones).

    :param groups: Every scored group of the batch.
    :param progress: Where the run stands.
    :return: The groups to train on, same length; a replayed one marked ``replayed=True``.
    """


# -------------------------------------------------------------------------------- lifecycle (every plugin)


@hookspec
def grpo_validate_config(config: Any, num_processes: int) -> list[str] | None:
    """Called by ``grpo config check`` and before a run builds anything; on an implementation's
    class, so there it is a ``@staticmethod``.

    :param config: The loaded ``GRPOConfig``.
    :param num_processes: The training processes the run will have (``grpo config check
        --num-processes``, the launcher's, else 1); take it only if a rule depends on it
        (the vLLM rollout's GPU placement does).
    :return: Warnings for a config that can run but probably should not; raise
        :class:`ConfigError` for one that cannot.
    """


@hookspec
def grpo_train_start(context: RunContext) -> None:
    """Called when the model, data and engines are ready, before the first rollout (start a lazy engine here).

    :param context: The run.
    """


@hookspec
def grpo_step_end(progress: TrainingProgress, metrics: dict[str, float]) -> None:
    """Called on rank 0 after each optimizer step (and its weight sync), before the step is logged.

    :param progress: The step just taken.
    :param metrics: The step's metrics; may be extended in place.
    """


@hookspec
def grpo_train_end(context: RunContext, status: str) -> None:
    """Called when training ends; release engines and processes and remove temporary files.

    :param context: The run.
    :param status: ``"completed"``, ``"interrupted"`` or ``"failed"``. A process killed outright
        never gets this call: keep folders outside ``output_dir`` in ``make_scratch_dir`` folders.
    """


@hookspec
def grpo_register_commands(app: Any) -> None:
    """Called once when the CLI starts, on always-on plugins; load engines inside the command, not at import.

    :param app: The ``typer.Typer`` of the ``grpo`` command line.
    """

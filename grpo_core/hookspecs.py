"""The plugin contract of grpo: every hook a plugin may implement.

grpo's core is a loop: *rollout* prompts into completions, *reward* them,
turn rewards into *advantages*, correct for stale samples
(*is_correction*), take a gradient step, *sync weights* back to the
inference engine, and decide what to *replay*. Each of those six steps is an
**extension point**: a small set of hooks below, implemented by exactly one
implementation per run, chosen by name in the config. A few **lifecycle
hooks** are observed by every registered plugin.

How implementations are found
-----------------------------
An implementation is a class (or any factory) published under an entry point
group named after its extension point::

    [project.entry-points."grpo.advantage_aggregation"]
    rank = "my_pkg.ranking:RankAdvantages"

The core loads the one the config names (``plugins.advantage_aggregation =
"rank"``, or the option the seed defines for it, e.g.
``trl.multi_objective_aggregation``), calls ``factory(context)`` with the
:class:`~grpo_core.context.RunContext`, and registers the result with pluggy,
which checks every ``@hookimpl`` against the specs below. The built-ins in
``plugins/`` are published the same way, so the core cannot tell them from a
third-party package.

Two more groups exist:

* ``grpo.reward``: a named reward function (TRL calling convention), usable
  as ``reward_funcs = ["name"]``.
* ``grpo.plugins``: always-on plugins that observe lifecycle hooks or
  resolve reward specs (:func:`grpo_load_reward`). They may wrap an
  extension-point hook (``@hookimpl(wrapper=True)``, e.g. to time it) but
  must not implement one.

Writing a hook
--------------
Use :data:`grpo_core.hookimpl`; a hook may accept any subset of the arguments
its spec lists (pluggy passes by name), so new arguments can be added to a
spec without breaking plugins. Extension-point hooks are ``firstresult``: the
chosen implementation's return value is the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # imported for annotations only: keep plugin import cheap
    import torch

    from grpo_core.context import RunContext
    from grpo_core.types import (
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

# Extension points with one implementation per run, chosen by name -> the
# hooks that implementation must provide. The plugin host rejects an
# implementation that forgot one, and an always-on plugin that implements one.
NAMED_EXTENSION_POINTS: dict[str, tuple[str, ...]] = {
    "rollout": ("grpo_rollout_generate",),
    "advantage_aggregation": ("grpo_aggregate_advantages",),
    "is_correction": ("grpo_is_correction",),
    "weight_sync": ("grpo_sync_weights",),
    "replay": ("grpo_replay_prompts", "grpo_replay_groups"),
}
# The reward point is open-ended: many reward functions per run. Named ones
# come from the ``grpo.reward`` group; any always-on plugin may implement
# ``grpo_load_reward`` to resolve other specs (first non-None answer wins).
REWARD_GROUP = "grpo.reward"
ALWAYS_ON_GROUP = "grpo.plugins"
EXTENSION_POINTS: tuple[str, ...] = ("rollout", "reward", *list(NAMED_EXTENSION_POINTS)[1:])


# --------------------------------------------------------------------------
# rollout: prompts -> completions
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_rollout_generate(
    prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
) -> list[RolloutGroup]:
    """Sample ``num_generations`` completions for each prompt.

    Return one :class:`RolloutGroup` per prompt, in the order given, each with
    exactly ``num_generations`` completions. Work from ``prompt.prompt_ids``
    (already templated and tokenised); return token ids, the decoded text,
    the sampler's per-token log-probs when the engine has them (needed for
    importance-sampling correction) and whether the completion was truncated
    at ``sampling.max_tokens``. Stamp every group with ``policy_version``.

    May be called from a background thread when ``async_prefetch`` is on; it
    must not touch the trainer's model then (use the inference engine).
    Raise :class:`grpo_core.errors.EngineUnavailable` when the engine cannot
    be reached after the implementation's own retries: the trainer then saves
    a checkpoint and stops cleanly.
    """


# --------------------------------------------------------------------------
# reward: completions + dataset columns -> one float (or None) each
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_load_reward(spec: str, context: RunContext) -> RewardFunction | None:
    """Turn one ``trl.reward_funcs`` entry into a callable, or return ``None``
    if this plugin does not understand ``spec``.

    Names published under the ``grpo.reward`` entry point group are resolved
    by the core before this hook is asked; this hook handles everything else
    (``module.function`` import paths, reward-model paths, URLs, ...). The
    returned callable follows TRL's convention: it is called as
    ``f(prompts=..., completions=..., completion_ids=..., **columns)`` and
    returns one ``float`` or ``None`` per completion; a coroutine function is
    awaited (several run concurrently).
    """


# --------------------------------------------------------------------------
# advantage_aggregation: per-function rewards -> one advantage per completion
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_aggregate_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str
) -> torch.Tensor:
    """Combine rewards into group-relative advantages.

    ``rewards`` is ``[num_completions, num_functions]`` float, ``NaN`` where a
    function returned ``None``; rows are ordered group by group, each group
    ``group_size`` consecutive rows. ``weights`` is ``[num_functions]``.
    ``scale_rewards`` is ``"group"``, ``"batch"`` or ``"none"``: divide by the
    group's standard deviation, the batch's, or not at all.

    Return ``[num_completions]`` advantages without ``NaN``; a row where every
    reward is ``NaN`` gets 0.
    """


# --------------------------------------------------------------------------
# is_correction: trainer vs sampler log-probs -> per-token weights and mask
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_is_correction(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Correct for completions sampled by a stale or different policy.

    All tensors are ``[batch, completion_len]``: the trainer's log-probs of
    the sampled tokens at sampling time (no grad), the sampler's (inference
    engine's) log-probs of the same tokens, and the 0/1 completion mask.
    Return ``(weights, mask, metrics)``: per-token multipliers applied to the
    policy-gradient loss, the (possibly narrowed) mask, and scalars to log
    under ``is/<name>``.
    """


# --------------------------------------------------------------------------
# weight_sync: trained weights -> inference engine
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_sync_weights(model: Any, version: int) -> SyncResult:
    """Make the inference engine sample from ``model``'s current weights.

    ``model`` is the trainer's (unwrapped) model: a PEFT model when an
    adapter is trained. ``version`` is the new policy version; rollouts that
    follow must be stamped with it. Called every ``trl.vllm_sync_interval``
    optimizer steps, and once before the first rollout so the engine starts
    from the run's own initial weights (whatever an earlier experiment left
    on the server). Return what was done and how long it took.
    """


# --------------------------------------------------------------------------
# replay: which groups to keep, replace and re-inject
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def grpo_replay_prompts(prompts: list[Prompt], progress: TrainingProgress) -> list[Prompt]:
    """Before generation: return the prompts to sample, same length.

    Lets an implementation swap in prompts deferred earlier (deferred
    re-rolling of prompts the model could not yet solve).
    """


@hookspec(firstresult=True)
def grpo_replay_groups(groups: list[ScoredGroup], progress: TrainingProgress) -> list[ScoredGroup]:
    """After scoring: return the groups to train on, same length.

    Sees every scored group, so it can remember groups with signal (a replay
    buffer), replace groups without signal by remembered ones (mark them
    ``replayed=True``), and note prompts to re-roll later.
    """


# --------------------------------------------------------------------------
# lifecycle: observed by every registered plugin
# --------------------------------------------------------------------------


@hookspec
def grpo_validate_config(config: Any) -> list[str] | None:
    """Check the loaded config before anything heavy happens.

    Raise :class:`grpo_core.errors.ConfigError` for a config that cannot run;
    return warnings (strings) for one that can but probably should not.
    """


@hookspec
def grpo_train_start(context: RunContext) -> None:
    """The model, data and engines are ready; the first rollout is next."""


@hookspec
def grpo_step_end(progress: TrainingProgress, metrics: dict[str, float]) -> None:
    """An optimizer step finished. ``metrics`` may be extended in place; it is
    logged after every plugin has seen it."""


@hookspec
def grpo_train_end(context: RunContext, status: str) -> None:
    """Training ended: ``status`` is ``"completed"``, ``"interrupted"`` or
    ``"failed"``. Release engines and processes here."""


@hookspec
def grpo_register_commands(app: Any) -> None:
    """Add sub-commands to the ``grpo`` command line (a ``typer.Typer``).

    Called once when the CLI starts, on always-on plugins only. Keep the
    module that implements it cheap to import: load engines inside the
    command, not at import time, so ``grpo --help`` stays fast and a missing
    optional engine never breaks unrelated commands.
    """

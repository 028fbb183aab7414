"""Everything a plugin may import from grpo_core, in one place.

A plugin (built-in or ``pip install``-ed) imports grpo_core through this
module only::

    from grpo_core.plugin_api import hookimpl, Prompt, RolloutGroup, make_scratch_dir

That is the public surface: the contract (the hook markers, the types a hook
takes and returns, the run context, the errors, the engine capabilities), the
config a plugin validates, and a few named helpers that more than one
implementation needs (the scratch directory, the weights a sync sends, the
log-prob chunk size, ...). Its names keep working when a module behind them
moves; a name that is not here is grpo's own business and may change without
notice. ``tests/test_plugin_api.py`` holds the built-in plugins to it.

Names are imported on first use (PEP 562), so ``import grpo_core.plugin_api``
costs nothing and a plugin that never touches a heavy helper (the loss,
merged weights) never imports torch through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

HOMES: dict[str, tuple[str, ...]] = {
    # the contract: hooks, the types they exchange, the run, the errors
    "grpo_core.contract.hookspecs": ("hookimpl",),
    "grpo_core.contract.types": (
        "Prompt",
        "Messages",
        "SamplingSettings",
        "Completion",
        "EpisodeStats",
        "RolloutGroup",
        "ScoredGroup",
        "TrainingProgress",
        "RewardFunction",
        "SyncResult",
        "PolicyLossInputs",
        "EnvironmentReply",
        "Episode",
        "DrivenEpisode",
        "EpisodeModel",
        "ModelTurn",
        "EngineScore",
        "ControlEndpoint",
        "InferenceEngine",
        "Checkpointable",
        "Tracker",
        "token_scorer",
        "engine_cpu_cores",
        "ENGINE_CAPABILITIES",
        "WEIGHTS_FROM_PATH",
        "WEIGHTS_FROM_URL",
        "WEIGHTS_IN_MEMORY",
        "WEIGHTS_OVER_NCCL",
        "ADAPTER_FROM_PATH",
        "ADAPTER_FROM_URL",
        "ADAPTER_LOADS",
        "CONTROL_ENDPOINTS",
        "SCORES_TOKENS",
        "SAMPLES_TRAINER_MODEL",
    ),
    "grpo_core.contract.context": ("RunContext",),
    # grpo's text format of tool calls (templates without tools): the tools and agent environments
    "grpo_core.contract.tool_calls": (
        "ToolCall",
        "parse_calls",
        "render_call",
        "instructions",
        "example_arguments",
        "split_calls",
    ),
    "grpo_core.contract.errors": (
        "GrpoError",
        "ConfigError",
        "PluginError",
        "RewardError",
        "DataError",
        "StorageError",
        "EngineUnavailable",
        "WeightSyncUnverified",
        "EnvironmentLost",
        "EpisodeOver",
        "NotImplementedYet",
    ),
    # the config a plugin's grpo_validate_config judges
    "grpo_core.config.schema": ("GRPOConfig", "EFFECTIVE_DEFAULTS"),
    "grpo_core.config.loader": ("load_config",),
    # helpers: scratch space, files written whole, user code by import path
    "grpo_core.runtime.scratch": ("make_scratch_dir", "remove_scratch_dir"),
    "grpo_core.runtime.atomic": ("atomic_directory",),
    "grpo_core.data.prompts": ("import_from_cwd",),
    # helpers for an inference engine: what a weight sync sends, its process's life and cores
    "grpo_core.modeling.engine_weights": ("merged_weights", "in_dtype", "save_adapter", "adapter_body"),
    "grpo_core.runtime.lifelong_thread": ("in_lifelong_thread", "set_parent_death_signal"),
    "grpo_core.runtime.cpu_affinity": ("process_cpus", "format_cpu_list"),
    "grpo_core.modeling.model_files": ("resolve_model_dir", "cache_root"),
    "grpo_core.modeling.precision": ("resolve_precision",),
    # helpers for a policy loss, a tracker and the function rollout
    "grpo_core.optimization.loss": ("policy_loss",),
    "grpo_core.optimization.logprobs": ("DEFAULT_CHUNK_SIZE",),
    "grpo_core.observability.tracking": ("MissingTrackerLibrary",),
    "grpo_core.host.plugin_host": ("PluginHost",),
    "grpo_core.generation.user_rollout": ("RolloutFuncTrainer", "groups_from_output", "import_rollout_func"),
}
"""Each public name by the module it lives in (its home may change; the name stays)."""

_HOME_OF = {name: module for module, names in HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(
            f"grpo_core.plugin_api has no {name!r}: it is not part of the plugin surface (see its __all__)"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what a type checker and an editor see; tests/test_plugin_api.py keeps it equal to HOMES
    from grpo_core.config.loader import load_config
    from grpo_core.config.schema import EFFECTIVE_DEFAULTS, GRPOConfig
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.errors import (
        ConfigError,
        DataError,
        EngineUnavailable,
        EnvironmentLost,
        EpisodeOver,
        GrpoError,
        NotImplementedYet,
        PluginError,
        RewardError,
        StorageError,
        WeightSyncUnverified,
    )
    from grpo_core.contract.hookspecs import hookimpl
    from grpo_core.contract.tool_calls import (
        ToolCall,
        example_arguments,
        instructions,
        parse_calls,
        render_call,
        split_calls,
    )
    from grpo_core.contract.types import (
        ADAPTER_FROM_PATH,
        ADAPTER_FROM_URL,
        ADAPTER_LOADS,
        CONTROL_ENDPOINTS,
        ENGINE_CAPABILITIES,
        SAMPLES_TRAINER_MODEL,
        SCORES_TOKENS,
        WEIGHTS_FROM_PATH,
        WEIGHTS_FROM_URL,
        WEIGHTS_IN_MEMORY,
        WEIGHTS_OVER_NCCL,
        Checkpointable,
        Completion,
        ControlEndpoint,
        DrivenEpisode,
        EngineScore,
        EnvironmentReply,
        Episode,
        EpisodeModel,
        EpisodeStats,
        InferenceEngine,
        Messages,
        ModelTurn,
        PolicyLossInputs,
        Prompt,
        RewardFunction,
        RolloutGroup,
        SamplingSettings,
        ScoredGroup,
        SyncResult,
        Tracker,
        TrainingProgress,
        engine_cpu_cores,
        token_scorer,
    )
    from grpo_core.data.prompts import import_from_cwd
    from grpo_core.generation.user_rollout import (
        RolloutFuncTrainer,
        groups_from_output,
        import_rollout_func,
    )
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.modeling.engine_weights import (
        adapter_body,
        in_dtype,
        merged_weights,
        save_adapter,
    )
    from grpo_core.modeling.model_files import cache_root, resolve_model_dir
    from grpo_core.modeling.precision import resolve_precision
    from grpo_core.observability.tracking import MissingTrackerLibrary
    from grpo_core.optimization.logprobs import DEFAULT_CHUNK_SIZE
    from grpo_core.optimization.loss import policy_loss
    from grpo_core.runtime.atomic import atomic_directory
    from grpo_core.runtime.cpu_affinity import format_cpu_list, process_cpus
    from grpo_core.runtime.lifelong_thread import (
        in_lifelong_thread,
        set_parent_death_signal,
    )
    from grpo_core.runtime.scratch import make_scratch_dir, remove_scratch_dir

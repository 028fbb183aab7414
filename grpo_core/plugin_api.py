"""Everything a plugin may import from grpo_core, in one place.

A plugin (built-in or ``pip install``-ed) imports grpo_core through this
module only::

    from grpo_core.plugin_api import hookimpl, Prompt, RolloutGroup, make_scratch_dir

That is the public surface: the contract (the hook marker, the types a hook
takes and returns, the Protocols of what an implementation declares, the run
context, the errors, the engine capabilities), the config a plugin
validates, and a few named helpers that more than one implementation needs
(the scratch directory, the weights a sync sends, the log-prob chunk size,
...). Its names keep working when a module behind them moves; a name that is
not here is grpo's own business and may change without
notice. ``tests/unit/test_plugin_api.py`` holds the built-in plugins to it.

The names are listed once, as the imports of the ``TYPE_CHECKING`` block at
the end (what type checkers and editors read; ``from m import x as x`` marks
each as re-exported). At run time that block is read from this file's source
and each name is imported on first use (PEP 562), so ``import
grpo_core.plugin_api`` costs nothing and a plugin that never touches a heavy
helper (the loss, merged weights) never imports torch through it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any


def _declared_names() -> dict[str, tuple[str, ...]]:
    """Module -> names, read from the ``TYPE_CHECKING`` imports below (the one list)."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(
        node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    homes: dict[str, tuple[str, ...]] = {}
    for stmt in block.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module:
            homes[stmt.module] = homes.get(stmt.module, ()) + tuple(alias.name for alias in stmt.names)
    return homes


HOMES: dict[str, tuple[str, ...]] = _declared_names()
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


# The plugin surface, by purpose; ``x as x`` marks a name re-exported (PEP 484), for strict type checkers.
# isort: off
if TYPE_CHECKING:
    # the contract: the hook marker, the types hooks exchange, what an implementation declares, the run, the errors
    from grpo_core.contract.hookspecs import hookimpl as hookimpl
    from grpo_core.contract.types import (
        Prompt as Prompt,
        Messages as Messages,
        SamplingSettings as SamplingSettings,
        Completion as Completion,
        EpisodeStats as EpisodeStats,
        RolloutGroup as RolloutGroup,
        ScoredGroup as ScoredGroup,
        TrainingProgress as TrainingProgress,
        RewardFunction as RewardFunction,
        SyncResult as SyncResult,
        PolicyLossInputs as PolicyLossInputs,
        EnvironmentReply as EnvironmentReply,
        Episode as Episode,
        DrivenEpisode as DrivenEpisode,
        EpisodeModel as EpisodeModel,
        ModelTurn as ModelTurn,
        EngineScore as EngineScore,
        ControlEndpoint as ControlEndpoint,
        InferenceEngine as InferenceEngine,
        Checkpointable as Checkpointable,
        Tracker as Tracker,
        token_scorer as token_scorer,
        engine_cpu_cores as engine_cpu_cores,
        in_flight_updater as in_flight_updater,
        ENGINE_CAPABILITIES as ENGINE_CAPABILITIES,
        WEIGHTS_FROM_PATH as WEIGHTS_FROM_PATH,
        WEIGHTS_FROM_URL as WEIGHTS_FROM_URL,
        WEIGHTS_IN_MEMORY as WEIGHTS_IN_MEMORY,
        WEIGHTS_OVER_NCCL as WEIGHTS_OVER_NCCL,
        ADAPTER_FROM_PATH as ADAPTER_FROM_PATH,
        ADAPTER_FROM_URL as ADAPTER_FROM_URL,
        ADAPTER_LOADS as ADAPTER_LOADS,
        CONTROL_ENDPOINTS as CONTROL_ENDPOINTS,
        SCORES_TOKENS as SCORES_TOKENS,
        PAUSES_GENERATION as PAUSES_GENERATION,
        CONTINUES_FROM_IDS as CONTINUES_FROM_IDS,
        SAMPLES_TRAINER_MODEL as SAMPLES_TRAINER_MODEL,
    )
    from grpo_core.contract.declarations import (
        Implementation as Implementation,
        RolloutImplementation as RolloutImplementation,
        EnvironmentImplementation as EnvironmentImplementation,
        WeightSyncImplementation as WeightSyncImplementation,
        AdvantageAggregationImplementation as AdvantageAggregationImplementation,
        IsCorrectionImplementation as IsCorrectionImplementation,
        PolicyLossImplementation as PolicyLossImplementation,
        ReplayImplementation as ReplayImplementation,
        Sends as Sends,
    )
    from grpo_core.contract.context import RunContext as RunContext
    from grpo_core.contract.errors import (
        GrpoError as GrpoError,
        ConfigError as ConfigError,
        PluginError as PluginError,
        RewardError as RewardError,
        DataError as DataError,
        StorageError as StorageError,
        EngineUnavailable as EngineUnavailable,
        WeightSyncUnverified as WeightSyncUnverified,
        EnvironmentLost as EnvironmentLost,
        EpisodeOver as EpisodeOver,
        NotImplementedYet as NotImplementedYet,
    )

    # the config a plugin's grpo_validate_config judges
    from grpo_core.config.schema import (
        GRPOConfig as GRPOConfig,
        EFFECTIVE_DEFAULTS as EFFECTIVE_DEFAULTS,
    )
    from grpo_core.config.loader import load_config as load_config

    # grpo's text format of tool calls (templates without tools): the tools and agent environments
    from grpo_core.contract.tool_calls import (
        ToolCall as ToolCall,
        parse_calls as parse_calls,
        render_call as render_call,
        instructions as instructions,
        example_arguments as example_arguments,
        split_calls as split_calls,
    )

    # helpers: scratch space, files written whole, user code by import path
    from grpo_core.runtime.scratch import (
        make_scratch_dir as make_scratch_dir,
        remove_scratch_dir as remove_scratch_dir,
    )
    from grpo_core.runtime.atomic import atomic_directory as atomic_directory
    from grpo_core.data.prompts import import_from_cwd as import_from_cwd

    # helpers for an inference engine: what a weight sync sends, its process's life and cores
    from grpo_core.modeling.engine_weights import (
        merged_weights as merged_weights,
        in_dtype as in_dtype,
        save_adapter as save_adapter,
        adapter_body as adapter_body,
    )
    from grpo_core.runtime.lifelong_thread import (
        in_lifelong_thread as in_lifelong_thread,
        set_parent_death_signal as set_parent_death_signal,
    )
    from grpo_core.runtime.cpu_affinity import (
        process_cpus as process_cpus,
        format_cpu_list as format_cpu_list,
    )
    from grpo_core.runtime.gpus import (
        visible_gpus as visible_gpus,
        gpu_count_source as gpu_count_source,
    )
    from grpo_core.modeling.model_files import (
        resolve_model_dir as resolve_model_dir,
        cache_root as cache_root,
    )
    from grpo_core.modeling.precision import resolve_precision as resolve_precision

    # helpers for a policy loss, a tracker and the function rollout
    from grpo_core.optimization.loss import policy_loss as policy_loss
    from grpo_core.optimization.logprobs import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
    from grpo_core.observability.tracking import MissingTrackerLibrary as MissingTrackerLibrary
    from grpo_core.host.plugin_host import PluginHost as PluginHost
    from grpo_core.generation.user_rollout import (
        RolloutFuncTrainer as RolloutFuncTrainer,
        groups_from_output as groups_from_output,
        import_rollout_func as import_rollout_func,
    )
# isort: on

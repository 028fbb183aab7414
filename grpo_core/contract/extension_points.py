"""The one table of extension points.

Each entry says what an extension point is called, which hooks its
implementation must provide, and which Protocol lists the class attributes
it may declare (:mod:`grpo_core.contract.declarations`: names, types and
defaults come from there). The config schema (``[plugins]`` fields),
implementation selection (:mod:`grpo_core.config.implementations`, which
also holds the default each point gets), the config checks, ``grpo plugins``
and the wiring of a run all read this table, so adding an extension point is
one entry here, its Protocol, and its hooks in :mod:`grpo_core.contract.hookspecs`.

The reward point is not in this table: a run has many reward functions, not
one chosen implementation (see :data:`REWARD_GROUP`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_core.contract import declarations as d

GROUP_PREFIX = "grpo."
REWARD_GROUP = "grpo.reward"
"""Named reward functions (TRL calling convention): ``reward_funcs = ["name"]``."""
ALWAYS_ON_GROUP = "grpo.plugins"
"""Plugins registered in every run: lifecycle hooks, reward resolution, CLI commands."""


@dataclass(frozen=True)
class ExtensionPoint:
    """One step of the loop that exactly one implementation performs per run."""

    name: str
    hooks: tuple[str, ...]
    """Hooks the chosen implementation must implement."""
    declares: type
    """The Protocol listing the class attributes the core reads from an implementation."""
    summary: str
    optional_hooks: tuple[str, ...] = ()
    """Hooks only this point's implementation may implement, but need not."""

    @property
    def attributes(self) -> dict[str, Any]:
        """Class attributes an implementation may declare, with their defaults."""
        return d.attributes(self.declares)

    @property
    def group(self) -> str:
        return GROUP_PREFIX + self.name

    @property
    def config_key(self) -> str:
        return f"plugins.{self.name}"


SETTINGS_ATTRIBUTE = "Settings"
"""Any implementation (and any named reward function) may declare a pydantic
model under this name; ``[plugins.<name>]`` is validated with it."""

EXTENSION_POINTS: tuple[ExtensionPoint, ...] = (
    ExtensionPoint(
        "rollout",
        hooks=("grpo_rollout_generate",),
        optional_hooks=("grpo_inference_engine",),
        declares=d.RolloutImplementation,
        summary="prompts -> completions",
    ),
    ExtensionPoint(
        "environment",
        hooks=("grpo_environment_episode",),
        declares=d.EnvironmentImplementation,
        summary="multi-turn episodes: the environment's answer to each model turn",
    ),
    ExtensionPoint(
        "weight_sync",
        hooks=("grpo_sync_weights",),
        declares=d.WeightSyncImplementation,
        summary="trained weights -> inference engine",
    ),
    ExtensionPoint(
        "advantage_aggregation",
        hooks=("grpo_aggregate_advantages",),
        declares=d.AdvantageAggregationImplementation,
        summary="rewards -> group-relative advantages",
    ),
    ExtensionPoint(
        "is_correction",
        hooks=("grpo_is_correction",),
        declares=d.IsCorrectionImplementation,
        summary="sampler vs trainer log-probs -> per-token weights",
    ),
    ExtensionPoint(
        "policy_loss",
        hooks=("grpo_policy_loss",),
        declares=d.PolicyLossImplementation,
        summary="micro-batch -> loss to back-propagate",
    ),
    ExtensionPoint(
        "replay",
        hooks=("grpo_replay_prompts", "grpo_replay_groups"),
        declares=d.ReplayImplementation,
        summary="which groups to keep, replace and re-roll",
    ),
)

BY_NAME: dict[str, ExtensionPoint] = {point.name: point for point in EXTENSION_POINTS}
POINT_HOOKS: frozenset[str] = frozenset(h for p in EXTENSION_POINTS for h in (*p.hooks, *p.optional_hooks))
"""Hooks that belong to an extension point (never to an always-on plugin)."""


def declared(obj: Any, point: ExtensionPoint, attribute: str) -> Any:
    """An implementation's declared attribute, or its Protocol's default."""
    return getattr(obj, attribute, point.attributes[attribute])

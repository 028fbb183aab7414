"""The one table of extension points.

Each entry says what an extension point is called, which hooks its
implementation must provide, which config key chooses the implementation,
which reference options decide it when that key is unset, and which
attributes an implementation may declare. The config schema (``[plugins]``
fields), implementation selection, the config checks, ``grpo plugins`` and
the wiring in :mod:`grpo_core.training.run` all read this table, so adding an
extension point is one entry here plus its hooks in :mod:`grpo_core.contract.hookspecs`.

The reward point is not in this table: a run has many reward functions, not
one chosen implementation (see :data:`REWARD_GROUP`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

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
    default: Callable[[GRPOConfig], str]
    """The implementation a config gets when ``[plugins] <name>`` is unset."""
    decided_by: str
    """The reference options :attr:`default` reads, for messages."""
    summary: str
    optional_hooks: tuple[str, ...] = ()
    """Hooks only this point's implementation may implement, but need not."""
    attributes: dict[str, Any] = field(default_factory=dict)
    """Class attributes an implementation may declare, with their defaults
    (documented in :mod:`grpo_core.contract.hookspecs`)."""

    @property
    def group(self) -> str:
        return GROUP_PREFIX + self.name

    @property
    def config_key(self) -> str:
        return f"plugins.{self.name}"


def _default_rollout(cfg: GRPOConfig) -> str:
    if cfg.trl.rollout_func and not cfg.trl.use_vllm:
        return "function"  # with an engine, the core drives rollout_func over the engine's rollout
    if not cfg.trl.use_vllm:
        return "transformers"
    return "vllm_colocate" if cfg.trl.vllm_mode == "colocate" else "vllm"


def _default_weight_sync(cfg: GRPOConfig) -> str:
    if not cfg.trl.use_vllm:
        return "in_process"  # the rollout samples the trained model itself
    if cfg.trl.vllm_mode == "colocate":
        return "vllm_in_memory"  # same process: tensors, not files
    if cfg.adapter == "lora" and cfg.trl.vllm_lora_sync:
        return "lora_filesystem"
    # Merged full weights: with a LoRA the engine then serves plain weights,
    # which generates faster than LoRA-enabled layers.
    return "full_filesystem"


def _default_is_correction(cfg: GRPOConfig) -> str:
    if not cfg.trl.vllm_importance_sampling_correction:
        return "none"
    return str(cfg.trl.vllm_importance_sampling_mode)


def _default_environment(cfg: GRPOConfig) -> str:
    if cfg.trl.tools or cfg.trl.environment_factory:
        return "tools"
    return "none"


SETTINGS_ATTRIBUTE = "Settings"
"""Any implementation (and any named reward function) may declare a pydantic
model under this name; ``[plugins.<name>]`` is validated with it."""

EXTENSION_POINTS: tuple[ExtensionPoint, ...] = (
    ExtensionPoint(
        "rollout",
        hooks=("grpo_rollout_generate",),
        optional_hooks=("grpo_inference_engine",),
        default=_default_rollout,
        decided_by="trl.use_vllm / trl.vllm_mode / trl.rollout_func",
        summary="prompts -> completions",
        attributes={
            "engine_capabilities": frozenset(),
            "concurrent_generate": False,
            "runs_rollout_func": False,
            "generates_on_every_rank": False,
        },
    ),
    ExtensionPoint(
        "environment",
        hooks=("grpo_environment_episode",),
        default=_default_environment,
        decided_by="trl.tools / trl.environment_factory",
        summary="multi-turn episodes: the environment's answer to each model turn",
        attributes={"episodic": True, "provides_reward": False, "names": None},
    ),
    ExtensionPoint(
        "weight_sync",
        hooks=("grpo_sync_weights",),
        default=_default_weight_sync,
        decided_by="trl.use_vllm / trl.vllm_mode / trl.vllm_lora_sync",
        summary="trained weights -> inference engine",
        attributes={"required_capabilities": frozenset(), "sends": "merged_weights"},
    ),
    ExtensionPoint(
        "advantage_aggregation",
        hooks=("grpo_aggregate_advantages",),
        default=lambda cfg: str(cfg.trl.multi_objective_aggregation),
        decided_by="trl.multi_objective_aggregation",
        summary="rewards -> group-relative advantages",
    ),
    ExtensionPoint(
        "is_correction",
        hooks=("grpo_is_correction",),
        default=_default_is_correction,
        decided_by="trl.vllm_importance_sampling_correction / trl.vllm_importance_sampling_mode",
        summary="sampler vs trainer log-probs -> per-token weights",
    ),
    ExtensionPoint(
        "policy_loss",
        hooks=("grpo_policy_loss",),
        default=lambda cfg: "liger" if cfg.trl.use_liger_loss else "grpo",
        decided_by="trl.use_liger_loss",
        summary="micro-batch -> loss to back-propagate",
        attributes={"uses_hidden_states": False},
    ),
    ExtensionPoint(
        "replay",
        hooks=("grpo_replay_prompts", "grpo_replay_groups"),
        default=lambda cfg: "default",
        decided_by="plugins.replay",
        summary="which groups to keep, replace and re-roll",
    ),
)

BY_NAME: dict[str, ExtensionPoint] = {point.name: point for point in EXTENSION_POINTS}
POINT_HOOKS: frozenset[str] = frozenset(h for p in EXTENSION_POINTS for h in (*p.hooks, *p.optional_hooks))
"""Hooks that belong to an extension point (never to an always-on plugin)."""


def declared(obj: Any, point: ExtensionPoint, attribute: str) -> Any:
    """An implementation's declared attribute, or the table's default."""
    return getattr(obj, attribute, point.attributes[attribute])


def chosen_implementations(cfg: GRPOConfig) -> dict[str, str]:
    """Extension point -> the implementation name this config runs: the
    ``[plugins]`` entry, else what the reference options decide. Where a
    list names several (environments), the first."""
    return {point.name: _first(getattr(cfg.plugins, point.name)) or point.default(cfg) for point in EXTENSION_POINTS}


def _first(value: Any) -> str | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def environment_implementations(cfg: GRPOConfig) -> list[str]:
    """Every environment implementation the run uses, in order: ``[plugins]
    environment`` as a list (several environments, rows choose), or the one
    chosen (:func:`chosen_implementations`)."""
    value = cfg.plugins.environment
    if isinstance(value, list) and value:
        return list(dict.fromkeys(value))
    return [chosen_implementations(cfg)["environment"]]


def source_key(cfg: GRPOConfig, point: ExtensionPoint) -> str:
    """The config key that chose ``point``'s implementation, for messages."""
    return point.config_key if getattr(cfg.plugins, point.name) is not None else point.decided_by

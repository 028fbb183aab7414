"""Which implementation each extension point runs for a config.

``[plugins] <point> = "name"`` when set; otherwise the reference's own
options decide (``trl.use_vllm`` picks the rollout, and so on), by the rules
here. They read config keys, so they live with the config, not in the
contract (:mod:`grpo_core.contract.extension_points` names the points).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.extension_points import EXTENSION_POINTS, ExtensionPoint


@dataclass(frozen=True)
class DefaultRule:
    """How a config without ``[plugins] <point>`` chooses the implementation."""

    choose: Callable[[GRPOConfig], str]
    decided_by: str
    """The options :attr:`choose` reads, for messages."""


def _rollout(cfg: GRPOConfig) -> str:
    if cfg.trl.rollout_func and not cfg.trl.use_vllm:
        return "function"  # with an engine, the core drives rollout_func over the engine's rollout
    if not cfg.trl.use_vllm:
        return "transformers"
    return "vllm_colocate" if cfg.trl.vllm_mode == "colocate" else "vllm"


def _weight_sync(cfg: GRPOConfig) -> str:
    if not cfg.trl.use_vllm:
        return "in_process"  # the rollout samples the trained model itself
    if cfg.trl.vllm_mode == "colocate":
        return "vllm_in_memory"  # same process: tensors, not files
    if cfg.adapter == "lora" and cfg.trl.vllm_lora_sync:
        return "lora_filesystem"
    # Merged full weights: with a LoRA the engine then serves plain weights,
    # which generates faster than LoRA-enabled layers.
    return "full_filesystem"


def _is_correction(cfg: GRPOConfig) -> str:
    if not cfg.trl.vllm_importance_sampling_correction:
        return "none"
    return str(cfg.trl.vllm_importance_sampling_mode)


def _environment(cfg: GRPOConfig) -> str:
    return "tools" if cfg.trl.tools or cfg.trl.environment_factory else "none"


DEFAULT_RULES: dict[str, DefaultRule] = {
    "rollout": DefaultRule(_rollout, "trl.use_vllm / trl.vllm_mode / trl.rollout_func"),
    "environment": DefaultRule(_environment, "trl.tools / trl.environment_factory"),
    "weight_sync": DefaultRule(_weight_sync, "trl.use_vllm / trl.vllm_mode / trl.vllm_lora_sync"),
    "advantage_aggregation": DefaultRule(
        lambda cfg: str(cfg.trl.multi_objective_aggregation), "trl.multi_objective_aggregation"
    ),
    "is_correction": DefaultRule(
        _is_correction, "trl.vllm_importance_sampling_correction / trl.vllm_importance_sampling_mode"
    ),
    "policy_loss": DefaultRule(lambda cfg: "liger" if cfg.trl.use_liger_loss else "grpo", "trl.use_liger_loss"),
    "replay": DefaultRule(lambda cfg: "default", "plugins.replay"),
}
"""Extension point -> its rule (one per point: ``tests/unit/test_declarations.py`` holds them equal)."""


def chosen_implementations(cfg: GRPOConfig) -> dict[str, str]:
    """Extension point -> the implementation name this config runs: the
    ``[plugins]`` entry, else what the reference options decide. Where a
    list names several (environments), the first."""
    return {
        point.name: _first(getattr(cfg.plugins, point.name)) or DEFAULT_RULES[point.name].choose(cfg)
        for point in EXTENSION_POINTS
    }


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
    return point.config_key if getattr(cfg.plugins, point.name) is not None else DEFAULT_RULES[point.name].decided_by

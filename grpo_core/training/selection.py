"""Which implementation of each extension point a config asks for.

``[plugins]`` names win; otherwise the reference's own options decide
(``use_vllm`` picks the rollout, ``vllm_lora_sync`` the weight sync, and so
on), so a config written for the reference framework runs unchanged.
"""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig


def default_rollout(cfg: GRPOConfig) -> str:
    if cfg.trl.rollout_func:
        return "function"
    if not cfg.trl.use_vllm:
        return "transformers"
    return "vllm_colocate" if cfg.trl.vllm_mode == "colocate" else "vllm"


def default_weight_sync(cfg: GRPOConfig) -> str:
    if not cfg.trl.use_vllm or cfg.trl.rollout_func:
        # A rollout_func reads the live model from its `trainer` argument.
        return "in_process"  # the transformers rollout samples from the trained model itself
    if cfg.trl.vllm_mode == "colocate":
        return "vllm_in_memory"  # same process: tensors, not files
    if cfg.adapter == "lora" and cfg.trl.vllm_lora_sync:
        return "lora_filesystem"
    # Merged full weights: with a LoRA adapter the engine then serves plain
    # weights, which generates faster than LoRA-enabled layers.
    return "full_filesystem"


def default_is_correction(cfg: GRPOConfig) -> str:
    if not cfg.trl.vllm_importance_sampling_correction:
        return "none"
    return str(cfg.trl.vllm_importance_sampling_mode)


def chosen_implementations(cfg: GRPOConfig) -> dict[str, str]:
    """Extension point -> implementation name for this run."""
    p = cfg.plugins
    return {
        "rollout": p.rollout or default_rollout(cfg),
        "weight_sync": p.weight_sync or default_weight_sync(cfg),
        "advantage_aggregation": p.advantage_aggregation or str(cfg.trl.multi_objective_aggregation),
        "is_correction": p.is_correction or default_is_correction(cfg),
        "replay": p.replay or "default",
    }

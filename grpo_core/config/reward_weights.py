"""``trl.reward_weights``: one weight per reward function, read by the
config check and by scoring alike."""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError


def reward_weights(cfg: GRPOConfig) -> list[float]:
    """One weight per reward function (all 1.0 unless ``trl.reward_weights``);
    a :class:`ConfigError` naming the fix when the lists do not pair up."""
    funcs = cfg.trl.reward_funcs or []
    if not funcs:
        raise ConfigError(
            "trl.reward_funcs is empty: name at least one reward function, a registered name (see `grpo plugins`) "
            "or an import path such as 'rewards.accuracy_reward'."
        )
    weights = cfg.trl.reward_weights
    if weights is None:
        return [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(
            f"trl.reward_weights has {len(weights)} weight(s) but trl.reward_funcs has {len(funcs)} "
            "function(s): give one weight per function, in the same order, or drop reward_weights (all 1.0)."
        )
    return [float(w) for w in weights]

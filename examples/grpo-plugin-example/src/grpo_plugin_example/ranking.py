"""Rank-based group advantages: robust to reward scale and outliers.

Each completion's weighted reward is replaced by its rank within its group,
centred and scaled to [-1, 1]: the best completion of a group gets +1, the
worst -1, ties share the average rank, and a group whose completions all
scored the same gets 0 everywhere (no signal). Because ranks do not depend on
the rewards' scale, ``scale_rewards`` has nothing left to do and is ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_core.plugin_api import hookimpl

if TYPE_CHECKING:
    import torch


class RankAdvantages:
    """The ``rank`` implementation of the ``advantage_aggregation`` point."""

    def __init__(self, context: Any = None) -> None:
        self.context = context

    @hookimpl
    def grpo_aggregate_advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
        import torch

        if rewards.dim() != 2 or rewards.shape[0] % group_size:
            raise ValueError(
                f"rank advantages: rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}"
            )
        rewards = rewards.float()
        valid = ~torch.isnan(rewards)
        # NaN (a function abstained) counts as 0 for the weighted sum; a row
        # where every function abstained takes no part in the ranking.
        totals = (torch.nan_to_num(rewards, nan=0.0) * weights.float().to(rewards.device)).sum(dim=1)
        scored = valid.any(dim=1)
        advantages = torch.zeros_like(totals)
        for start in range(0, totals.shape[0], group_size):
            rows = torch.arange(start, start + group_size, device=totals.device)[scored[start : start + group_size]]
            if rows.numel() < 2:
                continue
            advantages[rows] = _centred_ranks(totals[rows])
        return advantages


def _centred_ranks(values: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share), mapped linearly onto [-1, 1]."""
    import torch

    n = values.numel()
    # rank = number of values below + half the number of equal others
    below = (values.unsqueeze(0) < values.unsqueeze(1)).sum(dim=1).float()
    equal = (values.unsqueeze(0) == values.unsqueeze(1)).sum(dim=1).float() - 1
    ranks = below + equal / 2
    return (ranks - (n - 1) / 2) / ((n - 1) / 2) if n > 1 else torch.zeros_like(values)

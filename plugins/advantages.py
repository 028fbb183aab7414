"""Group-relative advantages from several reward functions (TRL 1.16's two
``multi_objective_aggregation`` strategies).

* ``sum_then_normalize`` (GRPO): weight and sum each completion's rewards,
  subtract the group mean, divide by the group's (or the batch's) standard
  deviation, or not at all (``scale_rewards``).
* ``normalize_then_sum`` (GDPO): normalise each reward function within the
  group first, so no function dominates by scale, then weight, sum and
  normalise over the batch. As in TRL, ``scale_rewards`` does not apply.

Missing rewards (``NaN``: a function returned ``None``) are left out of
means and standard deviations; in a weighted sum they count as 0 unless the
whole row is missing, in which case the completion is left out and its
advantage is 0. A statistic over fewer than two values is undefined and
gives advantage 0, so the result never holds ``NaN``. Standard deviations
are unbiased (Bessel) and ``1e-4`` is added before dividing, as in TRL.
"""

from __future__ import annotations

import torch

from grpo_core.plugin_api import GrpoError, RunContext, hookimpl

STD_EPS = 1e-4
SCALE_CHOICES = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std ignoring NaN; NaN where fewer than two values."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    squares = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.full_like(squares, float("nan")))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dim)


class _Aggregation:
    """Shared checks and the warn-once for unscorable completions."""

    name = "?"

    def __init__(self, context: RunContext | None = None) -> None:
        self._log = context.log if context is not None else print
        self._warned_unscorable = False

    def _prepare(
        self, rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if scale_rewards not in SCALE_CHOICES:
            raise GrpoError(f"trl.scale_rewards = '{scale_rewards}' must be one of {', '.join(SCALE_CHOICES)}")
        if rewards.dim() == 1:
            rewards = rewards.unsqueeze(1)
        n, k = rewards.shape
        if group_size < 1 or n % group_size != 0:
            raise GrpoError(
                f"advantages ({self.name}): {n} completions do not split into groups of {group_size} "
                "(trl.num_generations); every prompt needs exactly num_generations completions"
            )
        weights = torch.as_tensor(weights, dtype=torch.float32, device=rewards.device).reshape(-1)
        if weights.numel() != k:
            raise GrpoError(
                f"advantages ({self.name}): {k} reward functions but {weights.numel()} weights; "
                "trl.reward_weights needs one weight per entry of trl.reward_funcs"
            )
        rewards = rewards.to(torch.float32)
        # +-inf cannot be averaged; treat it like a missing reward.
        rewards = torch.where(torch.isinf(rewards), torch.full_like(rewards, float("nan")), rewards)
        unscorable = torch.isnan(rewards).all(dim=1)
        if bool(unscorable.any()) and not self._warned_unscorable:
            self._warned_unscorable = True
            self._log(
                f"warning: {int(unscorable.sum())} of {n} completions got no reward from any function "
                "(all returned None); their advantage is 0 (shown once)"
            )
        return rewards, weights, unscorable

    @hookimpl
    def grpo_aggregate_advantages(
        self, rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale_rewards: str
    ) -> torch.Tensor:
        rewards, weights, unscorable = self._prepare(rewards, weights, group_size, scale_rewards)
        advantages = self._aggregate(rewards, weights, unscorable, group_size, scale_rewards)
        # Undefined statistics (too few values) and unscorable rows -> 0.
        return torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0)

    def _aggregate(
        self, rewards: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor, group_size: int, scale: str
    ) -> torch.Tensor:
        raise NotImplementedError


class SumThenNormalize(_Aggregation):
    """GRPO's aggregation: weighted sum, then group-relative normalisation."""

    name = "sum_then_normalize"

    def _aggregate(self, rewards, weights, unscorable, group_size, scale):
        total = (rewards * weights.unsqueeze(0)).nansum(dim=1)
        total = total.masked_fill(unscorable, float("nan"))
        grouped = total.view(-1, group_size)
        centred = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
        if scale == "none":
            return centred
        if scale == "group":
            std = _nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
            if group_size == 1:
                std = torch.zeros_like(std)
        else:  # batch
            std = _nanstd(total).expand_as(total) if total.numel() > 1 else torch.zeros_like(total)
        return centred / (std + STD_EPS)


class NormalizeThenSum(_Aggregation):
    """GDPO: normalise each reward function within its group, then weight,
    sum and normalise over the batch."""

    name = "normalize_then_sum"

    def _aggregate(self, rewards, weights, unscorable, group_size, scale):
        k = rewards.size(1)
        grouped = rewards.view(-1, group_size, k)
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = _nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        per_function = ((grouped - mean) / (std + STD_EPS)).view(-1, k)
        total = (per_function * weights.unsqueeze(0)).nansum(dim=1)
        total = total.masked_fill(unscorable, float("nan"))
        std_all = _nanstd(total).expand_as(total) if total.numel() > 1 else torch.zeros_like(total)
        return (total - torch.nanmean(total)) / (std_all + STD_EPS)

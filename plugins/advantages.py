"""Group-relative advantages from several reward functions (TRL 1.16's two
``multi_objective_aggregation`` strategies), and per-turn credit for
multi-turn episodes (``turn_returns``, below; ``docs/turn-credit.md``).

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

import math
from typing import Any

import torch

from grpo_core.plugin_api import Completion, GrpoError, RunContext, hookimpl

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


# ---------------------------------------------------------------- per-turn credit

ENVIRONMENT_REWARD = "environment"
"""The built-in reward function that carries an episode's environment reward
(the sum of its replies' rewards and ``final_reward``)."""


class TurnReturns(_Aggregation):
    """``grpo.advantage_aggregation:turn_returns``: each turn of an episode
    credited with its own group-relative return-to-go.

    Episode ``i`` of a group (``G`` episodes of one prompt) plays turns
    ``t = 0 .. T_i - 1``; the environment's reply to turn ``t`` rewards it
    ``r_it`` (``EnvironmentReply.reward``; none counts 0). Its weighted
    episode reward ``R_i`` (every reward function, ``environment`` among
    them: the per-turn rewards, ``final_reward`` and the rest) is split at
    each turn into what came before and what is still to come; turn ``t``'s
    **return-to-go** is ``G_it = R_i - w_env * sum_{k<t} r_ik``: rewards
    earned before turn ``t`` cannot have been caused by it (REINFORCE with
    reward-to-go: Williams 1992; the "causality" form of the policy gradient).
    Each turn index is a group of its own, over the episodes that reached it
    (as MT-GRPO, Zeng et al. 2025, arXiv:2505.11821, and GiGPO's step groups,
    Feng et al. 2025, arXiv:2505.10978, compare turns rather than whole
    episodes): the baseline of episode ``i`` at turn ``t`` is the mean
    ``G_jt`` of the *other* episodes that reached turn ``t`` (leave-one-out,
    RLOO: Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740), and
    ``scale_rewards`` divides by the standard deviation of the turn's
    returns (``group``), of every played turn's in the batch (``batch``),
    or by nothing (``none``), with ``1e-4`` added as TRL does. Every policy
    token of turn ``t`` gets ``A_it``; the environment's tokens get 0.

    **In what sense it is unbiased** (``scale_rewards = "none"``): if the
    episodes of a group are sampled independently and each ``r_it`` is
    decided by the time the environment answers turn ``t``, then the expected
    update of one episode, ``E[sum_t grad log pi(turn t | history) * A_it]``,
    is ``sum_t p_t * g_t``, where ``g_t = E[grad log pi(turn t | history) *
    G_t]`` is turn ``t``'s term of the policy gradient of ``E[R]`` and
    ``p_t`` the probability that some other episode of the group reaches
    turn ``t``. The baseline comes from other, independent episodes, so its
    product with the turn's score function has expectation 0, as have the
    rewards before ``t``; a turn that no other episode reached has nothing to
    be compared with and gets advantage 0 (as GRPO gives a group of one),
    which is where ``p_t`` comes from. ``p_0 = 1``, and every ``p_t = 1`` when
    the episodes of a group run the same number of turns: the estimator is
    then exactly unbiased. Turns dropped that way are counted in the log.
    With ``group``/``batch`` scaling, the division by a standard deviation
    that includes the episode's own return makes it biased, as GRPO's is.
    ``tests/unit/test_turn_credit.py`` checks the statement by exact enumeration.

    Needs episodes with per-turn rewards: the config check refuses it on a
    single-turn run, with an environment that does not declare
    ``turn_rewards``, without the ``environment`` reward function, or with a
    loss that takes one advantage per completion (Liger's).
    """

    name = "turn_returns"
    needs_turn_rewards = True

    def __init__(self, context: RunContext | None = None) -> None:
        super().__init__(context)
        self._warned_lone = False
        self._warned_no_turn_rewards = False

    @hookimpl
    def grpo_aggregate_advantages(
        self,
        rewards: torch.Tensor,
        weights: torch.Tensor,
        group_size: int,
        scale_rewards: str,
        completions: list[Completion] | None = None,
        reward_names: list[str] | None = None,
    ) -> list[list[float]]:
        rewards, weights, unscorable = self._prepare(rewards, weights, group_size, scale_rewards)
        if completions is None or reward_names is None or len(completions) != rewards.size(0):
            raise GrpoError(
                f"advantages ({self.name}): the caller passed no completions or reward names; per-turn credit "
                "needs each episode's turns (grpo_aggregate_advantages' completions and reward_names)"
            )
        if ENVIRONMENT_REWARD not in reward_names:
            raise GrpoError(
                f"advantages ({self.name}): no '{ENVIRONMENT_REWARD}' reward function among {reward_names}: "
                f"add '{ENVIRONMENT_REWARD}' to trl.reward_funcs (it carries the per-turn rewards)"
            )
        env = reward_names.index(ENVIRONMENT_REWARD)
        total = (rewards * weights.unsqueeze(0)).nansum(dim=1).tolist()
        env_weight = float(weights[env])
        env_scored = (~torch.isnan(rewards[:, env])).tolist()
        returns: list[list[float] | None] = []
        for i, completion in enumerate(completions):
            starts, turn_rewards = _turns(completion, i, self.name)
            if bool(unscorable[i]):
                returns.append(None)
                continue
            # an episode whose environment reward is missing (it failed) has no per-turn rewards in R_i
            weight = env_weight if env_scored[i] else 0.0
            earned, row = 0.0, []
            for r in turn_rewards:
                row.append(total[i] - weight * earned)
                earned += 0.0 if r is None else float(r)
            returns.append(row)
        per_turn, lone = turn_advantages(returns, group_size, scale_rewards)
        self._say_once(completions, lone)
        return [_token_row(c, a) for c, a in zip(completions, per_turn, strict=True)]

    def _say_once(self, completions: list[Completion], lone: int) -> None:
        if lone and not self._warned_lone:
            self._warned_lone = True
            self._log(
                f"advantages ({self.name}): {lone} turn(s) that no other episode of their group reached got "
                "advantage 0 (nothing to compare them with; shown once)"
            )
        if not self._warned_no_turn_rewards and not any(
            r is not None for c in completions if c.episode is not None for r in c.episode.turn_rewards
        ):
            self._warned_no_turn_rewards = True
            self._log(
                f"advantages ({self.name}): no episode of this batch got a per-turn reward from the environment; "
                "each turn is credited with the episode's reward against the other episodes at that turn (shown once)"
            )


def _turns(completion: Completion, row: int, name: str) -> tuple[list[int], list[float | None]]:
    """An episode's turn starts and per-turn rewards, refused with a sentence
    when the completion is not an episode or its record is inconsistent."""
    stats = completion.episode
    if stats is None:
        raise GrpoError(
            f"advantages ({name}): completion {row} is not a multi-turn episode (no episode record); per-turn "
            "credit needs an environment that runs episodes"
        )
    starts, rewards = list(stats.turn_starts), list(stats.turn_rewards)
    ordered = all(0 <= a <= b for a, b in zip(starts, starts[1:])) and all(
        s <= len(completion.token_ids) for s in starts
    )
    if len(starts) != len(rewards) or not ordered:
        raise GrpoError(
            f"advantages ({name}): completion {row}'s episode record has {len(starts)} turn starts and "
            f"{len(rewards)} turn rewards (or starts out of order): the episode driver records one of each per turn"
        )
    return starts, rewards


def _std(values: list[float]) -> float:
    """Unbiased (Bessel) standard deviation; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def turn_advantages(
    returns: list[list[float] | None], group_size: int, scale_rewards: str
) -> tuple[list[list[float]], int]:
    """Per-turn advantages from per-turn returns-to-go (``None``: an
    unscorable episode, which gets none and is no one's baseline), groups of
    ``group_size`` consecutive episodes; and how many turns had no other
    episode of their group to compare with (they get 0). See
    :class:`TurnReturns` for the estimator."""
    out = [[0.0] * len(r) if r is not None else [] for r in returns]
    played = [g for r in returns if r is not None for g in r]
    batch_std = _std(played)
    lone = 0
    for start in range(0, len(returns), group_size):
        members = [i for i in range(start, start + group_size) if returns[i] is not None]
        horizon = max((len(returns[i]) for i in members), default=0)  # type: ignore[arg-type]
        for t in range(horizon):
            alive = [i for i in members if len(returns[i]) > t]  # type: ignore[arg-type]
            if len(alive) < 2:
                lone += len(alive)
                continue
            values = [returns[i][t] for i in alive]  # type: ignore[index]
            total, n = sum(values), len(values)
            scale = {"group": _std(values), "batch": batch_std}.get(scale_rewards)
            for i, g in zip(alive, values, strict=True):
                centred = g - (total - g) / (n - 1)  # against the other episodes at this turn
                out[i][t] = centred if scale is None else centred / (scale + STD_EPS)
    return out, lone


def _token_row(completion: Completion, per_turn: list[float]) -> list[float]:
    """Turn ``t``'s advantage on its policy tokens (from its start to the next
    turn's), 0 on every other token."""
    n = len(completion.token_ids)
    mask = completion.loss_mask if completion.loss_mask is not None else [1] * n
    row = [0.0] * n
    starts: Any = completion.episode.turn_starts if completion.episode is not None else []
    bounds = [*starts, n]
    for t, advantage in enumerate(per_turn):
        for k in range(bounds[t], bounds[t + 1]):
            if mask[k]:
                row[k] = advantage
    return row

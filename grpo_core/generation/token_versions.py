"""Which policy version sampled each token, and what the trainer makes of it.

With ``trl.in_flight_weight_updates`` the engine takes new weights while
completions are generating, so one completion may hold tokens of version v
(sampled before the update) and of v+1 (after it):
``Completion.token_versions`` says which. Staleness is then a property of
each token, not of the batch: a token sampled by version u and trained on
by a trainer at version t is ``t - u`` versions stale. Its importance weight
already uses its own sampler log-prob (the IS correction is per token).

The bound: no token may be more than ``trl.prefetch_depth`` batches behind
the trainer, ``prefetch_depth x steps_per_batch`` versions (the bound async
prefetch keeps per batch; a batch feeds ``steps_per_batch`` optimizer steps). A sample whose
**oldest** policy token is older than that is dropped from training
(loss mask and advantage zeroed, so it trains nothing and counts in no
normaliser; its group's other samples keep the advantages they were given)
and counted in ``inflight/dropped_stale_samples``.

Replayed groups (``ScoredGroup.replayed``, ``trl.replay_buffer_size``) are
older on purpose and corrected by the replay's own rule
(``replay_recompute_logps``): they are left out of both.

With partial rollouts (``trl.partial_rollout_token_budget``) a sample may
span up to ``ceil(max_completion_length / budget)`` generation batches by
design, each ``steps_per_batch`` optimizer steps apart, so the bound grows
by that many versions for each batch after the first
(:func:`token_staleness_bound`); a token older than that is dropped as above.
"""

from __future__ import annotations

import dataclasses
import math

from grpo_core.contract.types import Completion, ScoredGroup


def token_staleness_bound(
    prefetch_depth: int, steps_per_batch: int, max_completion_length: int, partial_budget: int | None
) -> int:
    """The most versions a policy token may be behind the trainer: the
    batches it may be behind (``prefetch_depth``, plus, with partial
    rollouts, each batch after the first of the
    ``ceil(max_completion_length / budget)`` a sample may span), each
    ``steps_per_batch`` versions."""
    spans = 1 if partial_budget is None else math.ceil(max_completion_length / partial_budget)
    return (prefetch_depth + spans - 1) * steps_per_batch


def versions_of(completion: Completion, group_version: int) -> list[int]:
    """The version of every entry of ``completion.token_ids``."""
    if completion.token_versions is None:
        return [group_version] * len(completion.token_ids)
    if len(completion.token_versions) != len(completion.token_ids):
        raise ValueError(
            f"a completion has {len(completion.token_versions)} token versions for {len(completion.token_ids)} "
            "tokens: the rollout must give one per entry of token_ids"
        )
    return [int(v) for v in completion.token_versions]


def policy_token_versions(completion: Completion, group_version: int) -> list[int]:
    """The versions of the tokens the policy sampled (loss mask 1)."""
    versions = versions_of(completion, group_version)
    if completion.loss_mask is None:
        return versions
    return [v for v, m in zip(versions, completion.loss_mask, strict=True) if m]


def staleness_metrics(groups: list[ScoredGroup], trainer_version: int) -> dict[str, float]:
    """Per-token staleness of a batch the trainer at ``trainer_version``
    trains on: the mean and max over every policy token, the tokens sampled
    after an update in a completion begun before it, and those completions."""
    total = count = 0
    worst = 0
    across = samples_across = 0
    for scored in groups:
        if scored.replayed:
            continue
        for completion in scored.group.completions:
            versions = policy_token_versions(completion, scored.group.policy_version)
            if not versions:
                continue
            total += sum(trainer_version - v for v in versions)
            count += len(versions)
            worst = max(worst, trainer_version - min(versions))
            later = sum(v > versions[0] for v in versions)
            across += later
            samples_across += int(later > 0)
    return {
        "token_staleness/mean": total / count if count else 0.0,
        "token_staleness/max": float(worst),
        "inflight/tokens_across_update": float(across),
        "inflight/samples_across_update": float(samples_across),
    }


def drop_stale(groups: list[ScoredGroup], trainer_version: int, bound: int) -> tuple[list[ScoredGroup], int]:
    """``groups`` with every sample whose oldest policy token is more than
    ``bound`` versions behind ``trainer_version`` dropped from training (its
    loss mask and advantages zeroed; the groups keep their shape), and how
    many were. Groups with nothing to drop are returned as they are."""
    out: list[ScoredGroup] = []
    dropped = 0
    for scored in groups:
        if scored.replayed:
            out.append(scored)
            continue
        stale = [
            bool(versions) and trainer_version - min(versions) > bound
            for versions in (policy_token_versions(c, scored.group.policy_version) for c in scored.group.completions)
        ]
        if not any(stale):
            out.append(scored)
            continue
        dropped += sum(stale)
        completions = [
            dataclasses.replace(c, loss_mask=[0] * len(c.token_ids)) if s else c
            for c, s in zip(scored.group.completions, stale, strict=True)
        ]
        token_advantages = scored.token_advantages
        if token_advantages is not None:
            token_advantages = [[0.0] * len(row) if s else row for row, s in zip(token_advantages, stale, strict=True)]
        out.append(
            dataclasses.replace(
                scored,
                group=dataclasses.replace(scored.group, completions=completions),
                advantages=[0.0 if s else a for a, s in zip(scored.advantages, stale, strict=True)],
                token_advantages=token_advantages,
            )
        )
    return out, dropped

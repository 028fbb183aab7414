"""Evaluation: held-out prompts, generated at a pinned policy version and
scored with the run's reward functions.

Where the prompts come from: ``test_datasets`` (loaded and templated like
``[[datasets]]``), else ``val_set_size`` prompts split off the training
data (a fraction < 1 or a count >= 1, chosen with ``seed``; they are then
never trained on). When: ``eval_strategy = "steps"``, every ``eval_steps``
optimizer steps and after the last one.

Generation goes through the run's own rollout hook
(:func:`~grpo_core.contract.hookspecs.grpo_rollout_generate`) with one completion per
prompt at ``eval_temperature`` (0: greedy), so it works with every rollout
(vLLM server, colocated vLLM, transformers). It never touches the training
prompt stream or a prefetch in flight: it has its own prompts, and it
generates from the weights the engine already holds. Without
``async_prefetch`` the trainer syncs first, so the engine holds the current
policy; with it, evaluation runs at the last synced version rather than
forcing a sync under a batch being generated. ``eval/policy_version`` says
which version was measured.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.data.prompts import load_prompts
from grpo_core.generation.episodes import release, sample_groups
from grpo_core.generation.producer import sampling_from_config

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import Prompt, RolloutGroup, SamplingSettings

EVAL_CHUNK = 64  # prompts per rollout call


def split_validation(prompts: list[Prompt], size: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """``(train, validation)``: ``size`` prompts (a fraction < 1, or a count)
    picked with ``seed``. Both keep their order; train indices are renumbered."""
    if size <= 0:
        return prompts, []
    count = int(round(size * len(prompts))) if size < 1 else int(size)
    if size >= 1 and size != int(size):
        raise ConfigError(f"val_set_size = {size}: a count must be a whole number (or give a fraction below 1).")
    count = max(1, count)
    if count >= len(prompts):
        raise DataError(
            f"val_set_size = {size:g} takes {count} of the {len(prompts)} prompts, leaving none to train on: lower it."
        )
    chosen = set(random.Random(seed).sample(range(len(prompts)), count))
    train = [p for i, p in enumerate(prompts) if i not in chosen]
    val = [p for i, p in enumerate(prompts) if i in chosen]
    for position, prompt in enumerate(train):
        prompt.index = position
    return train, val


def load_eval_prompts(cfg: GRPOConfig, tokenizer: Any, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """``(training prompts, evaluation prompts)`` for this config."""
    if cfg.test_datasets:
        eval_cfg = cfg.model_copy(update={"datasets": cfg.test_datasets, "shuffle_dataset": False})
        return prompts, load_prompts(eval_cfg, tokenizer)
    return split_validation(prompts, cfg.val_set_size, cfg.seed)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    groups: list[RolloutGroup]
    rewards: list[list[list[float | None]]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def eval_sampling(cfg: GRPOConfig, stop_ids: list[int]) -> SamplingSettings:
    """The run's sampling settings at ``eval_temperature``."""
    return replace(sampling_from_config(cfg, stop_ids), temperature=float(cfg.eval_temperature))


def evaluate(
    sampling: SamplingSettings,
    hook: Any,
    scorer: Any,
    prompts: list[Prompt],
    policy_version: int,
    step: int,
    episodes: Any = None,
) -> EvalResult:
    """Generate one completion per prompt with ``sampling`` (:func:`eval_sampling`)
    through the rollout hook (one whole episode each, through ``episodes``,
    when the run has them) and score it."""
    started = time.perf_counter()
    groups: list[RolloutGroup] = []
    for start in range(0, len(prompts), EVAL_CHUNK):
        chunk = prompts[start : start + EVAL_CHUNK]
        out = sample_groups(hook, chunk, 1, sampling, policy_version, episodes, what="evaluation")
        groups.extend(out)
    gen_seconds = time.perf_counter() - started
    try:
        rewards = scorer.score(groups, step)
    finally:
        release(groups)
    totals: list[float] = []
    per_func: list[list[float]] = [[] for _ in scorer.names]
    for per_group in rewards:
        for row in per_group:
            totals.append(sum(w * v for w, v in zip(scorer.weights, row) if v is not None and math.isfinite(v)))
            for j, value in enumerate(row):
                if value is not None and math.isfinite(value):
                    per_func[j].append(float(value))
    lengths = [c.model_token_count for g in groups for c in g.completions]
    metrics = {
        "eval/reward": _mean(totals),
        "eval/completions/mean_length": _mean([float(n) for n in lengths]),
        "eval/num_samples": float(len(totals)),
        "eval/policy_version": float(policy_version),
        "time/eval": time.perf_counter() - started,
        "time/eval_generation": gen_seconds,
    }
    for name, values in zip(scorer.names, per_func):
        metrics[f"eval/rewards/{name}/mean"] = _mean(values)
    return EvalResult(metrics, groups, rewards)


def eval_rows(result: EvalResult, reward_names: list[str], step: int) -> list[dict[str, Any]]:
    rows = []
    for group, per_group in zip(result.groups, result.rewards):
        prompt = group.prompt.prompt
        text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
        for completion, row in zip(group.completions, per_group):
            out: dict[str, Any] = {"step": step, "prompt": text, "completion": completion.text}
            out.update({f"reward/{n}": v for n, v in zip(reward_names, row)})
            rows.append(out)
    return rows

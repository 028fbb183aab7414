"""How many completions a generation and an optimizer step hold (TRL's
definitions): facts about the config and the process count, which the config
checks judge and the training loop slices batches by.

``micro_batch_size`` is per process (TRL's ``per_device_train_batch_size``);
one optimizer step trains on ``micro_batch_size x gradient_accumulation_steps
x N`` completions across N processes; ``trl.generation_batch_size`` is global.
"""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.runtime.processes import world_size


def generation_batch_size(cfg: GRPOConfig, world: int | None = None) -> int:
    """Completions per generation, over all ``world`` training processes:
    ``trl.generation_batch_size`` (global, as in TRL), else ``micro_batch_size
    x world x trl.steps_per_generation`` (default
    ``gradient_accumulation_steps``), TRL's default."""
    trl = cfg.trl
    if trl.generation_batch_size is not None:
        return int(trl.generation_batch_size)
    world = _world(world)
    return cfg.micro_batch_size * world * int(trl.steps_per_generation or cfg.gradient_accumulation_steps)


def global_step_batch(cfg: GRPOConfig, world: int | None = None) -> int:
    """Completions one optimizer step trains on, over all processes (TRL's
    effective batch: per-device batch x accumulation x processes)."""
    return cfg.micro_batch_size * cfg.gradient_accumulation_steps * _world(world)


def steps_per_generation(cfg: GRPOConfig, world: int | None = None) -> int:
    """Optimizer steps one generation batch feeds, per iteration. The config
    checks refuse a generation batch that is not a whole number (>= 1) of
    optimizer steps, so this divides exactly."""
    return max(1, generation_batch_size(cfg, world) // global_step_batch(cfg, world))


def steps_per_batch(cfg: GRPOConfig, world: int | None = None) -> int:
    """Optimizer steps between two generations: every slice, ``num_iterations`` times."""
    return steps_per_generation(cfg, world) * int(cfg.trl.num_iterations or 1)


def _world(world: int | None) -> int:
    return max(1, int(world)) if world is not None else world_size()

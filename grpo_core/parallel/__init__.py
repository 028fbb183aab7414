"""Training backends: how the policy is spread over the training processes.

Each backend is one module implementing
:class:`~grpo_core.parallel.base.TrainingBackend` (accelerate's
plugins, backward and the optimizer step, the full weights for syncs and
saves, the checkpoint layout), and one entry of :data:`BACKENDS`. The trainer
calls the interface and never asks which backend runs; adding one (say,
hybrid-sharded FSDP over a 2-D mesh) is a new module here and its entry.
"""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.host.traits import ChosenTraits
from grpo_core.parallel.base import CheckpointParts, TrainingBackend
from grpo_core.parallel.deepspeed_zero import DeepSpeedBackend
from grpo_core.parallel.fsdp import FsdpBackend
from grpo_core.parallel.replicated import ReplicatedBackend

__all__ = ["BACKENDS", "CheckpointParts", "TrainingBackend", "backend_for", "config_problems"]

BACKENDS: tuple[type[TrainingBackend], ...] = (DeepSpeedBackend, FsdpBackend, ReplicatedBackend)
"""Tried in order: the first whose ``applies(cfg, world)`` is true runs."""


def backend_for(cfg: GRPOConfig, world: int) -> type[TrainingBackend]:
    """The backend class that runs ``cfg`` on ``world`` processes."""
    return next(backend for backend in BACKENDS if backend.applies(cfg, world))


def config_problems(cfg: GRPOConfig, traits: ChosenTraits) -> list[str]:
    """Every backend's problems with ``cfg`` (each answers only for the keys
    that choose it): the ``backend_rules`` of
    :func:`~grpo_core.validation.checks.check_config`."""
    return [problem for backend in BACKENDS for problem in backend.config_problems(cfg, traits)]

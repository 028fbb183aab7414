"""One process, or DDP: every rank holds the whole policy.

accelerate owns backward (DDP all-reduces the gradients in it) and the
clipping; the policy itself is the full model a sync or a save reads, and a
checkpoint is the model and ``optimizer.pt`` as one process writes them
(an FSDP checkpoint, keyed by parameter name, loads here too).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.config.schema import GRPOConfig
from grpo_core.host.traits import ChosenTraits
from grpo_core.optimization.policy_forward import inner_policy
from grpo_core.parallel.base import (
    CheckpointParts,
    clip_and_step,
    gloo_on_cpu,
    prepare_with_accelerate,
    refuse_partitioned,
)
from grpo_core.parallel.sharding import optimizer_state_by_index


class ReplicatedBackend:
    name: ClassVar[str] = "replicated"

    @classmethod
    def applies(cls, cfg: GRPOConfig, world: int) -> bool:
        return True  # the table's last entry: what no sharding backend takes

    @classmethod
    def describe(cls, cfg: GRPOConfig, world: int) -> str:
        if world > 1:
            return "DDP: a full replica per process"
        if cfg.fsdp:
            return "one process (fsdp has nothing to shard over: training unsharded; checkpoints load either way)"
        return "one process"

    @classmethod
    def config_problems(cls, cfg: GRPOConfig, traits: ChosenTraits) -> list[str]:
        return []  # a full replica per process runs whatever one process runs

    @classmethod
    def accelerator_kwargs(cls, cfg: GRPOConfig, world: int) -> dict[str, Any]:
        return gloo_on_cpu(world)

    def __init__(self, cfg: GRPOConfig, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.policy: Any = None
        self.forward: Any = None
        self.optimizer: Any = None

    def prepare(self, policy: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        self.forward, self.optimizer = prepare_with_accelerate(self.accelerator, policy, optimizer)
        self.policy = inner_policy(self.forward)
        return self.forward, self.optimizer

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.accelerator.backward(loss)

    def optimizer_step(self, max_grad_norm: float | None) -> float:
        return clip_and_step(self.accelerator, self.policy, self.optimizer, max_grad_norm)

    def full_model(self, version: int) -> Any:
        return self.policy

    def sampling_model(self, device: Any) -> Any:
        return self.policy

    @classmethod
    def gathers_for_generation(cls, cfg: GRPOConfig) -> bool:
        return True  # every rank holds the whole policy

    def generation_model(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(self.policy)

    def checkpoint_parts(self, staging: Path, version: int) -> CheckpointParts:
        return CheckpointParts(model=self.policy, optimizer=self.optimizer)

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint) -> None:
        refuse_partitioned(path, loaded)
        ckpt.load_model_weights(self.policy, path)
        loaded.optimizer = optimizer_state_by_index(self.forward, self.optimizer, loaded.optimizer)

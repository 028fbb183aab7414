"""FSDP on several processes: each rank holds a shard of every parameter,
gradient and optimizer state (accelerate's FSDP2 path, torch's ``fully_shard``;
the options are :mod:`grpo_core.parallel.sharding`'s).

No rank holds the policy whole, so rank 0 keeps an unsharded copy made before
sharding (:class:`~grpo_core.parallel.sharding.FullWeights`), refreshed from the
shards once per policy version: what syncs, checkpoints and the final save
read, and what a rollout that samples the trainer's model generates with on
rank 0 alone (evaluation). A rollout that generates on every rank samples
with the sharded policy itself, every FSDP2 unit unsharded for the call
(:func:`~grpo_core.parallel.sharding.unsharded`). Checkpoints hold full tensors
(the optimizer state keyed by parameter name), so they load onto any process
count, sharded or not.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.config.fsdp_options import fsdp_problems, fsdp_value
from grpo_core.config.schema import GRPOConfig
from grpo_core.host.traits import ChosenTraits
from grpo_core.parallel.base import (
    CheckpointParts,
    StateOf,
    gloo_on_cpu,
    refuse_partitioned,
)
from grpo_core.parallel.replicated import ReplicatedBackend
from grpo_core.parallel.sharding import (
    FullWeights,
    enable_fsdp_on_cpu,
    fsdp_plugin,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    optimizer_state_by_name,
    sampling_copy,
    unsharded,
)


class FsdpBackend(ReplicatedBackend):
    """Backward and the step as :class:`ReplicatedBackend` does them
    (accelerate's FSDP2 reduces and clips the sharded gradients); the full
    weights, checkpoints and resume from rank 0's copy."""

    name: ClassVar[str] = "fsdp"

    @classmethod
    def applies(cls, cfg: GRPOConfig, world: int) -> bool:
        return bool(cfg.fsdp) and world > 1  # one process has nothing to shard over: replicated

    @classmethod
    def describe(cls, cfg: GRPOConfig, world: int) -> str:
        return "FSDP " + " ".join(cfg.fsdp or [])

    @classmethod
    def config_problems(cls, cfg: GRPOConfig, traits: ChosenTraits) -> list[str]:
        """Options accelerate's plugin cannot take, and combinations that need
        the unsharded model in one process."""
        if not (cfg.fsdp or cfg.fsdp_config):
            return []
        problems = fsdp_problems(cfg)
        if cfg.fsdp and float(cfg.trl.beta or 0) > 0:
            problems.append(
                "fsdp with trl.beta > 0: the KL reference model is not sharded (not implemented); set "
                "trl.beta = 0 or train without fsdp (DDP keeps a full replica per process)."
            )
        return problems

    @classmethod
    def accelerator_kwargs(cls, cfg: GRPOConfig, world: int) -> dict[str, Any]:
        return {"fsdp_plugin": fsdp_plugin(cfg), **gloo_on_cpu(world)}

    def __init__(self, cfg: GRPOConfig, accelerator: Any) -> None:
        super().__init__(cfg, accelerator)
        enable_fsdp_on_cpu(accelerator, fsdp_plugin(cfg))  # accelerate enables FSDP for GPU backends only
        self.full: FullWeights | None = None

    def prepare(self, policy: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        self.full = FullWeights(policy, self.accelerator.is_main_process)  # before the shards replace the weights
        return super().prepare(policy, optimizer)

    def full_model(self, version: int) -> Any:
        assert self.full is not None, "prepare() first"
        return self.full.refresh(self.accelerator, self.forward, version)

    def sampling_model(self, device: Any) -> Any:
        assert self.full is not None, "prepare() first"
        return sampling_copy(self.full, device)

    @classmethod
    def gathers_for_generation(cls, cfg: GRPOConfig) -> bool:
        return int(fsdp_value(cfg, "version", 2) or 2) == 2  # FSDP1 (fsdp_version = 1): rank 0 samples with its copy

    def generation_model(self) -> contextlib.AbstractContextManager[Any]:
        return unsharded(self.forward, self.policy)

    def checkpoint_parts(self, staging: Path, version: int) -> CheckpointParts:
        model = self.full_model(version)
        return CheckpointParts(model=model, optimizer=StateOf(full_optimizer_state(self.forward, self.optimizer)))

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint) -> None:
        """Rank 0 reads the full weights, every rank takes its shards."""
        refuse_partitioned(path, loaded)
        assert self.full is not None, "prepare() first"
        main = self.full.copy is not None
        if main:
            ckpt.load_model_weights(self.full.copy, path)
        load_full_model_state(self.forward, self.full.copy.state_dict() if main else None)
        # an unsharded run's checkpoint (one process, DDP) keys the state by position, FSDP's by name
        by_name = optimizer_state_by_name(self.forward, self.optimizer, loaded.optimizer)
        load_full_optimizer_state(self.forward, self.optimizer, by_name)
        loaded.optimizer = self.optimizer.state_dict()  # already in place: restore_checkpoint restores the rest

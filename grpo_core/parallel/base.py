"""What every training backend provides: the contract between the loop and
the way the policy is spread over the training processes.

The trainer (:mod:`grpo_core.training.trainer`) never asks which backend
runs: it calls these methods, and each backend module
(:mod:`~grpo_core.parallel.replicated`,
:mod:`~grpo_core.parallel.fsdp`,
:mod:`~grpo_core.parallel.deepspeed_zero`) answers for its layout.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import GrpoError
from grpo_core.host.traits import ChosenTraits
from grpo_core.optimization.policy_forward import PolicyLogprobs

PARTITIONED_KEY = "deepspeed_world_size"
"""The checkpoint ``extra`` key under which a backend whose weights and
optimizer state are per-rank partitions (DeepSpeed ZeRO) records the process
count that wrote them; a backend that reads full tensors refuses such a
checkpoint by it (:func:`refuse_partitioned`)."""


@dataclass
class CheckpointParts:
    """What one checkpoint holds of the backend's state, for
    :func:`~grpo_core.checkpointing.checkpoint.save_checkpoint` on rank 0."""

    model: Any  # what ``model/`` is written from: the policy with its full weights (rank 0)
    optimizer: Any  # an object whose ``state_dict()`` is ``optimizer.pt``
    staged: dict[str, Path] = field(default_factory=dict)  # folders already written, moved in as they are
    extra: dict[str, Any] = field(default_factory=dict)  # entries of the checkpoint's extra state


class TrainingBackend(Protocol):
    """How the policy is spread over the training processes, and everything
    that depends on it: accelerate's plugins, backward and the optimizer
    step, where the full weights come from for a sync or a save, and the
    checkpoint layout.

    A backend's life in a run (:func:`grpo_core.training.run`):
    :func:`~grpo_core.parallel.backend_for` picks its class by
    :meth:`applies`; :meth:`accelerator_kwargs` configures accelerate; the
    class is built with the accelerator *before* the model loads;
    :meth:`prepare` takes the loaded policy and its optimizer and returns
    what accelerate prepared; the trainer then calls the rest. Every method
    marked *collective* is called by every rank together.
    """

    name: ClassVar[str]
    """How the log names it (``process 0 of 2 (<sharding>, cpu)`` uses the config's own words)."""

    @classmethod
    def applies(cls, cfg: GRPOConfig, world: int) -> bool:
        """This backend runs ``cfg`` on ``world`` processes."""
        ...

    @classmethod
    def describe(cls, cfg: GRPOConfig, world: int) -> str:
        """How it spreads the policy over ``world`` processes, in the config's
        own words: the run's first log line and ``grpo config check`` say it."""
        ...

    @classmethod
    def config_problems(cls, cfg: GRPOConfig, traits: ChosenTraits) -> list[str]:
        """What in ``cfg`` this backend cannot run, each naming the key and
        the fix; ``[]`` when ``cfg`` does not ask for this backend. Judged
        whatever the process count (``grpo config check`` runs before any
        process starts), with what the chosen implementations declare
        (``traits``): ``grpo run`` and ``grpo config check`` report these
        beside the config's other problems."""
        ...

    @classmethod
    def accelerator_kwargs(cls, cfg: GRPOConfig, world: int) -> dict[str, Any]:
        """Keyword arguments for :class:`accelerate.Accelerator` (its plugins)."""
        ...

    def __init__(self, cfg: GRPOConfig, accelerator: Any) -> None:
        """Built before the model loads (a backend may have to tell the loader how)."""

    def prepare(self, policy: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        """The loaded ``policy`` and its ``optimizer`` through accelerate: the
        prepared :class:`~grpo_core.optimization.policy_forward.PolicyLogprobs`
        (wrapped by DDP, FSDP or DeepSpeed) and the prepared optimizer."""
        ...

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's (pre-scaled) loss; ``last``: the step's
        last trained micro-batch, where gradients are reduced."""
        ...

    def optimizer_step(self, max_grad_norm: float | None) -> float:
        """Clip and step (the caller zeroes the gradients); the global pre-clip gradient norm."""
        ...

    def full_model(self, version: int) -> Any:
        """*Collective.* The policy with its full weights at ``version``, on
        rank 0: what weight syncs, checkpoints and the final save read."""
        ...

    def sampling_model(self, device: Any) -> Any:
        """The model a rollout that samples the trainer's model generates with
        (``SAMPLES_TRAINER_MODEL``) on rank 0 alone (evaluation, ``async_prefetch``,
        a rollout that does not generate on every rank): the policy itself, or where no
        rank holds it whole, a full copy on ``device`` that :meth:`full_model`
        keeps current. ``None`` on ranks that never sample."""
        ...

    @classmethod
    def gathers_for_generation(cls, cfg: GRPOConfig) -> bool:
        """Every rank can hold the whole policy for a generation call
        (:meth:`generation_model`): a rollout that samples the trainer's model
        and declares ``generates_on_every_rank`` then samples a share of each
        call on every rank (:mod:`grpo_core.generation.spread`)
        instead of on rank 0 alone with :meth:`sampling_model`."""
        ...

    def generation_model(self) -> contextlib.AbstractContextManager[Any]:
        """*Collective.* The policy, usable whole on this rank for the block
        (FSDP2: unsharded, ZeRO-3: parameters gathered, a replica: as it is)
        and needing no collective inside it, so each rank generates its own
        prompts for as many steps as they take; sharded again after."""
        ...

    def checkpoint_parts(self, staging: Path, version: int) -> CheckpointParts:
        """*Collective.* What a checkpoint holds of this backend's state, with
        the weights of policy ``version``; ``staging`` is a fresh folder this backend may
        write per-rank files under (moved into the checkpoint)."""
        ...

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint) -> None:
        """*Collective.* Put checkpoint ``path``'s weights and optimizer state
        in place, or refuse a layout this backend cannot read. Leaves in
        ``loaded.optimizer`` what :func:`~grpo_core.checkpointing.checkpoint.restore_checkpoint`
        should still load (``None``: restored already)."""
        ...


def prepare_with_accelerate(accelerator: Any, policy: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
    """The policy's log-prob module and the optimizer, through ``accelerator.prepare``."""
    return accelerator.prepare(PolicyLogprobs(policy), optimizer)


def gloo_on_cpu(world: int) -> dict[str, Any]:
    """Without GPUs accelerate is told ``cpu=True`` so that several processes
    join over gloo (otherwise each would quietly run alone)."""
    return {"cpu": True} if world > 1 and not torch.cuda.is_available() else {}


def clip_and_step(accelerator: Any, model: torch.nn.Module, optimizer: Any, max_grad_norm: float | None) -> float:
    """accelerate's clipping (the all-reduced gradients' global norm), then
    the optimizer's step: what a backend without its own engine does. A norm
    that is not finite skips the step (every rank sees the same global norm),
    so NaN gradients never reach the weights; the trainer then stops the run."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = accelerator.clip_grad_norm_(params, max_grad_norm or float("inf"))
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
    if math.isfinite(value):
        optimizer.step()
    return value


def refuse_partitioned(path: Path, loaded: ckpt.LoadedCheckpoint) -> None:
    """A checkpoint of per-rank partitions (:data:`PARTITIONED_KEY`) cannot
    load into full tensors: say how to resume it."""
    if PARTITIONED_KEY in loaded.extra:
        raise GrpoError(
            f'resume_from_checkpoint = "{path}" was written with `deepspeed` (ZeRO partitions of '
            f"{loaded.extra[PARTITIONED_KEY]} process(es)): resume it with the same `deepspeed` "
            "config and process count."
        )


class StateOf:
    """An object whose ``state_dict()`` is a given dict (for save_checkpoint)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

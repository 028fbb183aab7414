"""What a run does differently with several training processes.

grpo does not launch or connect processes itself: ``accelerate launch``,
``torchrun`` (or ``grpo run --num-processes N``, which calls accelerate's
launcher) start N copies of ``grpo run``, and accelerate's
:class:`~accelerate.Accelerator` joins them (NCCL on GPUs, gloo on CPU).
This module holds the few collectives the loop needs on top of the
gradient all-reduce that DDP/FSDP/DeepSpeed already do:

* :meth:`Distributed.scatter`: rank 0 alone talks to the inference engine
  and the reward functions; it cuts each scored batch into N shares of
  *whole* groups (advantages are per group) and sends each rank its own
  (and, for a rollout that samples the trainer's model, each generation
  call's share of prompts first: :mod:`grpo_core.generation.spread`).
* :meth:`Distributed.sum` / :meth:`Distributed.any`: the global token count
  of token-normalised losses, and the per-micro-batch "does any rank have a
  learning signal" decision, so every rank runs the same backward passes
  (a rank that skipped one would leave the others waiting in its all-reduce).
* :meth:`Distributed.mean_metrics`: per-step metrics reduced over ranks.

Only the trainer's main thread calls these; the prefetch thread never issues
a collective (a background collective is how async prefetch deadlocks under
FSDP/ZeRO-3), it only produces on rank 0.

Batch shapes (TRL's definitions): ``micro_batch_size`` is per process
(TRL's ``per_device_train_batch_size``); one optimizer step trains on
``micro_batch_size x gradient_accumulation_steps x N`` completions across
the N processes; ``trl.generation_batch_size`` is global (default
``micro_batch_size x N x steps_per_generation``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.contract.types import ScoredGroup
from grpo_core.runtime.processes import launched_by_launcher, process_rank, world_size

__all__ = ["Distributed", "launched_by_launcher", "process_rank", "shares", "world_size"]


def shares(groups: list[ScoredGroup], world: int) -> list[list[ScoredGroup]]:
    """``groups`` cut, in order, into ``world`` contiguous shares of whole
    groups. The config checks make the count divide evenly, so every rank
    has the same number of samples and hence of micro-batches."""
    if len(groups) % world:
        raise RuntimeError(f"{len(groups)} scored groups cannot be split evenly over {world} processes")
    size = len(groups) // world
    return [groups[r * size : (r + 1) * size] for r in range(world)]


@dataclass
class Distributed:
    """The run's process group as the trainer sees it (one process: every
    call is the identity, no collective runs)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def from_accelerator(cls, accelerator: Any) -> Distributed:
        return cls(rank=int(accelerator.process_index), world=int(accelerator.num_processes))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; small things only)."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def scatter(self, per_rank: list[Any] | None) -> Any:
        """Rank 0 passes one object per rank; each rank gets its own."""
        if not self.active:
            assert per_rank is not None
            return per_rank[0]
        out: list[Any] = [None]
        torch.distributed.scatter_object_list(out, per_rank if self.is_main else None, src=0)
        return out[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum(self, value: float) -> float:
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return float(t.item())

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over ranks (same length on every rank)."""
        if not self.active or not flags:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def mean_metrics(self, metrics: dict[str, float], summed: tuple[str, ...] = ()) -> dict[str, float]:
        """Each key averaged over the ranks that report it (``summed`` keys
        added instead)."""
        if not self.active:
            return metrics
        merged: dict[str, list[float]] = {}
        for part in self.gather(metrics):
            for key, value in part.items():
                merged.setdefault(key, []).append(float(value))
        return {k: (sum(v) if k in summed else sum(v) / len(v)) for k, v in merged.items()}

    def on_main(self, func: Callable[[], Any]) -> Any:
        """Run ``func`` on rank 0 only; the other ranks wait for it at a barrier."""
        result = func() if self.is_main else None
        self.barrier()
        return result


@contextlib.contextmanager
def process_group_left_on_exit() -> Iterator[None]:
    """Destroy the process group this process joined when the block ends,
    however it ends. Left to interpreter shutdown, gloo's worker threads can
    be torn down while still joinable, and the process dies with
    ``terminate called without an active exception`` (SIGABRT) after a
    clean stop: the launcher then reports a crash instead of the run's own
    exit code."""
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with contextlib.suppress(Exception):  # leaving: a peer that is gone is not this process's error
                torch.distributed.destroy_process_group()

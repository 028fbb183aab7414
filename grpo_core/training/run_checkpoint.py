"""What a run saves at a step, and what a resume restores.

*Exact* resume means: the resumed run trains on the very same batches
(prompts, completion token ids, sampler log-probs, rewards, advantages, the
policy version each was sampled with) in the same order, with the same old
log-probs, so its per-step metrics and final weights equal those of the run
that never stopped.

Two kinds of batch are already made when a checkpoint is taken: the one later
steps still train on (``num_iterations`` or ``steps_per_generation > 1``), and,
with ``async_prefetch``, the ones the prefetch thread finished ahead of
training. Both are saved, and with partial rollouts the samples carried over to
the next batch; a batch the thread is still making is finished first
(the state is read inside
:meth:`~grpo_core.generation.producer.PrefetchingProducer.paused`), so the saved
batches, the prompt stream and the replay state stand at the same point. On
resume the prefetched batches are handed out before anything is generated.
What a resume cannot restore is the engine's weights: it syncs the resumed
policy, which is what the engine held in the straight run only if the
checkpoint step had a weight sync (``vllm_sync_interval`` divides
``save_steps``).

With several processes the pending batch is saved whole (every rank's share,
in rank order) with each rank's old log-probs, so a resume onto the same
process count is exact and one onto another count re-splits the batch (its
PPO ratios then restart from the resumed policy, with a warning); batches made
ahead are rank 0's, saved whole and scattered again when handed out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.generation.producer import ScoredBatch
from grpo_core.runtime.distributed import shares

if TYPE_CHECKING:
    import torch

    from grpo_core.contract.types import Checkpointable
    from grpo_core.generation.producer import Producer
    from grpo_core.parallel import TrainingBackend
    from grpo_core.runtime.distributed import Distributed


@dataclass
class LoopPosition:
    """The loop's own counters, as a checkpoint records them."""

    step: int = 0
    policy_version: int = 0
    skipped_zero_adv_batches: int = 0
    skipped_zero_adv_samples: int = 0
    stream: dict[str, Any] = field(default_factory=dict)  # the prompt stream after the batch in training


@dataclass
class Resumed:
    """What a checkpoint gives back to the loop: its position, and the batch
    later steps still train on (this rank's share) with its saved old
    log-probs (None: recompute them)."""

    position: LoopPosition
    pending: ScoredBatch | None
    old_logps: list[torch.Tensor | None] | None


class RunCheckpoints:
    """Writes and reads a run's checkpoints: the backend's weights and
    optimizer layout, the scheduler, the plugins' state, the prompt stream,
    and the batches already made."""

    def __init__(
        self,
        output_dir: str | Path,
        backend: TrainingBackend,
        dist: Distributed,
        producer: Producer,
        stateful: dict[str, Checkpointable],
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        save_total_limit: int | None,
        max_steps: int,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit  # the oldest checkpoints beyond it are deleted
        self.max_steps = max_steps  # recorded in each checkpoint's trainer state
        self.backend = backend
        self.dist = dist
        self.producer = producer
        self.stateful = stateful
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.scheduler = scheduler

    # ---------------------------------------------------------------- save

    def save(
        self, position: LoopPosition, pending: ScoredBatch | None, old_logps: list[torch.Tensor | None] | None
    ) -> Path:
        """Checkpoint at ``position`` (every rank calls this; rank 0 writes,
        the others wait). ``pending``: the batch later steps still train on,
        with its micro-batches' old log-probs."""
        with self.producer.paused():
            return self._save(position, self._readable(pending, position.step), old_logps)

    def _save(
        self, position: LoopPosition, pending: ScoredBatch | None, old_logps: list[torch.Tensor | None] | None
    ) -> Path:
        # The policy the pending batch's updates started from is gone once
        # the weights moved: keep its log-probs, or a resumed PPO ratio is 1.
        old_logps = (
            [None if o is None else o.cpu() for o in old_logps]
            if pending is not None and old_logps is not None
            else None
        )
        if self.dist.active:
            gathered = self.dist.gather((pending, old_logps))
            if any(p is None for p, _ in gathered):
                pending, old_logps = None, None
            else:
                pending = replace(gathered[0][0], groups=[g for p, _ in gathered for g in p.groups])
                old_logps = [o for _, o in gathered]
        staging = self.output_dir / f".tmp-{ckpt.PREFIX}{position.step}-{self.backend.name}"  # per-rank files, if any
        state = self.backend.checkpoint_parts(staging, position.policy_version)
        path = self.output_dir / f"{ckpt.PREFIX}{position.step}"
        if self.dist.is_main:
            extra = {name: ckpt.plugin_state(name, obj) for name, obj in self.stateful.items()}
            extra["pending_batch"] = pending
            extra["pending_old_logps"] = old_logps
            extra["pending_world_size"] = self.dist.world
            extra["prefetched_batches"] = self._prefetched_batches(position.step)
            extra["partial_rollouts"] = self._partial_rollouts(position.step)
            extra.update(state.extra)
            path = ckpt.save_checkpoint(
                self.output_dir,
                position.step,
                state.model,
                self.tokenizer,
                state.optimizer,
                self.scheduler,
                self.trainer_state(position),
                extra,
                self.save_total_limit,
                extra_dirs=state.staged,
            )
        self.dist.barrier()
        return path

    def trainer_state(self, position: LoopPosition) -> dict[str, Any]:
        return {
            "policy_version": position.policy_version,
            "skipped_zero_adv_batches": position.skipped_zero_adv_batches,
            "skipped_zero_adv_samples": position.skipped_zero_adv_samples,
            "stream": position.stream,
            "max_steps": self.max_steps,
        }

    @staticmethod
    def _readable(pending: ScoredBatch | None, step: int) -> ScoredBatch | None:
        """The pending batch, unless it cannot be read back without running
        code (a dataset column of a type such as ``datetime``): then it is
        left out with a warning, and resuming samples a fresh batch."""
        if pending is None:
            return None
        reason = ckpt.unloadable_reason(pending)
        if reason is None:
            return pending
        warnings.warn(
            f"checkpoint at step {step} leaves out the batch still being trained on: it holds {reason}, "
            "which loading would need code to rebuild. Resuming from it samples a new batch (not an exact resume).",
            stacklevel=3,
        )
        return None

    def _prefetched_batches(self, step: int) -> list[ScoredBatch]:
        """The batches the producer made ahead of training (``async_prefetch``),
        oldest first. From the first one that could not be read back without
        running code on, they are left out with a warning (resuming makes
        them again: not an exact resume)."""
        batches = self.producer.prefetched()
        for i, batch in enumerate(batches):
            reason = ckpt.unloadable_reason(batch)
            if reason is not None:
                warnings.warn(
                    f"checkpoint at step {step} leaves out {len(batches) - i} batch(es) generated ahead of "
                    f"training: one holds {reason}, which loading would need code to rebuild. Resuming from it "
                    "generates them again (not an exact resume).",
                    stacklevel=3,
                )
                return batches[:i]
        return batches

    def _partial_rollouts(self, step: int) -> Any:
        """The samples partial rollouts carry over to the next batch (exact
        ids, sampler log-probs, per-token versions), standing where the
        prefetched batches stand; left out with a warning only if they could
        not be read back without running code (resuming then starts those
        prompts again: not an exact resume)."""
        state = self.producer.partial_state()
        reason = ckpt.unloadable_reason(state) if state else None
        if reason is None:
            return state
        warnings.warn(
            f"checkpoint at step {step} leaves out the unfinished samples of partial rollouts: they hold {reason}, "
            "which loading would need code to rebuild. Resuming from it does not continue them (not an exact resume).",
            stacklevel=3,
        )
        return None

    # ---------------------------------------------------------------- resume

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint | None, stream: Any) -> Resumed:
        """Restore weights, optimizer, scheduler, the plugins' state and the
        prompt stream from checkpoint ``path`` (``loaded``: its
        :func:`~grpo_core.checkpointing.checkpoint.read_checkpoint` result when
        the caller checked it early); the producer gets its prefetched batches
        back. Returns the loop's position and this rank's pending batch."""
        loaded = loaded or ckpt.read_checkpoint(path)
        self.backend.resume(path, loaded)  # weights and optimizer state, in the backend's layout
        ckpt.restore_checkpoint(loaded, self.optimizer, self.scheduler)
        state, extra = loaded.trainer_state, loaded.extra
        position = LoopPosition(
            step=int(state["step"]),
            policy_version=int(state["policy_version"]),
            skipped_zero_adv_batches=int(state.get("skipped_zero_adv_batches", 0)),
            skipped_zero_adv_samples=int(state.get("skipped_zero_adv_samples", 0)),
            stream=state.get("stream") or {},
        )
        if position.stream:
            stream.load_state_dict(position.stream)
        for name, obj in self.stateful.items():
            if name in extra:
                obj.load_state_dict(extra[name])
        pending, old_logps = self._pending_share(extra)
        # After the stream: restoring moves it past these batches.
        self.producer.restore(list(extra.get("prefetched_batches") or []))
        self.producer.restore_partial(extra.get("partial_rollouts"))
        return Resumed(position, pending, old_logps)

    def _pending_share(self, extra: dict[str, Any]) -> tuple[ScoredBatch | None, list[Any] | None]:
        """This rank's share of the saved pending batch and, where the process
        count is the one it was saved with, its old log-probs."""
        pending = extra.get("pending_batch")
        if pending is None:
            return None, None
        old_logps = extra.get("pending_old_logps")
        saved_world = int(extra.get("pending_world_size", 1))
        if saved_world > 1:  # one list per rank
            old_logps = old_logps[self.dist.rank] if saved_world == self.dist.world else None
        elif self.dist.world > 1:
            old_logps = None
        if old_logps is None and saved_world != self.dist.world:
            warnings.warn(
                f"the checkpoint was taken with {saved_world} process(es) in the middle of a batch and this run "
                f"has {self.dist.world}: the batch is re-split and its PPO ratios start from the resumed "
                "policy (not an exact resume; a checkpoint at a batch boundary resumes exactly)",
                stacklevel=3,
            )
        if self.dist.active:
            pending = replace(pending, groups=shares(pending.groups, self.dist.world)[self.dist.rank])
        return pending, old_logps

"""The safety net of a run: what no rule foresaw still ends in one line.

:func:`~grpo_core.training.run.run_training` names each phase of a run
(:meth:`SafetyNet.phase`: loading data, loading the model, ...) and, once the
trainer exists, :meth:`SafetyNet.watch` wraps its parts on the instance (as
the progress bar does, :mod:`grpo_core.training.observe`; the loop itself is
untouched) so an exception is tagged with the step and what the step was
doing: generating, scoring, training, syncing the weights, saving a
checkpoint, reporting. When an exception escapes the run:

* a checkpoint is saved where the phase allows it, as a SIGTERM does: the
  state between two steps (generating or scoring the next batch, syncing or
  reporting a finished step), never in the middle of an update or of a
  failed save, and never twice for one step;
* its traceback goes to ``output_dir/grpo-error.log``;
* it reaches the user as one line (:meth:`SafetyNet.report`): a
  :class:`~grpo_core.contract.errors.GrpoError` keeps its message and exit
  code, extended with the phase and the traceback file when code raised it;
  anything else becomes an :class:`~grpo_core.contract.errors.UnexpectedFailure`
  whose exit code says its class (out of memory, a system call, a bug).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from grpo_core.checkpointing.checkpoint import list_checkpoints
from grpo_core.contract.errors import GrpoError, TrainingInterrupted
from grpo_core.runtime import failure

SAYS_CHECKPOINT = re.compile(r"checkpoint saved to|no checkpoint", re.IGNORECASE)


class SafetyNet:
    """One run's phases, its failure checkpoint and its last line."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.trainer: Any = None
        self.start_step = 0
        self.saved: tuple[int, Path] | None = None  # the last successful save: (step, path)
        self.not_saved = ""  # why no checkpoint was taken at the failure, for the last line
        self.save_error: BaseException | None = None

    # ------------------------------------------------------------------ phases

    @contextlib.contextmanager
    def phase(self, where: str) -> Iterator[None]:
        """Tag an exception raised inside the block with ``where`` (a phase
        before training: nothing is checkpointed there)."""
        try:
            yield
        except BaseException as exc:
            failure.tag(exc, where)
            raise

    def watch(self, trainer: Any) -> None:
        """Tag what the trainer does, step by step (after a resume: its step
        is where this run starts)."""
        self.trainer = trainer
        self.start_step = int(trainer.step)
        parts = trainer.parts

        def in_flight() -> str:  # the step being made
            return f"step {trainer.step + 1}"

        def done() -> str:  # the step just made
            return f"step {trainer.step}" if trainer.step > self.start_step else f"before step {trainer.step + 1}"

        parts.producer.produce = self._tagged(parts.producer.produce, lambda: f"{in_flight()}, generating", True)
        if hasattr(parts.scorer, "score"):
            parts.scorer.score = self._tagged(parts.scorer.score, lambda: f"{in_flight()}, scoring", True)
        trainer._train_step = self._tagged(trainer._train_step, lambda: f"{in_flight()}, training", False)
        trainer.sync_weights = self._tagged(trainer.sync_weights, lambda: f"{done()}, syncing the weights", True)
        trainer.save = self._saving(trainer.save, lambda: f"{done()}, saving a checkpoint")
        if parts.observer is not None:
            parts.observer.step_end = self._tagged(
                parts.observer.step_end, lambda: f"{done()}, reporting (logging, evaluating)", True
            )
        trainer.train = self._tagged(trainer.train, lambda: f"{done()}, between steps", True)

    def _tagged(self, func: Callable[..., Any], where: Callable[[], str], can_save: bool) -> Callable[..., Any]:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except BaseException as exc:
                failure.tag(exc, where(), can_save)
                raise

        return call

    def _saving(self, save: Callable[[], Path], where: Callable[[], str]) -> Callable[[], Path]:
        @functools.wraps(save)
        def call() -> Path:
            try:
                path = save()
            except BaseException as exc:
                failure.tag(exc, where(), False)
                raise
            self.saved = (int(self.trainer.step), Path(path))
            return path

        return call

    # ------------------------------------------------------------------ failure

    def on_failure(self, exc: BaseException) -> None:
        """Called inside the run while ``exc`` escapes it (the trainer and the
        engine still up): save a checkpoint if the phase allows and none of
        this step exists yet; otherwise remember why not."""
        trainer = self.trainer
        if trainer is None:
            self.not_saved = "nothing was trained yet"
            return
        step = int(trainer.step)
        if self.saved is not None and self.saved[0] == step:
            return  # already saved at this step (save_steps, or the loop's own failure handling)
        if isinstance(exc, TrainingInterrupted):
            return
        if step <= self.start_step:
            self.not_saved = "nothing was trained in this run yet"
            return
        if not failure.can_save_after(exc):
            where = failure.where_of(exc) or ""
            self.not_saved = (
                "the checkpoint save itself failed"
                if "saving" in where
                else f"the failure came in the middle of step {step + 1}'s update, so the state is not one to save"
            )
            return
        if trainer.dist.active:
            self.not_saved = "a run of several processes saves together, and the others may not be able to"
            return
        try:
            trainer.save()
        except Exception as save_exc:  # reported with the failure; the failure is what ended the run
            self.save_error = save_exc
            self.not_saved = f"saving one failed too: {type(save_exc).__name__}: {failure.one_line(save_exc, 300)}"

    def _checkpoint_sentence(self) -> str:
        step = None if self.trainer is None else int(self.trainer.step)
        if self.saved is not None and self.saved[0] == step:
            path = self.saved[1]
            return f'Checkpoint of step {step} saved to {path}: resume with resume_from_checkpoint = "{path}".'
        why = f"No checkpoint was saved ({self.not_saved})." if self.not_saved else "No checkpoint was saved."
        existing = list_checkpoints(self.output_dir)
        if existing:
            return f'{why} The latest checkpoint is {existing[-1]}: resume_from_checkpoint = "{existing[-1]}".'
        return why

    def report(self, exc: BaseException) -> BaseException:
        """The error that ends the run, as the user sees it: one line."""
        if isinstance(exc, TrainingInterrupted) or failure.reported(exc):
            return exc
        where = failure.where_of(exc)
        if isinstance(exc, GrpoError):
            if self.trainer is not None and not SAYS_CHECKPOINT.search(str(exc)):  # the loop says what it saved
                exc.args = (f"{str(exc).rstrip()} {self._checkpoint_sentence()}", *exc.args[1:])
            return failure.annotate(exc, self.output_dir, where)
        checkpoint = self._checkpoint_sentence() if self.trainer is not None else ""
        return failure.unexpected(exc, self.output_dir, where, checkpoint)

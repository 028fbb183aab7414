"""Everything a run reports about itself, behind three calls from the
trainer loop: :meth:`RunObserver.start`, :meth:`RunObserver.step_end` and
:meth:`RunObserver.close`.

Per optimizer step, in order: evaluation when due
(:mod:`grpo_core.generation.evaluation`), health alerts (:mod:`grpo_core.observability.alerts`),
``metrics.jsonl`` and the progress bar
(:class:`~grpo_core.observability.logging.MetricsLogger`), the trackers
(:mod:`grpo_core.observability.tracking`), the completion log (``trl.log_completions``) and
the printed sample table (``trl.num_completions_to_print``). The progress
bar also shows the phase of the step in flight (generating, scoring,
training, syncing, evaluating).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.config.eval_schedule import eval_enabled, eval_every
from grpo_core.generation.evaluation import eval_rows, eval_sampling, evaluate
from grpo_core.observability.alerts import HealthMonitor
from grpo_core.observability.logging import MetricsLogger, print_completions
from grpo_core.observability.tracking import CompletionLog, TrackerSet, completion_rows

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import Prompt
    from grpo_core.host.plugin_host import PluginHost


class RunObserver:
    def __init__(
        self,
        cfg: GRPOConfig,
        trackers: TrackerSet | None = None,
        eval_prompts: list[Prompt] | None = None,
        stop_ids: list[int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.trackers = trackers or TrackerSet({})
        self.eval_prompts = list(eval_prompts or [])
        self.stop_ids = list(stop_ids or [])
        self.evaluating = eval_enabled(cfg) and bool(self.eval_prompts)
        self.episodes: Any = None  # the run's episode driver, when it has episodes: evaluation plays them too
        self.output_dir = Path(cfg.output_dir)
        self.monitor = HealthMonitor(cfg.alerts, self.output_dir)
        self.completions = CompletionLog(self.output_dir) if cfg.trl.log_completions else None
        self.best_eval: tuple[float, int] | None = None  # (eval/reward, step)
        self.logger: Any = None
        self._main = threading.main_thread()
        self._last_batch: int | None = None

    @classmethod
    def build(
        cls, cfg: GRPOConfig, host: PluginHost, context: RunContext, eval_prompts: list[Prompt], stop_ids: list[int]
    ) -> RunObserver:
        """Trackers start here, before the model loads: a missing library costs seconds."""
        return cls(cfg, TrackerSet.build(cfg, host, context), eval_prompts, stop_ids)

    # ------------------------------------------------------------------ lifecycle

    def start(self, trainer: Any) -> None:
        cfg = self.cfg
        self.logger = MetricsLogger(self.output_dir, cfg.max_steps, trainer.step, cfg.logging_steps)
        self._show_phases(trainer)

    def close(self) -> None:
        try:
            if self.logger is not None:
                self.logger.close()
        finally:
            self.trackers.close()

    # ------------------------------------------------------------------ phases

    def phase(self, name: str) -> None:
        """Show ``name`` on the bar; only the trainer's thread decides (a
        prefetch thread generating ahead is not the step in flight)."""
        if self.logger is not None and threading.current_thread() is self._main:
            self.logger.phase(name)

    def _show_phases(self, trainer: Any) -> None:
        """Label the producer, the scorer and the weight sync on the bar by
        wrapping them on this trainer instance (the loop itself is untouched)."""

        def labelled(label: str, after: str | None, func: Any) -> Any:
            @functools.wraps(func)
            def call(*args: Any, **kwargs: Any) -> Any:
                self.phase(label)
                try:
                    return func(*args, **kwargs)
                finally:
                    if after:
                        self.phase(after)

            return call

        parts = trainer.parts
        parts.producer.produce = labelled("generating", "training", parts.producer.produce)
        if hasattr(parts.scorer, "score"):
            parts.scorer.score = labelled("scoring", None, parts.scorer.score)
        trainer.sync_weights = labelled("syncing", None, trainer.sync_weights)

    # ------------------------------------------------------------------ per step

    def syncs_before_eval(self, trainer: Any) -> bool:
        """Whether :meth:`step_end` will sync the weights before evaluating
        (with several processes every rank then syncs with it first)."""
        return self._eval_due(trainer.step) and not self.cfg.trl.async_prefetch

    def _eval_due(self, step: int) -> bool:
        return self.evaluating and (step % eval_every(self.cfg) == 0 or step == self.cfg.max_steps)

    def _evaluate(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.phase("evaluating")
        if not self.cfg.trl.async_prefetch:
            trainer.sync_weights()  # no-op when the engine already holds this version
        version = trainer.last_sync_version if trainer.last_sync_version >= 0 else trainer.policy_version
        result = evaluate(
            eval_sampling(self.cfg, self.stop_ids),
            trainer.parts.hook,
            trainer.parts.scorer,
            self.eval_prompts,
            version,
            trainer.step,
            episodes=self.episodes,
        )
        metrics.update(result.metrics)
        score = result.metrics["eval/reward"]
        if self.best_eval is None or score > self.best_eval[0]:
            self.best_eval = (score, trainer.step)
        rows = eval_rows(result, trainer.parts.scorer.names, trainer.step)
        self.trackers.log_table("eval_completions", rows, trainer.step)

    def record_only(self, trainer: Any, metrics: dict[str, float]) -> None:
        """Write a finished step's metrics whose end failed (its weight sync
        raised): metrics.jsonl and the trackers, no evaluation (the engine
        may be what failed)."""
        self.logger.log(trainer.step, metrics, force=True)
        self.trackers.log(metrics, trainer.step)

    def step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        step, cfg, trl = trainer.step, self.cfg, self.cfg.trl
        evaluated = self._eval_due(step)
        if evaluated:
            self._evaluate(trainer, metrics)
        alerted = bool(self.monitor.update(step, metrics))
        logged = step % cfg.logging_steps == 0 or step == cfg.max_steps
        self.logger.log(step, metrics, force=evaluated or alerted)  # never lose an eval score or an alert
        if logged or evaluated or alerted:
            self.trackers.log(metrics, step)
        batch = trainer._batch
        fresh = batch is not None and id(batch) != self._last_batch  # num_iterations > 1 reuses a batch
        if batch is not None:
            self._last_batch = id(batch)
        names = trainer.parts.scorer.names
        if logged and fresh and self.completions is not None:
            rows = completion_rows(batch.groups, names, step)
            self.completions.append(rows)
            self.trackers.log_table("completions", rows, step)
        # TRL's log_completions prints the sample too (all of it unless num_completions_to_print limits it)
        shown = trl.num_completions_to_print or (1 << 30 if trl.log_completions else 0)
        if shown and batch is not None and step % cfg.logging_steps == 0:
            print_completions(batch.groups, trainer.parts.tokenizer, names, int(shown), step)
        self.phase("training")

    # ------------------------------------------------------------------ the end

    def summary_line(self, status: str, steps: int, saved_to: Path) -> str:
        best = ""
        if self.best_eval is not None:
            best = f"; best eval/reward {self.best_eval[0]:.4g} at step {self.best_eval[1]}"
        fired = f"; alerts: {', '.join(self.monitor.fired)}" if self.monitor.fired else ""
        return f"training {status}: {steps} steps{best}{fired}; model saved to {saved_to}"

"""What a run shows while it trains: a progress bar with the numbers that
tell whether GRPO is learning, one JSON line per step in
``output_dir/metrics.jsonl``, and optionally a table of sample completions."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from grpo_core.contract.errors import StorageError
from grpo_core.contract.types import ScoredGroup

BAR_KEYS = ("loss", "reward", "reward_std", "kl", "entropy", "eval/reward", "step_time")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(self, output_dir: Path, max_steps: int, initial_step: int, logging_steps: int) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        self.logging_steps = logging_steps
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        self.bar = tqdm(
            total=max_steps, initial=initial_step, desc="grpo", unit="step", dynamic_ncols=True, file=sys.stderr
        )

    def log(self, step: int, metrics: dict[str, float], force: bool = False) -> None:
        """Write ``metrics`` on logging steps, the last step, and when
        ``force``d (a step that evaluated or raised an alert)."""
        self.bar.update(1)
        if step % self.logging_steps and step != self.bar.total and not force:
            return
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk usually shows here first: this is the most frequent write
            raise StorageError(
                f"could not write step {step}'s metrics to {self.path}: {exc}. Make room in output_dir "
                f"{self.path.parent} or point output_dir at a disk with space; checkpoints already in "
                "output_dir are complete and can be resumed from."
            ) from exc
        self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in BAR_KEYS if k in metrics}, refresh=True)

    def phase(self, name: str) -> None:
        """What the step in flight is doing, on long steps the only thing moving."""
        self.bar.set_description_str(f"grpo [{name}]", refresh=True)

    def close(self) -> None:
        self.bar.close()
        try:
            self._file.close()
        except OSError:  # the buffered tail could not be flushed: log() already raised for it
            pass


def print_completions(
    groups: list[ScoredGroup], tokenizer: Any, reward_names: list[str], limit: int, step: int
) -> None:
    """``num_completions_to_print``: a readable table of prompt / completion / rewards."""
    # rich's tables load only when completions are printed (trl.log_completions)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step {step}: sample completions", show_lines=True)
    table.add_column("prompt", overflow="fold", max_width=40)
    table.add_column("completion", overflow="fold", max_width=60)
    for name in reward_names:
        table.add_column(name, justify="right")
    table.add_column("advantage", justify="right")
    shown = 0
    for scored in groups:
        prompt = scored.group.prompt.prompt
        prompt_text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        for completion, rewards, adv in zip(scored.group.completions, scored.rewards, scored.advantages):
            if shown >= limit:
                break
            table.add_row(
                prompt_text[-200:],
                completion.text[:400],
                *("-" if r is None else f"{r:.3g}" for r in rewards),
                f"{adv:+.3f}",
            )
            shown += 1
    # Piped to a log file, rich would assume 80 columns and squeeze the table.
    Console(stderr=True, width=None if sys.stderr.isatty() else 160).print(table)

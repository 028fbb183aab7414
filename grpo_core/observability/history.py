"""One history per output: the step logs hold the surviving run's rows only.

A run appends one row per logged step to ``metrics.jsonl`` (and
``completions.jsonl``, ``alerts.jsonl``). A run killed after its newest
checkpoint has written rows for steps no checkpoint kept; the run that
resumes from that checkpoint trains those steps again. Before it does, the
rows after the checkpoint's step are moved out of the logs
(:func:`split_log`; :mod:`grpo_core.checkpointing.lineage` decides where to),
so each log holds exactly one row per step of the surviving run.

:func:`surviving_rows` applies the same rule to a log written before this
existed (or edited by hand), where a step seen again means a resumed run
began there: ``grpo report`` reads the history through it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STEP_LOGS = ("metrics.jsonl", "completions.jsonl", "alerts.jsonl")
"""The logs with one row (or several, for completions) per step, each row's first key ``step``."""
ABANDONED = "abandoned"
"""``output_dir/abandoned/<run id>/``: what a run wrote that no surviving history continues."""


def row_step(line: bytes) -> int | None:
    """The ``step`` of one log line, or None for a line that is not a whole
    row (cut by a crash mid-write, or two rows run together) or has no step."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        yield from handle


def split_log(path: Path, after_step: int, set_aside: Callable[[list[tuple[int | None, bytes]]], None]) -> int:
    """Take out of the log ``path`` every row of a step after ``after_step``,
    and any line that is not a whole row. ``set_aside`` gets them first
    (step, line; in order) and must have stored them when it returns; the
    log is then rewritten through a temporary file renamed over it, so a
    crash leaves the rows in both places, never in neither. Returns how many
    lines moved (the log is not touched when none do)."""
    if not path.is_file():
        return 0
    moved: list[tuple[int | None, bytes]] = []
    for line in _lines(path):
        if line.strip() and not _kept(line, after_step):
            moved.append((row_step(line), line if line.endswith(b"\n") else line + b"\n"))
    if not moved:
        return 0
    set_aside(moved)
    tmp = path.with_name(f".{path.name}.rewind")
    with open(tmp, "wb") as out:
        for line in _lines(path):
            if line.strip() and _kept(line, after_step):
                out.write(line)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return len(moved)


def _kept(line: bytes, after_step: int) -> bool:
    """A whole row (newline-terminated: the newline is written last) of a step up to ``after_step``."""
    if not line.endswith(b"\n"):
        return False
    step = row_step(line)
    return step is not None and step <= after_step


def surviving_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The rows of the surviving history of a log read in write order, and
    how many rows were left out: a row whose step is not after the previous
    row's starts a resumed run there, which supersedes the earlier rows from
    that step on (``[1, 2, 3, 3, 4]`` keeps the second 3)."""
    kept: list[dict[str, Any]] = []
    dropped = 0
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        while kept and kept[-1]["step"] >= step:
            kept.pop()
            dropped += 1
        kept.append(record)
    return kept, dropped


def abandoned_summary(output_dir: Path) -> list[str]:
    """One line per run with rows in ``output_dir/abandoned/``: for ``grpo report``."""
    root = Path(output_dir) / ABANDONED
    if not root.is_dir():
        return []
    lines = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        steps = sorted(
            {s for line in _lines(run_dir / "metrics.jsonl") if (s := row_step(line)) is not None}
            if (run_dir / "metrics.jsonl").is_file()
            else set()
        )
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*"))
        what = [f"{len(steps)} metrics rows (steps {steps[0]}-{steps[-1]})" if steps else "no metrics rows"]
        if checkpoints:
            what.append(f"{len(checkpoints)} checkpoint(s)")
        lines.append(f"  {run_dir.name}: {', '.join(what)} in {run_dir}")
    return lines

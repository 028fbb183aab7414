"""Which run wrote what in an ``output_dir``, and what a new run does with it.

Every run that writes ``output_dir`` gets an id and a line in
``output_dir/lineage.jsonl`` when it starts (the step it starts after, the
checkpoint it resumed from) and another when it ends (its status). From
these the writer of any row or checkpoint is known: the last run that
started before that step.

A run starting after step S (the checkpoint it resumes from; 0 for a fresh
start) first sets aside everything the output holds after S: the rows of
the step logs (:data:`~grpo_core.observability.history.STEP_LOGS`) and the
checkpoints of later steps. They move, never get deleted, to
``output_dir/abandoned/<id of the run that wrote them>/`` (the same file
names, and ``abandoned.jsonl`` saying when and by which run they were set
aside), so the logs hold exactly one row per step of the surviving run.

A fresh start over checkpoints would train from step 0 and overwrite them
one by one: :func:`fresh_start_problem` refuses it unless the config resumes
(``resume_from_checkpoint``, ``grpo run --resume``) or opts in to starting
over (``start_over``, ``grpo run --start-over``), which sets every earlier
checkpoint and row aside as above.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from grpo_core.checkpointing.checkpoint import PREFIX, STATE_FILE, list_checkpoints
from grpo_core.observability.history import ABANDONED, STEP_LOGS, split_log

LINEAGE = "lineage.jsonl"
UNRECORDED = "unrecorded"
"""The writer's id for what a run wrote before grpo recorded lineages."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_lineage(output_dir: Path) -> list[dict[str, Any]]:
    """The records of ``lineage.jsonl``, oldest first (unreadable lines skipped)."""
    path = Path(output_dir) / LINEAGE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("run"), str):
            records.append(record)
    return records


def record_start(
    output_dir: Path,
    run: str,
    start_step: int,
    resumed_from: Path | None,
    config: str | None,
    start_over: bool = False,
) -> None:
    _append(
        Path(output_dir) / LINEAGE,
        {
            "run": run,
            "event": "start",
            "at": _now(),
            "start_step": start_step,
            "resumed_from": None if resumed_from is None else str(Path(resumed_from).resolve()),
            "start_over": start_over,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "config": config,
        },
    )


def record_end(output_dir: Path, run: str, status: str, step: int | None) -> None:
    try:
        _append(Path(output_dir) / LINEAGE, {"run": run, "event": "end", "at": _now(), "status": status, "step": step})
    except OSError:  # a full disk: the run's own error says so
        pass


def writer_of(step: int | None, starts: list[dict[str, Any]]) -> str:
    """The run that wrote what the output holds at ``step``: the last one to
    start before it (each start set aside everything after its start step).
    A line with no step (cut by a crash) is the last run's."""
    for record in reversed(starts):
        if step is None or int(record.get("start_step", 0)) < step:
            return str(record["run"])
    return UNRECORDED


def set_aside(output_dir: Path, after_step: int, by_run: str, why: str) -> list[str]:
    """Move every row of a step after ``after_step`` out of the step logs and
    every checkpoint of a later step out of ``output_dir``, into
    ``abandoned/<writer's id>/``; return one line per writer for the log."""
    output_dir = Path(output_dir)
    starts = [r for r in read_lineage(output_dir) if r.get("event") == "start"]
    rows: dict[str, dict[str, int]] = {}
    checkpoints: dict[str, list[str]] = {}

    def keep_in(name: str) -> Callable[[list[tuple[int | None, bytes]]], None]:
        def store(moved: list[tuple[int | None, bytes]]) -> None:
            by_writer: dict[str, list[bytes]] = {}
            for step, line in moved:
                by_writer.setdefault(writer_of(step, starts), []).append(line)
            for writer, lines in by_writer.items():
                target = output_dir / ABANDONED / writer / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "ab") as handle:
                    handle.writelines(lines)
                    handle.flush()
                    os.fsync(handle.fileno())
                rows.setdefault(writer, {})[name] = len(lines)

        return store

    for name in STEP_LOGS:
        split_log(output_dir / name, after_step, keep_in(name))
    for path in list_checkpoints(output_dir):
        step = int(path.name[len(PREFIX) :])
        if step <= after_step:
            continue
        writer = writer_of(step, starts)
        target = output_dir / ABANDONED / writer / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target = target.with_name(f"{path.name}-{by_run}")
        path.rename(target)
        checkpoints.setdefault(writer, []).append(path.name)
    lines = []
    for writer in sorted(rows.keys() | checkpoints.keys()):
        _append(
            output_dir / ABANDONED / writer / "abandoned.jsonl",
            {
                "at": _now(),
                "by_run": by_run,
                "after_step": after_step,
                "why": why,
                "rows": rows.get(writer, {}),
                "checkpoints": checkpoints.get(writer, []),
                "run": next((r for r in starts if r["run"] == writer), None),
            },
        )
        what = [f"{n} row(s) of {name}" for name, n in rows.get(writer, {}).items()]
        if writer in checkpoints:
            what.append(", ".join(checkpoints[writer]))
        lines.append(
            f"{why}: moved what run {writer} wrote after step {after_step} ({'; '.join(what)}) to "
            f"{output_dir / ABANDONED / writer} (nothing is deleted)"
        )
    return lines


def fresh_start_problem(output_dir: str | Path, max_steps: int, *, resuming: bool, start_over: bool) -> str | None:
    """Why starting from step 0 would overwrite resumable work, or None:
    ``output_dir`` holds checkpoints and the config neither resumes
    (``resume_from_checkpoint`` set) nor opts in to ``start_over``."""
    if resuming or start_over:
        return None
    output_dir = Path(output_dir)
    existing = list_checkpoints(output_dir)
    if not existing:
        return None
    newest = existing[-1]
    try:
        step = int(json.loads((newest / STATE_FILE).read_text()).get("step", 0))
    except (OSError, ValueError, AttributeError):
        step = int(newest.name[len(PREFIX) :])
    done = f"; it reached max_steps = {max_steps}" if step >= max_steps else ""
    return (
        f"output_dir {output_dir} holds {len(existing)} checkpoint(s) of an earlier run (newest: {newest}, step "
        f"{step}{done}); a fresh start would train from step 0 and overwrite them. Resume it with `grpo run CONFIG "
        f'--resume` (resume_from_checkpoint = "latest", or a checkpoint\'s path), or set a new output_dir, or start '
        f"over with `grpo run CONFIG --start-over` (start_over = true), which moves the earlier run's checkpoints "
        f"and logs to {output_dir / ABANDONED}/ and deletes nothing."
    )


def start_over_note(output_dir: str | Path, start_over: bool) -> str | None:
    """What ``start_over`` will move, for ``grpo config check`` (None when nothing)."""
    if not start_over:
        return None
    output_dir = Path(output_dir)
    existing = list_checkpoints(output_dir)
    logs = [name for name in STEP_LOGS if (output_dir / name).is_file()]
    if not existing and not logs:
        return None
    held = ([f"{len(existing)} checkpoint(s) (newest {existing[-1].name})"] if existing else []) + logs
    return (
        f"start_over = true: the run starts from step 0 and first moves {', '.join(held)} from {output_dir} to "
        f"{output_dir / ABANDONED}/<run id>/ (nothing is deleted). Leave start_over out of a config you relaunch: "
        "it starts over at every launch (`grpo run --start-over` is for one launch)."
    )

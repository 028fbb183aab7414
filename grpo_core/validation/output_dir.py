"""What ``output_dir`` already holds, judged before a run (``grpo run`` and
``grpo config check`` alike): a live run in it, checkpoints a fresh start
would overwrite, a resume with nothing to resume.

``grpo run`` judges again once it holds the lock (the output may change in
between); this is the early, cheap answer.
"""

from __future__ import annotations

from pathlib import Path

from grpo_core.checkpointing.checkpoint import list_checkpoints, resolve_resume
from grpo_core.checkpointing.lineage import fresh_start_problem, start_over_note
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError
from grpo_core.runtime.output_lock import in_use_message, live_holder
from grpo_core.runtime.processes import process_rank


def output_dir_checks(cfg: GRPOConfig, errors: list[str], warnings: list[str]) -> None:
    output_dir = Path(cfg.output_dir)
    if cfg.start_over and cfg.resume_from_checkpoint is not None:
        errors.append(
            "start_over and resume_from_checkpoint are both set (--start-over and --resume): choose one; "
            "start_over trains from step 0, a resume continues a checkpoint."
        )
        return
    if process_rank() == 0:  # the writing process takes the lock; the others run beside it
        held = live_holder(output_dir)
        if held is not None:
            errors.append(in_use_message(output_dir, *held))
            return
    try:
        resume = resolve_resume(cfg.resume_from_checkpoint, output_dir)
    except ConfigError as exc:
        errors.append(str(exc))
        return
    if cfg.resume_from_checkpoint == "latest" and resume is None:
        warnings.append(
            f'resume_from_checkpoint = "latest": output_dir {output_dir} holds no checkpoint yet, so the run starts '
            "from step 0."
        )
    problem = fresh_start_problem(
        output_dir, cfg.max_steps, resuming=cfg.resume_from_checkpoint is not None, start_over=cfg.start_over
    )
    if problem is not None:
        errors.append(problem)
    note = start_over_note(output_dir, cfg.start_over)
    if note is not None:
        warnings.append(note)


def start_line(cfg: GRPOConfig) -> str:
    """Where a run of ``cfg`` starts, for the config check's summary."""
    output_dir = Path(cfg.output_dir)
    try:
        resume = resolve_resume(cfg.resume_from_checkpoint, output_dir)
    except ConfigError:
        return "start:        resume_from_checkpoint is not a checkpoint (see the error)"
    if resume is not None:
        return f"start:        resumes from {resume}"
    existing = list_checkpoints(output_dir)
    if existing and cfg.start_over:
        return f"start:        step 0, over {len(existing)} checkpoint(s) set aside (start_over)"
    return "start:        step 0" + (" (no checkpoint in output_dir)" if not existing else "")

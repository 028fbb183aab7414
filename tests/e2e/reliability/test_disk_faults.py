"""Disk faults: an ``output_dir`` that cannot be written, and a disk that
fills up mid-run.

A full disk is made real with ``RLIMIT_FSIZE``, set in the child before it
starts (``preexec_fn``) or lowered on the running process (``prlimit``):
every write past the limit fails with EFBIG, exactly where ENOSPC would.
SIGXFSZ is ignored so the write fails instead of killing the process.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_harness import (
    Runner,
    assert_clean_failure,
    assert_no_model_loaded,
    checkpoint_step,
    complete_checkpoint,
    last_per_step,
)


def file_size_limit(limit: int) -> Callable[[], None]:
    """``preexec_fn``: no file of the child may grow beyond ``limit`` bytes."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("fault", ["read_only_dir", "parent_is_a_file", "no_space"])
def test_unwritable_output_dir_fails_before_the_model_loads(runner: Runner, fault: str) -> None:
    preexec = None
    if fault == "read_only_dir":
        if os.geteuid() == 0:
            pytest.skip("running as root: permission bits do not stop root from writing (the other cases still run)")
        parent = runner.workdir / "locked"
        parent.mkdir(mode=0o500)
        output_dir = parent / "out"
        expected = "Permission denied"
    elif fault == "parent_is_a_file":
        (runner.workdir / "a-file").write_text("not a directory")
        output_dir = runner.workdir / "a-file" / "out"
        expected = "Not a directory"
    else:
        output_dir = runner.workdir / "out"
        preexec = file_size_limit(64 << 10)  # a disk with only 64 KiB left (enough for Python's own temp probes)
        expected = "File too large"
    code, output = runner.run(runner.config(output_dir=str(output_dir)), preexec_fn=preexec)
    assert_clean_failure(code, output)
    assert f"error: output_dir {output_dir} is not writable" in output, output
    assert expected in output and "Choose another `output_dir`" in output
    assert_no_model_loaded(output)


def test_disk_full_mid_run_fails_cleanly_and_keeps_the_last_checkpoint(runner: Runner) -> None:
    out = runner.workdir / "out"
    rewards = ["faulty_rewards.good", "faulty_rewards.reward_waits"]
    config = runner.config(max_steps=3, save_steps=1, trl={"reward_funcs": rewards})

    # 1. The disk fills up after checkpoint-1, while step 2 is scored (its reward holds there until told to go
    #    on): the next write, step 2's metrics line, fails.
    run = runner.start(config, env={"FAULT_AT_WAITS": "2"}, preexec_fn=file_size_limit(resource.RLIM_INFINITY))
    run.wait_until(lambda: complete_checkpoint(out, 1)() and (runner.workdir / "waiting").exists(), "step 2's reward")
    size = (out / "metrics.jsonl").stat().st_size
    resource.prlimit(run.pid, resource.RLIMIT_FSIZE, (size, size))
    (runner.workdir / "go").touch()
    code = run.finish()
    assert_clean_failure(code, run.output)
    assert (
        f"error: could not write step 2's metrics to {out / 'metrics.jsonl'}: [Errno 27] File too large" in run.output
    )
    assert f"Make room in output_dir {out}" in run.output
    assert checkpoint_step(out / "checkpoint-1") == 1
    digest = tree_digest(out / "checkpoint-1")

    # 2. Resumed with room for small files only: step 2 trains and is logged, writing checkpoint-2 fails.
    code, output = runner.run(config, 'resume_from_checkpoint="latest"', preexec_fn=file_size_limit(2 << 20))
    assert_clean_failure(code, output)
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in output
    assert f"error: could not write checkpoint {out / 'checkpoint-2'}: " in output
    assert "File too large" in output and f"Make room in output_dir {out}" in output
    assert (
        f"The previous checkpoint {out / 'checkpoint-1'} is intact: resume with resume_from_checkpoint = "
        f'"{out / "checkpoint-1"}"' in output
    )
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "."))) == [
        "checkpoint-1"
    ]  # nothing half-written
    assert tree_digest(out / "checkpoint-1") == digest
    assert max(last_per_step(out)) == 2  # (run 2 resumed from checkpoint-1, and it is unchanged for the next resume)


def test_output_dir_check_runs_at_once_in_every_process_without_colliding(tmp_path: Path) -> None:
    """Every process of a multi-process run checks output_dir at the same
    moment: each must write and remove its own probe (a shared probe name let
    one process delete the file another was checking, failing a 2-process
    DeepSpeed test). Threads stand in for the processes here, and leave no
    probe behind."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo_core.training.run import check_output_dir

    out = tmp_path / "out"
    with ThreadPoolExecutor(max_workers=8) as pool:
        for result in [pool.submit(check_output_dir, out) for _ in range(64)]:
            result.result()  # raises the StorageError a collision gives
    assert list(out.iterdir()) == []

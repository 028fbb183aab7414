"""Scratch directories (``grpo_core.runtime.scratch``) do not outlive their process:
a real child process makes one and is SIGKILLed, and the next directory
made under the same prefix removes the leftover, never a live owner's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_core.runtime.scratch import LOCK_NAME, make_scratch_dir, remove_scratch_dir, sweep_abandoned

OWNER = textwrap.dedent(
    """
    import sys, time
    from grpo_core.runtime.scratch import make_scratch_dir
    path = make_scratch_dir(sys.argv[1], sys.argv[2])
    (path / "weights.bin").write_bytes(b"x" * 4096)
    print(path, flush=True)
    time.sleep(600)
    """
)


def _start_owner(parent: Path, prefix: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, prefix, str(parent)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert line, "the owner process printed no directory"
    return proc, Path(line)


def test_a_killed_owners_directory_is_removed_by_the_next_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    live, live_dir = _start_owner(tmp_path, "grpo-test-")
    doomed, doomed_dir = _start_owner(tmp_path, "grpo-test-")
    try:
        assert (doomed_dir / LOCK_NAME).is_file() and (doomed_dir / "weights.bin").is_file()
        assert sweep_abandoned("grpo-test-", tmp_path) == []  # both owners alive: nothing is touched
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        assert doomed_dir.is_dir()  # SIGKILL gave it no chance to clean up

        mine = make_scratch_dir("grpo-test-", tmp_path)
        assert not doomed_dir.exists()
        assert live_dir.is_dir() and (live_dir / "weights.bin").is_file()
        assert sweep_abandoned("grpo-test-", tmp_path) == []  # this process's own is held too
        assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
        remove_scratch_dir(mine)
        assert not mine.exists()
        remove_scratch_dir(mine)  # idempotent
    finally:
        for proc in (live, doomed):
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()  # type: ignore[union-attr]
    assert sweep_abandoned("grpo-test-", tmp_path) == [live_dir]  # its owner is gone now too


def test_directories_without_a_lock_or_under_another_prefix_are_left_alone(tmp_path: Path) -> None:
    unlocked = tmp_path / "grpo-test-unlocked"  # e.g. made by an older grpo, or being made right now
    unlocked.mkdir()
    other = tmp_path / "grpo-other-x"
    other.mkdir()
    (other / LOCK_NAME).touch()  # unlocked lock file, but not our prefix
    stray_file = tmp_path / "grpo-test-file"
    stray_file.write_text("not a directory")
    assert sweep_abandoned("grpo-test-", tmp_path) == []
    assert unlocked.is_dir() and other.is_dir() and stray_file.is_file()


def test_a_lock_file_nobody_holds_means_a_dead_owner(tmp_path: Path) -> None:
    """The lock file only appears already locked (made under another name,
    then renamed): an unheld one is a dead process's."""
    dead = tmp_path / "grpo-test-dead"
    dead.mkdir()
    (dead / LOCK_NAME).touch()
    assert sweep_abandoned("grpo-test-", tmp_path) == [dead]
    assert not dead.exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_the_merged_weight_syncs_directory_is_a_scratch_directory(tmp_path: Path) -> None:
    """What the weight syncs hand a local engine lives in such a directory,
    removed at the end of training."""
    from grpo_core.contract.context import RunContext
    from grpo_plugins.weight_sync_files import FullFilesystemSync

    class LocalEngine:
        same_host = True

    sync = FullFilesystemSync(RunContext(config=None, output_dir=tmp_path))  # type: ignore[arg-type]
    root = sync._root_for(LocalEngine())  # type: ignore[arg-type]
    try:
        assert root.parent == Path("/dev/shm") and root.name.startswith("grpo-full_filesystem-")
        assert (root / LOCK_NAME).is_file()
        assert root not in sweep_abandoned("grpo-full_filesystem-", "/dev/shm")
    finally:
        sync.grpo_train_end()
    assert not root.exists()
    assert os.listdir(tmp_path) == []  # nothing in output_dir either

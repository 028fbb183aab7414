"""A compile lock left by a dead process is removed before DeepSpeed starts
(grpo_core.parallel.build_lock): torch would otherwise wait for it for ever.
Real files and real processes; ``TORCH_EXTENSIONS_DIR`` points torch at a
temporary build root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_core.parallel import build_lock
from grpo_core.parallel.build_lock import build_directory, is_stale, remove_stale_lock


@pytest.fixture
def lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    directory = build_directory("deepspeed_shm_comm")
    assert directory.is_relative_to(tmp_path)
    path = directory / "lock"
    path.touch()
    return path


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_an_old_lock_nobody_builds_under_is_removed_with_a_warning(lock: Path) -> None:
    age(lock, 120)
    with pytest.warns(UserWarning, match="died while compiling DeepSpeed's deepspeed_shm_comm op"):
        assert remove_stale_lock() == lock
    assert not lock.exists()


def test_a_fresh_lock_is_kept(lock: Path) -> None:
    """Another rank started the build a moment ago: its compiler may not run yet."""
    assert remove_stale_lock() is None
    assert lock.exists()


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs /proc to see a build running")
def test_a_lock_with_a_build_running_in_its_directory_is_kept(lock: Path) -> None:
    age(lock, 120)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        for _ in range(100):  # the child has its cwd from the start; wait until /proc shows it
            if build_lock.works_in(lock.parent):
                break
            time.sleep(0.05)
        assert remove_stale_lock() is None
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert remove_stale_lock() == lock  # the builder is gone: now it is stale


def test_without_proc_only_a_lock_older_than_any_build_is_stale(lock: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_lock, "works_in", lambda directory: None)  # as on a system without /proc
    age(lock, 120)
    assert not is_stale(lock)
    age(lock, build_lock.STALE_AFTER_S + 60)
    assert is_stale(lock)


def test_no_lock_is_not_stale(tmp_path: Path) -> None:
    assert not is_stale(tmp_path / "lock")

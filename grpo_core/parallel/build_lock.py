"""A compile lock left by a dead process must not hang the next run.

DeepSpeed builds its CPU shared-memory collective (``deepspeed_shm_comm``)
with torch's ``cpp_extension`` the first time a process group starts. torch
guards the build directory with a lock file and waits, silently and for
ever, while that file exists; a process killed mid-build (Ctrl-C, a time
limit, an out-of-memory kill) leaves it behind, and every later DeepSpeed
run on the machine then hangs at start-up with no message.

A lock is stale when it is older than a build takes to start and no process
works in the build directory (torch runs its compiler there); it is removed
with a warning. Where ``/proc`` cannot say, only a lock older than any build
is removed.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

SHM_COMM = "deepspeed_shm_comm"
QUIET_AFTER_S = 60.0  # a live build holds the lock only while its compiler runs in the directory, or for seconds
STALE_AFTER_S = 1800.0  # without /proc: no build of this op takes half an hour


def build_directory(name: str) -> Path:
    """Where torch builds extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default)."""
    # heavy (torch's cpp_extension): loaded on first use, not with this module
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def works_in(directory: Path) -> bool | None:
    """Whether any process has ``directory`` as its working directory; None
    where ``/proc`` does not tell (not Linux)."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    target = directory.resolve()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == target:
                return True
        except OSError:  # gone, or another user's
            continue
    return False


def is_stale(lock: Path, now: float | None = None) -> bool:
    """Whether ``lock`` was left by a build that is no longer running."""
    try:
        age = (now or time.time()) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    busy = works_in(lock.parent)
    if busy is None:
        return age > STALE_AFTER_S
    return age > QUIET_AFTER_S and not busy


def remove_stale_lock(name: str = SHM_COMM) -> Path | None:
    """Remove extension ``name``'s lock when it is stale, saying so; the
    removed lock's path, or None."""
    lock = build_directory(name) / "lock"
    if not is_stale(lock):
        return None
    lock.unlink(missing_ok=True)  # every rank checks at once: another may have removed it first
    warnings.warn(
        f"removed {lock}: a process that died while compiling DeepSpeed's {name} op left it, and torch would wait "
        "for it for ever; the op is rebuilt now",
        stacklevel=2,
    )
    return lock

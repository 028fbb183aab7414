"""Private scratch directories that do not outlive their process.

A run keeps transient files outside ``output_dir``: the merged weights it
hands a local inference engine (hundreds of MB, in memory-backed ``/dev/shm``
where there is one) and a managed server's socket. The run removes them when
it ends, but a process killed outright (SIGKILL, the OOM killer, a job
scheduler's hard limit) cannot, and on a shared node every leftover in
``/dev/shm`` is memory nobody gets back until a reboot.

So each directory holds a lock file on which its process keeps an exclusive
``flock``. The kernel drops that lock when the process dies, however it dies.
Whenever a process makes a new scratch directory, it removes the siblings of
the same prefix (and user) whose lock it can take: they belong to dead runs.
A directory without the lock file is left alone (it may be another program's,
or one being made right now). Where ``fcntl`` is missing (Windows) nothing is
locked and nothing is swept.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: nothing is locked, nothing is swept
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".grpo-owner.lock"

_held: dict[Path, int] = {}  # scratch directory -> the fd holding its lock, for this process's lifetime
_held_lock = threading.Lock()


def make_scratch_dir(prefix: str, parent: str | os.PathLike[str] | None = None) -> Path:
    """A fresh 0700 directory ``<parent>/<prefix>XXXX`` owned by this process
    until :func:`remove_scratch_dir` (or the process's death); first removes
    the leftovers of dead processes under the same prefix."""
    sweep_abandoned(prefix, parent)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = _lock_new(path)
    if fd is not None:
        with _held_lock:
            _held[path] = fd
    return path


def remove_scratch_dir(path: Path) -> None:
    """Delete ``path`` and release its lock (idempotent)."""
    shutil.rmtree(path, ignore_errors=True)
    with _held_lock:
        fd = _held.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def sweep_abandoned(prefix: str, parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's ``<parent>/<prefix>*`` directories whose owner
    has died; returns what was removed."""
    if fcntl is None:
        return []
    root = Path(parent if parent is not None else tempfile.gettempdir())
    removed = []
    for candidate in root.glob(f"{prefix}*"):
        if not _owned_directory(candidate):
            continue
        try:
            fd = os.open(candidate / LOCK_NAME, os.O_RDONLY)
        except OSError:  # no lock file: not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner is alive
            os.close(fd)
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        os.close(fd)
        removed.append(candidate)
    return removed


def _owned_directory(path: Path) -> bool:
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _lock_new(path: Path) -> int | None:
    """Lock ``path`` as this process's: the lock file is locked under a
    temporary name, then renamed into place, so a sweeper never finds it
    present but not yet locked."""
    if fcntl is None:
        return None
    staging = path / f"{LOCK_NAME}.{os.getpid()}"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # not inherited by exec'd children
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staging, path / LOCK_NAME)
    return fd

"""One live run per ``output_dir``: the lock file ``output_dir/run.lock``.

Two runs writing one ``output_dir`` interleave their logs and overwrite each
other's checkpoints. The run that writes (rank 0 of a multi-process or
multi-host run; the only process otherwise) takes this lock before it writes
anything and removes it when it ends; a second run refuses at start, naming
the holder.

The lock is a small JSON file: the holder's run id, process id, host, start
time, config path and command line, and a heartbeat time a thread of the
holder rewrites every :data:`HEARTBEAT_S` seconds. A lock whose holder died
(``kill -9``, the OOM killer, a lost node) stays behind and is judged
**stale** by this rule (:func:`judge`):

* the holder ran in this process-id space (same host name, kernel boot and
  pid namespace): stale when no process has its pid any more, or the pid
  now belongs to a process that started at another time (a reused pid).
  A holder that is alive but hung keeps the lock: stop it to take over.
* the holder ran elsewhere (another host, container or boot): stale when its
  heartbeat is older than :data:`STALE_AFTER_S` by this host's clock (hosts
  sharing a filesystem are assumed to agree on the time within a minute).

A stale lock is taken over with a line saying whose it was and why it is
stale. Creating the lock is atomic (a hard link, or an exclusive create
where links are not supported), so of two runs starting at once one wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from grpo_core.contract.errors import GrpoError

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
"""How often the holder rewrites its heartbeat."""
STALE_AFTER_S = 300.0
"""A holder on another host with no heartbeat for this long is taken for dead (ten missed beats)."""


class OutputDirInUse(GrpoError):
    """Another live run holds ``output_dir``. The message names it and the ways on."""


def new_run_id() -> str:
    """A run's id: its start time (UTC, sortable) and a random suffix."""
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None where unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


@dataclass
class Holder:
    """What the lock says about the run that holds it."""

    run: str
    pid: int
    host: str
    started: float  # epoch seconds
    heartbeat: float  # epoch seconds, refreshed every HEARTBEAT_S
    config: str | None = None
    command: str = ""
    boot_id: str | None = None
    pid_namespace: str | None = None
    process_start: str | None = None

    @classmethod
    def of_this_process(cls, run: str, config: str | None) -> Holder:
        now = time.time()
        return cls(
            run=run,
            pid=os.getpid(),
            host=socket.gethostname(),
            started=now,
            heartbeat=now,
            config=config,
            command=" ".join(sys.argv),
            boot_id=_read("/proc/sys/kernel/random/boot_id"),
            pid_namespace=_pid_namespace(),
            process_start=_process_start(os.getpid()),
        )

    @classmethod
    def from_text(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (ValueError, TypeError, KeyError):
            return None

    def to_text(self) -> str:
        return json.dumps({**asdict(self), "started_at": _iso(self.started)}, indent=1) + "\n"

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        config = f", config {self.config}" if self.config else ""
        return (
            f"run {self.run} (pid {self.pid} on host {self.host}, started {_iso(self.started)}{config}; "
            f"last heartbeat {_ago(now - self.heartbeat)})"
        )

    def same_pid_space(self) -> bool:
        """Whether this process can ask the kernel about the holder's pid."""
        if self.host != socket.gethostname():
            return False
        here = (_read("/proc/sys/kernel/random/boot_id"), _pid_namespace())
        return all(
            theirs is None or mine is None or theirs == mine
            for theirs, mine in zip((self.boot_id, self.pid_namespace), here, strict=True)
        )


def judge(holder: Holder, now: float | None = None) -> tuple[bool, str]:
    """(live, why): the stale rule of the module docstring."""
    now = time.time() if now is None else now
    if holder.same_pid_space():
        if not _alive(holder.pid):
            return False, f"no process {holder.pid} runs on this host any more (it exited or was killed)"
        start = _process_start(holder.pid)
        if holder.process_start is not None and start is not None and start != holder.process_start:
            return False, f"pid {holder.pid} now belongs to another process (the holder's pid was reused)"
        return True, f"process {holder.pid} is running on this host"
    silent = now - holder.heartbeat
    if silent > STALE_AFTER_S:
        return False, (
            f"it ran on another host ({holder.host}) and its heartbeat stopped {silent:.0f} s ago "
            f"(more than {STALE_AFTER_S:.0f} s)"
        )
    return True, f"it runs on host {holder.host}, whose heartbeat was {_ago(silent)}"


def read_holder(output_dir: Path, attempts: int = 5) -> Holder | None:
    """The lock's holder, or None without a lock. A lock being created where
    links are not supported may be empty for a moment: read again; one
    that stays unreadable is returned as a holder nobody can be (stale)."""
    path = Path(output_dir) / LOCK_FILE
    for attempt in range(attempts):
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            text = ""
        holder = Holder.from_text(text)
        if holder is not None:
            return holder
        if attempt < attempts - 1:
            time.sleep(0.2)
    return Holder(run="unreadable", pid=-1, host="(unreadable lock file)", started=0.0, heartbeat=0.0)


def live_holder(output_dir: Path) -> tuple[Holder, str] | None:
    """The holder of ``output_dir``'s lock and why it counts as live, or None
    when there is no lock or its holder is gone."""
    holder = read_holder(output_dir)
    if holder is None or holder.run == "unreadable":
        return None
    live, why = judge(holder)
    return (holder, why) if live else None


def in_use_message(output_dir: Path, holder: Holder, why: str) -> str:
    return (
        f"output_dir {output_dir} is in use by another run: {holder.describe()}; {why}. Two runs in one output_dir "
        f"interleave their logs and overwrite each other's checkpoints. Wait for it to end or stop it, or choose "
        f"another output_dir. (Its lock is {Path(output_dir) / LOCK_FILE}; a lock whose process is gone is taken "
        f"over by the next run, on another host after {STALE_AFTER_S:.0f} s without a heartbeat.)"
    )


class OutputLock:
    """The lock of one run: :meth:`acquire` at start, a heartbeat thread
    while held, :meth:`release` at the end (a context manager does both)."""

    def __init__(
        self, output_dir: Path, run: str, config: str | None = None, log: Callable[[str], None] = print
    ) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self.holder = Holder.of_this_process(run, config)
        self.log = log
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or raise :class:`OutputDirInUse`; a stale lock is
        taken over with a line saying whose it was."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            if self._create():
                self.held = True
                self._start_heartbeat()
                return
            holder = read_holder(self.output_dir)
            if holder is None:  # released between our attempt and the read: try again
                continue
            live, why = judge(holder)
            if live:
                raise OutputDirInUse(in_use_message(self.output_dir, holder, why))
            if self._remove_stale(holder):
                self.log(
                    f"output_dir {self.output_dir}: taking over the lock of {holder.describe()}: {why}. "
                    f"This run is {self.holder.run}."
                )
        raise OutputDirInUse(
            f"could not take the lock {self.path}: other runs keep creating it. Make sure one run at a time "
            "starts in this output_dir."
        )

    def _create(self) -> bool:
        """Create the lock with this run's record, atomically; False if one exists."""
        text = self.holder.to_text()
        tmp = self.output_dir / f".{LOCK_FILE}.{self.holder.run}.tmp"
        tmp.write_text(text)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: an exclusive create instead
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale(self, holder: Holder) -> bool:
        """Move the stale lock aside and delete it, unless another run replaced
        it meanwhile (then put that one back). True when it was removed."""
        aside = self.output_dir / f".{LOCK_FILE}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = Holder.from_text(aside.read_text()) if aside.exists() else None
        if moved is not None and moved.run != holder.run:  # a racer's fresh lock: restore it
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="grpo-output-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.refresh():
                return

    def refresh(self) -> bool:
        """Rewrite the heartbeat; False (and one warning) when the lock is no
        longer this run's: another run judged it stale and took it over."""
        current = read_holder(self.output_dir, attempts=1)
        if current is None or current.run != self.holder.run:
            owner = "nobody" if current is None else current.describe()
            self.log(
                f"warning: the lock of output_dir {self.output_dir} is no longer this run's (now: {owner}); "
                "another run may be writing there too"
            )
            return False
        self.holder.heartbeat = time.time()
        tmp = self.output_dir / f".{LOCK_FILE}.{self.holder.run}.beat"
        try:
            tmp.write_text(self.holder.to_text())
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk, a lost mount: keep trying at the next beat
            self.log(f"warning: could not refresh the heartbeat of {self.path}: {exc}")
            tmp.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if not self.held:
            return
        self.held = False
        current = read_holder(self.output_dir, attempts=1)
        if current is not None and current.run == self.holder.run:
            with contextlib.suppress(OSError):
                self.path.unlink()

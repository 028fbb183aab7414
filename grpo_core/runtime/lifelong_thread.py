"""One thread, as long-lived as the process, that starts every child server.

Linux's parent-death signal (``PR_SET_PDEATHSIG``) fires when the *thread*
that started a child exits, not the process. A server (re)started from a
short-lived thread (the prefetch thread restarting a dead vLLM server, an
episode thread restarting an OpenEnv server) would either be killed when that
thread ends, or, without the signal, orphaned when grpo is SIGKILLed. Started
from this thread, it dies exactly with the process. Every plugin that owns a
child server uses it, so they share one thread, not a copy each.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

_SPAWN_QUEUE: queue.SimpleQueue[tuple[Callable[[], object], list[tuple[bool, object]], threading.Event]] | None = None
_SPAWN_LOCK = threading.Lock()


def _spawner_loop(jobs: queue.SimpleQueue) -> None:
    while True:
        job, box, done = jobs.get()
        try:
            box.append((True, job()))
        except BaseException as exc:  # handed back to the caller
            box.append((False, exc))
        done.set()


def in_lifelong_thread(job: Callable[[], object]) -> object:
    """Run ``job`` (typically a ``subprocess.Popen``) in the process-long
    thread and return what it returns, or raise what it raised."""
    global _SPAWN_QUEUE
    with _SPAWN_LOCK:
        if _SPAWN_QUEUE is None:
            _SPAWN_QUEUE = queue.SimpleQueue()
            threading.Thread(
                target=_spawner_loop, args=(_SPAWN_QUEUE,), name="grpo-server-spawner", daemon=True
            ).start()
        jobs = _SPAWN_QUEUE
    box: list[tuple[bool, object]] = []
    done = threading.Event()
    jobs.put((job, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except Exception:  # noqa: BLE001 - not Linux (or no glibc): the atexit guards still apply
        return None


# Resolved here, in the parent: between fork and exec the child should only
# call it. Importing ctypes or dlopen-ing libc there can deadlock the child when
# another thread of the parent holds the import or loader lock at the fork, and
# restarts fork while other threads (prefetch, episodes) run.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)


def set_parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the thread that started it dies
    (Linux), so a killed trainer leaves no server behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGTERM)

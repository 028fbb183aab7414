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

import queue
import threading
from typing import Callable

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
            threading.Thread(target=_spawner_loop, args=(_SPAWN_QUEUE,), name="grpo-server-spawner", daemon=True).start()
        jobs = _SPAWN_QUEUE
    box: list[tuple[bool, object]] = []
    done = threading.Event()
    jobs.put((job, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value

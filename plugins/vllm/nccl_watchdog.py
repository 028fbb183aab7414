"""Deadlines for the NCCL weight sync: a step that never completes fails.

An NCCL collective whose peer never arrives blocks forever, and so does an
HTTP request to a server whose workers are stuck in one (trl#2923, #6796:
a sync that hangs instead of failing). No Python thread blocked in NCCL can
be interrupted, so the sync runs in a daemon thread (:func:`run_with_deadlines`)
that marks each step of the protocol it enters (:class:`ProtocolSteps`); the
caller's thread watches the steps and, when the step in progress has run
longer than the timeout, raises :class:`SyncStepTimeout` naming it and
abandons the stuck thread (a daemon: it does not keep the process alive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from grpo_core.plugin_api import EngineUnavailable

T = TypeVar("T")


class SyncStepTimeout(EngineUnavailable):
    """A step of the NCCL sync did not complete within its timeout; the
    message names the step."""


class ProtocolSteps:
    """Which steps of the protocol are running, and since when (thread-safe:
    the server's requests run in threads of their own).

    The step a timeout names is the innermost running one, the one started
    last: the broadcast round in progress rather than the ``update_weights``
    request that waits for all rounds, the server's side of the handshake
    rather than the trainer's call around it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float]] = {}
        self._next = 0
        self.failed_in: str | None = None  # the step an exception escaped from, first one only

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[int]:
        """Mark ``name`` running for the block (yields its key, for :meth:`touch`)."""
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._running[key] = (name, time.monotonic())
        try:
            yield key
        except BaseException:
            with self._lock:
                self.failed_in = self.failed_in or name
            raise
        finally:
            with self._lock:
                self._running.pop(key, None)

    def touch(self, key: int) -> None:
        """Restart step ``key``'s clock: it made progress (the server's
        ``update_weights`` after each broadcast round it received)."""
        with self._lock:
            if key in self._running:
                name, _ = self._running[key]
                del self._running[key]  # re-inserted last: now the innermost
                self._running[key] = (name, time.monotonic())

    def overdue(self, timeout: float) -> tuple[str, float] | None:
        """The innermost running step and its age, if that age exceeds ``timeout``."""
        with self._lock:
            if not self._running:
                return None
            name, started = max(self._running.values(), key=lambda item: item[1])
        age = time.monotonic() - started
        return (name, age) if age > timeout else None

    def reset(self) -> None:
        with self._lock:
            self._running.clear()
            self.failed_in = None


def run_with_deadlines(
    work: Callable[[], T], steps: ProtocolSteps, timeout: float, describe: Callable[[str, float], str]
) -> T:
    """``work()`` in a daemon thread; its result or exception here. While it
    runs, every step it marks in ``steps`` has ``timeout`` seconds: the first
    one past that raises :class:`SyncStepTimeout` with ``describe(step, age)``
    and leaves the thread behind (it may be blocked in NCCL for good)."""
    steps.reset()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name="grpo-nccl-sync", daemon=True)
    thread.start()
    poll = min(0.1, max(0.005, timeout / 20))
    while not done.wait(poll):
        late = steps.overdue(timeout)
        if late is not None:
            raise SyncStepTimeout(describe(*late))
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]

"""Python's cyclic garbage collector while a run starts.

A run's start-up creates millions of objects that live as long as the run:
the modules of torch, transformers and an inference engine, the model, the
engine. Python's automatic full collection rescans every one of them, and it
comes more often as the heap grows: the time-to-accuracy benchmark's run
(colocated vLLM) made 14 full collections before its first step, 0.01-0.5 s
each and 3.1-3.4 s in all, 7 of them vLLM's own ``gc.collect()`` calls while
it loads (benchmarks/bench_startup_timeline.py). Start-up makes almost no
cyclic garbage (those collections freed 0-134 objects each), so the
collector has nothing to do there; with it off and the heap frozen, the
first step began after 10.9-11.3 s instead of 13.3-15.2 s.

:class:`StartupCollector` turns automatic collection off while the run
starts, and freezes the heap (``gc.freeze``: out of every later scan) before
the engine starts and again once it has, so that the engine's explicit
collections and the training loop's scan only what is new. vLLM does the
same after its own start (``freeze_gc_heap``); this extends it to the
trainer's start-up and to every engine. On leaving, the heap is unfrozen and
the collector left as it was found, so objects of a finished run (a test
session runs many) are collected as usual.
"""

from __future__ import annotations

import gc
from types import TracebackType


class StartupCollector:
    """``with StartupCollector() as collector:`` around a run; call
    :meth:`settle` before the engine starts and :meth:`started` once the run
    has started (the training loop follows)."""

    _was_enabled: bool  # the collector's state on entering, restored on leaving

    def __enter__(self) -> StartupCollector:
        self._was_enabled = gc.isenabled()
        gc.disable()
        return self

    def settle(self) -> None:
        """What is alive now lives for the run: leave it out of every later
        collection's scan (an engine's explicit collections while it loads)."""
        gc.freeze()

    def started(self) -> None:
        """Start-up is over: freeze what it made, and collect automatically
        again (if the collector was on) for the training loop's garbage."""
        self.settle()
        if self._was_enabled:
            gc.enable()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        else:
            gc.disable()

"""Weight syncs between batches, when a producer thread generates ahead.

With ``trl.async_prefetch`` (and without ``trl.in_flight_weight_updates``)
the producer thread generates the next batch while the trainer trains and
then syncs. A batch carries one policy version (the one the engine served
when it started), and every token in it must have been sampled by that
version: the engines change their weights under requests in flight (vLLM's
in-place adapter reload and ``reload_weights`` both do), so a load landing
in the middle of a batch gave tokens of two versions one label (seen on the
real server: ``tests/e2e/vllm/test_async_sync_order.py``).

So the sync's first call that changes the engine's weights waits until the
batch being generated is finished (:meth:`Producer.paused`, the wait a
checkpoint uses) and keeps the next one from starting until the sync is
over and the producer knows the new version. Only the load waits: what a
sync prepares before it (merging, writing files) still overlaps
generation. A sync without an engine, or one that never calls the engine,
is waited for whole (nothing tells when it changed the weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

WEIGHT_CHANGING = frozenset(
    {
        "load_weights",
        "load_weights_from_path",
        "load_adapter",
        "load_adapter_from_url",
        "load_weights_from_url",
        "control_endpoints",  # a sync that drives the servers itself (nccl): held from here to its end
    }
)
"""The :class:`~grpo_core.contract.types.InferenceEngine` methods through
which a weight sync changes what the engine samples."""


class EngineBetweenBatches:
    """The engine as a weight sync sees it: every attribute is the engine's,
    but the first call of a :data:`WEIGHT_CHANGING` method first enters
    ``pause()`` (no batch being made, none starting), held until the sync
    ends (:func:`between_batches`)."""

    def __init__(self, engine: Any, stack: contextlib.ExitStack, pause: Callable[[], Any]) -> None:
        self._engine = engine
        self._stack = stack
        self._pause = pause
        self._held = False
        self._over = False  # the sync returned: a handle it kept no longer waits (nothing would end the wait)

    def _hold(self) -> None:
        if not self._held and not self._over:
            self._stack.enter_context(self._pause())
            self._held = True

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if name not in WEIGHT_CHANGING or not callable(value):
            return value

        def changing(*args: Any, **kwargs: Any) -> Any:
            self._hold()
            return value(*args, **kwargs)

        return changing


@contextlib.contextmanager
def between_batches(engine: Any, pause: Callable[[], Any], synced: Callable[[], None]) -> Iterator[Any]:
    """The engine handle to give the weight sync run inside this block.
    On a normal exit ``synced()`` (the producer learns the new version) runs
    while still paused, so no batch starts between the load and the label;
    a sync that raised leaves the version as it was."""
    with contextlib.ExitStack() as stack:
        if engine is None:
            stack.enter_context(pause())
            yield None
            synced()
            return
        handle = EngineBetweenBatches(engine, stack, pause)
        try:
            yield handle
            handle._hold()  # a sync that changed the weights without the engine's methods: label after the batch
            synced()
        finally:
            handle._over = True

"""Generation requests share a server; a sync check's probe has it alone.

vLLM 0.32's CPU LoRA path crashes the whole engine when a request that asks
for ``prompt_logprobs`` is scheduled in one batch with other requests: the
LoRA logits processor computes the prompt's log-probs with the batch's LoRA
mapping ("einsum(): subscript b has size 5 ... previously seen size 47",
``punica_cpu.add_lora_logits``; seen in the test suite with async prefetch,
where the prefetch thread generates while the trainer checks a sync). So
the probe waits until this process has no generation request in flight on
the server and holds new ones back until it returns (a fraction of a
second). Requests from other processes are beyond its reach: a shared
external server should not be given LoRA layers and sync checks at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ProbeGate:
    """Shared for generation, exclusive for a probe (a probe waiting blocks
    new generation, so a steady stream of requests cannot starve it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generating = 0
        self._probing = False

    @contextmanager
    def generation(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._probing)
            self._generating += 1
        try:
            yield
        finally:
            with self._cond:
                self._generating -= 1
                self._cond.notify_all()

    @contextmanager
    def probe(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._probing)
            self._probing = True
            self._cond.wait_for(lambda: self._generating == 0)
        try:
            yield
        finally:
            with self._cond:
                self._probing = False
                self._cond.notify_all()

"""A vLLM general plugin (``vllm.general_plugins`` entry point) that stops a
CPU server's worker from busy-waiting after each request.

vLLM's worker reads the scheduler's messages from a shared-memory queue and,
after each message, keeps polling it with ``sched_yield`` for one second
before it sleeps (``SpinCondition.busy_loop_s``): on a GPU that saves
microseconds per step. On a CPU whose cores the trainer shares, the worker
then holds a whole core for a second after every generation, weight load
and probe, exactly when the trainer starts computing. Measured on a 2-core
machine: a trainer forward of 48 tokens took 1.13 s right after a request
against 0.15 s a second later, and plain matmuls 4.4x longer
(benchmarks/RESULTS.md, "vLLM's idle spin").

vLLM loads every general plugin in each of its processes (API server,
engine core, workers) before any queue exists. This one does nothing unless
:data:`IDLE_SPIN_ENV` is set, which grpo sets only for the CPU servers it
starts (``grpo run``'s managed servers and ``grpo vllm-serve``; the
colocated engine runs its worker in the trainer's process, with no queue),
so another vLLM in the same environment keeps vLLM's behaviour.
This module must stay free of grpo_core: it runs inside vLLM's processes.
"""

from __future__ import annotations

import os

IDLE_SPIN_ENV = "GRPO_VLLM_IDLE_SPIN_S"
"""Seconds a vLLM worker busy-waits for its next message before it sleeps."""

CPU_IDLE_SPIN_S = "0"
"""What grpo sets on CPU: sleep at once (a CPU decode step takes tens of
milliseconds, so the wake-up's tens of microseconds do not show)."""


def register() -> None:
    """Apply :data:`IDLE_SPIN_ENV` to vLLM's queue readers, if it is set."""
    value = os.environ.get(IDLE_SPIN_ENV)
    if value is None:
        return
    seconds = float(value)
    try:
        # vLLM is optional and slow to import: only when this engine runs
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # a vLLM without this queue: nothing spins there
        return
    if getattr(SpinCondition, "_grpo_idle_spin", None) is not None:
        SpinCondition._grpo_idle_spin = seconds
        return
    original_init = SpinCondition.__init__

    def init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        original_init(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = SpinCondition._grpo_idle_spin

    SpinCondition._grpo_idle_spin = seconds
    SpinCondition.__init__ = init

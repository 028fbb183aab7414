"""Keep the trainer's threads off the cores an inference engine computes on.

When the engine (a managed vLLM server on CPU under ``async_prefetch``) is
pinned to some cores, the trainer moves every thread it has, and every one it
starts later, onto the others, and sizes torch's thread pool to them: two
compute-bound programs on disjoint cores instead of both on all of them.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def format_cpu_list(cores: frozenset[int] | list[int] | None) -> str:
    """``{0, 2, 3}`` -> ``"0,2,3"`` (the syntax vLLM and taskset read)."""
    return ",".join(str(c) for c in sorted(cores or ()))


def confine_to(cores: frozenset[int]) -> frozenset[int]:
    """Pin every thread of this process to ``cores`` (threads started later
    inherit it) and size torch's intra-op pool to match. Returns the cores
    actually applied (``cores`` within what this process may use; empty when
    nothing was done)."""
    cores = frozenset(cores) & process_cpus()
    if not cores or not hasattr(os, "sched_setaffinity"):
        return frozenset()
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass
    # heavy (torch): loaded on first use, not with this module
    import torch

    torch.set_num_threads(len(cores))
    return cores


def keep_off_engine_cores(engine_cores: frozenset[int] | None) -> frozenset[int]:
    """Confine the trainer to the cores the engine does not use; returns the
    trainer's cores, or an empty set when there is no split (no engine cores,
    or they would leave the trainer nothing)."""
    if not engine_cores:
        return frozenset()
    rest = process_cpus() - frozenset(engine_cores)
    return confine_to(rest) if rest else frozenset()

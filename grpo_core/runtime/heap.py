"""glibc malloc's thresholds while a run trains on a CPU.

A training step on a CPU allocates and frees the same large buffers again and
again: activations, the LM head's logit chunks (48 MiB each in float32 for a
49k vocabulary), gradients, the merged weights of a sync. glibc serves every
allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a
fresh ``mmap`` and returns the top of its heap to the kernel once more than
the trim threshold lies free there, so each step's buffers come back as new
pages whose first touch is a page fault (the kernel zeroes the page). The
time-to-accuracy benchmark's step took 200,000-360,000 such faults, about
2.5 us each when timed alone on the 2-core VM where it was measured.

:class:`RetainedHeap` raises both thresholds for the run, so buffers up to
1 GiB come from the heap and freed ones stay there for the next step: the
faults stop after the first steps (about 200 a step), and the process keeps
its peak heap, as PyTorch's caching allocator keeps GPU memory (peak resident
memory +1.5% in that run, +7% for the trainer alone). The trainer's
forward+backward of a micro-batch was 1.03-1.20x faster in 4 of 4
alternating pairs, and a whole 30-step run 1.07x (the first 8 steps gain
least, while the heap still grows; benchmarks/RESULTS.md, "Freed memory
kept for reuse"). On leaving, trimming comes back and what the run freed is
handed back (``malloc_trim``); the mmap threshold stays raised, since glibc
has no call to restore its dynamic one. Where the C library is not glibc
(musl, macOS), nothing changes.
"""

from __future__ import annotations

import ctypes
import platform
from types import TracebackType
from typing import Any

# mallopt(3) parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap. Some glibc releases refuse more than half their arena size
# (32 MiB; 2.36 takes 1 GiB), so that is tried next: it still covers a float32 logit chunk of 32k vocabularies.
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_NEVER = 2**31 - 1  # mallopt takes an int: the largest means "do not trim"
TRIM_DEFAULT = 128 << 10  # glibc's default trim threshold


def glibc() -> Any | None:
    """The running glibc's functions (``mallopt``, ``malloc_trim``), or None
    where the C library is another or does not have them."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


class RetainedHeap:
    """``with RetainedHeap(enabled):`` around a run: while ``enabled``,
    glibc keeps freed memory for reuse (module docstring). :attr:`mmap_threshold`
    says what was set: None where nothing was (disabled, not glibc, refused)."""

    mmap_threshold: int | None = None

    def __init__(self, enabled: bool, libc: Any | None = None) -> None:
        self.enabled = enabled
        self._libc = libc

    def __enter__(self) -> RetainedHeap:
        if not self.enabled:
            return self
        libc = self._libc if self._libc is not None else glibc()
        if libc is None:
            return self
        self._libc = libc
        for threshold in MMAP_THRESHOLDS:
            if libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1:
                self.mmap_threshold = threshold
                break
        if self.mmap_threshold is not None:
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.mmap_threshold is None:
            return
        self._libc.mallopt(M_TRIM_THRESHOLD, TRIM_DEFAULT)
        self._libc.malloc_trim(0)

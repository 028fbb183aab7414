"""What this machine has, read without importing torch: the CPU's flags and
whether there is a CUDA device. Callers look these up on the module
(``machine.cuda_available()``), so a test fakes a machine class with one
``monkeypatch.setattr(machine, ...)``."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_flags() -> str:
    """The ``flags`` line(s) of /proc/cpuinfo ('' where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_fast_bf16(flags: str | None = None) -> bool:
    """True when this x86 CPU computes bf16 natively (AVX512-BF16 or AMX).

    Without it vLLM's CPU backend emulates bf16 and generates several times
    slower than in float32 (21 vs 114 tokens/s for SmolLM2 on one core of an
    AVX2 machine; benchmarks/RESULTS.md). ``flags`` is the cpuinfo text to
    judge (tests pass a fake one); unset, this machine's."""
    words = set((cpu_flags() if flags is None else flags).split())
    return bool(words & {"avx512_bf16", "amx_bf16"})


def cuda_available() -> bool:
    """Whether this machine has a CUDA device, without importing torch."""
    return Path("/proc/driver/nvidia/version").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 "))

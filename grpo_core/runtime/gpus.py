"""How many GPUs this machine's training processes see, for the checks that
count them (a training process's own GPU by local rank, ``[vllm] devices``).

``grpo config check --gpus N`` judges a config for a machine with N GPUs, not
this one (a login node checking a config for the cluster); otherwise the count
is ``torch.cuda.device_count()``, with ``CUDA_VISIBLE_DEVICES`` applied, which
counts without starting CUDA in this process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_assumed: int | None = None


@contextmanager
def assume_gpus(count: int | None) -> Iterator[None]:
    """Within the block, :func:`visible_gpus` answers ``count`` (``None``:
    this machine's own)."""
    global _assumed
    before, _assumed = _assumed, count
    try:
        yield
    finally:
        _assumed = before


def visible_gpus() -> int:
    """The GPUs the training processes of the machine the check is for see;
    0 on a machine without GPUs."""
    if _assumed is not None:
        return _assumed
    import torch  # imported when a check counts GPUs: plugin_api itself stays light

    return int(torch.cuda.device_count())


def gpu_count_source() -> str:
    """Where :func:`visible_gpus`' answer came from, for a message."""
    if _assumed is not None:
        return f"--gpus {_assumed}: the machine the check is for"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    return f"torch.cuda.device_count() with {shown}; --gpus N checks for another machine"

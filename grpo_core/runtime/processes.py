"""Which training process this is, and how many there are: what the launcher
(``accelerate launch``, ``torchrun``, ``grpo run --num-processes``) put in the
environment, or the process group once one is joined.

Below the config layer: the config checks judge batch shapes by the world
size before any process group exists, and the trainer reads the same facts.
"""

from __future__ import annotations

import os

import torch


def world_size() -> int:
    """Training processes in this run: the joined process group's size, else
    what the launcher put in the environment (``WORLD_SIZE``), else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def process_rank() -> int:
    """This process's rank (0 when alone), known before accelerate joins the
    processes: launchers put it in ``RANK``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def launched_by_launcher() -> bool:
    """True inside a process started by ``accelerate launch``/``torchrun``."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ

"""Read checkpoint files without running code from them.

``torch.load(..., weights_only=False)`` unpickles: a checkpoint someone else
wrote (downloaded, shared on a cluster, left in a world-writable directory)
could run any code on resume. Every ``.pt`` file grpo reads goes through
:func:`safe_load`, which uses torch's restricted unpickler
(``weights_only=True``): tensors, plain containers and numbers, plus grpo's
own plain dataclasses (:func:`grpo_types`), which have no custom
``__setstate__``/``__reduce__`` and so cannot run code when rebuilt. Anything
else is refused with a :class:`UnsafeCheckpoint` naming the file.

:func:`unloadable_reason` is the same test applied before writing, so grpo
never writes a checkpoint it would refuse to read back.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from grpo_core.contract import types as contract_types
from grpo_core.contract.errors import GrpoError
from grpo_core.generation.producer import ScoredBatch


class UnsafeCheckpoint(GrpoError):
    """A checkpoint file holds objects that only executing code could rebuild.
    The message names the file and the object type that was refused."""


def grpo_types() -> list[type]:
    """grpo's own plain dataclasses that checkpoints may hold (the pending
    batch of a run with ``num_iterations > 1``, the batches ``async_prefetch``
    generated ahead of training): every dataclass in
    :mod:`grpo_core.contract.types` and the producer's :class:`ScoredBatch`."""
    found: list[type] = [ScoredBatch]
    for value in vars(contract_types).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == contract_types.__name__:
            found.append(value)
    return found


FORMER_MODULES: dict[str, tuple[str, ...]] = {
    "grpo_core.contract.types": ("grpo_core.types",),  # before grpo_core's modules moved into layer folders
    "grpo_core.generation.producer": ("grpo_core.training.producer",),  # before training/ was split by role
}
"""Where the modules of :func:`grpo_types` lived before: a checkpoint names a
type by the module it had when written (``grpo_core.types.Completion``). When
a module of checkpointed types moves, its old name goes here."""


def names_before_the_move() -> list[tuple[type, str]]:
    """grpo's types under the module paths they had before (:data:`FORMER_MODULES`),
    so a checkpoint written then still loads."""
    return [
        (kind, f"{old}.{kind.__qualname__}") for kind in grpo_types() for old in FORMER_MODULES.get(kind.__module__, ())
    ]


def numpy_array_types() -> list[Any]:
    """What a pickled numpy array needs (checkpoints written before grpo read
    them safely kept numpy's RNG state as an array). These rebuild raw numeric buffers only."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _reason(exc: BaseException) -> str:
    """What torch's long weights-only error refused, in a few words. Its
    advice to allowlist the global is left out on purpose: for a file
    someone else wrote, that advice is how the code would get to run."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"the Python global `{found.group(1)}`"
    found = re.search(r"Unsupported operand (\d+)", text)
    if found:
        return f"pickle opcode {found.group(1)}, which the safe loader does not run"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


def _load(source: str | Path | BinaryIO, allow: Iterable[Any]) -> Any:
    with torch.serialization.safe_globals([*grpo_types(), *names_before_the_move(), *allow]):
        return torch.load(source, map_location="cpu", weights_only=True)


def safe_load(path: Path, allow: Iterable[Any] = ()) -> Any:
    """Load a ``.pt`` file with the restricted unpickler, or refuse it.

    ``allow`` adds globals beyond grpo's types (numpy arrays, for an old RNG
    file). Raises :class:`UnsafeCheckpoint` naming ``path`` when the file
    asks for anything else; nothing in it has run by then."""
    try:
        return _load(path, allow)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(
            f"refused to load {path}: it asks for {_reason(exc)}, which loading safely does not allow (unpickling "
            "it could run code from the checkpoint). grpo reads checkpoints as tensors and plain data only. If you "
            "wrote this checkpoint yourself with a plugin whose state is not plain data, fix the plugin's "
            "state_dict(); if it came from someone else, do not resume from it (start without "
            "resume_from_checkpoint)."
        ) from None
    except Exception as exc:  # a damaged pickle: OSError, EOFError, a KeyError from a broken memo, a struct.error...
        said = str(exc).strip()[:300] or ("the file ends early" if isinstance(exc, EOFError) else "no detail")
        raise GrpoError(
            f"could not read {path}: {type(exc).__name__}: {said}. The checkpoint is damaged or "
            "not a grpo checkpoint: resume from an earlier one, or start without resume_from_checkpoint."
        ) from None


def unloadable_reason(value: Any) -> str | None:
    """Why :func:`safe_load` would refuse ``value`` once saved, or None if it
    reads back. Serialises into memory and reads it back: the exact test."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:  # a lambda, a lock, a local class
        return f"an object that cannot be saved at all ({exc})"
    buffer.seek(0)
    try:
        _load(buffer, ())
    except pickle.UnpicklingError as exc:
        return _reason(exc)
    return None

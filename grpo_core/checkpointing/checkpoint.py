"""Checkpoints that are either complete or absent.

A checkpoint is written into a temporary sibling directory and renamed into
place only after every file (weights, optimizer, scheduler, RNG, trainer
state) is on disk and flushed, with ``trainer_state.json`` written last. A
crash while saving therefore leaves at most a ``.tmp-`` directory, which
loading ignores, never a ``checkpoint-N`` that looks valid but is not.
Such leftovers are removed when the next run starts
(:func:`recover_interrupted_saves`).

A write that fails (disk full, quota, file-size limit) is reported as a
:class:`~grpo_core.contract.errors.StorageError` naming ``output_dir`` and the last
complete checkpoint, which the failed write never touches.

Loading never runs code from the checkpoint: weights are safetensors, the
trainer state is JSON, and the ``.pt`` files (optimizer, scheduler, RNG,
plugin state, the batch still being trained on and, with ``async_prefetch``, the
batches generated ahead of training) are read with torch's restricted unpickler
(:mod:`grpo_core.checkpointing.safe_load`). Saving checks that each plugin's state
reads back under the same rule, so grpo never writes what it would refuse.

Each checkpoint also holds ``manifest.json``: every file's size and CRC-32 and
how the run was made (:mod:`grpo_core.checkpointing.integrity`,
:mod:`grpo_core.checkpointing.record`). Reading checks them before the model
loads: a file cut short or changed is named, never a library's traceback.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.checkpointing.integrity import MANIFEST, RESUME_OUT, check_files, differs_from_manifest, write_manifest
from grpo_core.checkpointing.record import RECORD_KEY
from grpo_core.checkpointing.safe_load import numpy_array_types, safe_load, unloadable_reason
from grpo_core.contract.errors import ConfigError, GrpoError, StorageError

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
PARTIAL_PREFIXES = (f".tmp-{PREFIX}", f".old-{PREFIX}")


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as tensors and plain data (numpy's key
    as a list of ints, not an array, so reading it back needs no numpy
    globals)."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in key], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output (or an older checkpoint's, whose numpy
    key is an array)."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_state_is_plain(extra_state: dict[str, Any]) -> None:
    """Refuse to save plugin state that :func:`safe_load` could not read back.

    Anything but tensors and plain data (dict, list, tuple, str, int, float,
    bool, None; a plugin's own state is held to JSON data before this, by
    :func:`plugin_state`) would need code to rebuild, which loading refuses.
    Raised before anything is written, so the previous checkpoint stays the latest."""
    for name, value in extra_state.items():
        reason = unloadable_reason(value)
        if reason is not None:
            raise GrpoError(
                f"cannot checkpoint the state of '{name}': its state_dict() holds something that loading would "
                f"have to run code to rebuild ({reason}). A plugin's state_dict() must return plain JSON data "
                "(dict, list, str, int, float, bool, None): convert other objects to those."
            )


def plugin_state(name: str, plugin: Any) -> Any:
    """``plugin.state_dict()``, refused unless it is plain JSON data (the
    contract: docs/plugins.md, "State that survives a resume"), naming the
    first value that is not and how to store it."""
    state = plugin.state_dict()
    problem = _not_json(state, "state_dict()")
    if problem is not None:
        raise GrpoError(
            f"cannot checkpoint the state of '{name}': {problem}. A plugin's state_dict() returns plain JSON data "
            "(dicts with string keys, lists, strings, numbers, booleans, None): store a ScoredGroup as "
            "group.to_dict() (ScoredGroup.from_dict reads it back), a tensor as .tolist()."
        )
    return state


def _not_json(value: Any, where: str) -> str | None:
    """Where ``value`` holds something other than JSON data, or None."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r}, a {type(key).__name__}, not a string"
            problem = _not_json(item, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        return next((p for i, item in enumerate(value) if (p := _not_json(item, f"{where}[{i}]")) is not None), None)
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    extra_state: dict[str, Any],
    total_limit: int | None = None,
    extra_dirs: dict[str, Path] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-<step>`` atomically and prune old ones.

    ``extra_dirs`` (name -> a directory already written, e.g. DeepSpeed's
    per-rank partitions) are moved inside before the checkpoint is renamed
    into place, so they are part of the same all-or-nothing write.

    Raises :class:`StorageError` when the files cannot be written: the
    libraries that write them (torch, safetensors, tokenizers) report a full
    disk as ``RuntimeError`` or their own types, not ``OSError``, so any
    failure while writing counts; the state is gathered before, so a bug
    there still shows its traceback.
    """
    final = output_dir / f"{PREFIX}{step}"
    made_with = extra_state.get(RECORD_KEY)  # the run's record goes to manifest.json
    extra_state = {name: state for name, state in extra_state.items() if name != RECORD_KEY}
    check_state_is_plain(extra_state)
    optimizer_state = optimizer.state_dict()
    scheduler_state = scheduler.state_dict()
    rng = rng_state()
    tmp: Path | None = None
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}{step}-", dir=output_dir))
        model.save_pretrained(tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler_state, tmp / "scheduler.pt")
        torch.save(rng, tmp / "rng_state.pt")
        torch.save(extra_state, tmp / "extra_state.pt")
        for name, directory in (extra_dirs or {}).items():
            shutil.move(str(directory), str(tmp / name))
        write_manifest(tmp, made_with)  # every file's size and checksum, before the state file that completes it
        (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        _fsync_tree(tmp)
        _move_into_place(tmp, final)
    except Exception as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(_write_failure(final, exc)) from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if total_limit:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``. A checkpoint already at ``final`` (the same
    step saved again, e.g. before a reward error stops the run) is renamed
    aside and deleted only afterwards: deleting it first would leave no
    complete copy for as long as the deletion takes."""
    aside: Path | None = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(aside)
    tmp.rename(final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _write_failure(final: Path, exc: Exception) -> str:
    """The message of a failed checkpoint write: what failed, the free
    space, and which checkpoint is still there to resume from."""
    output_dir = final.parent
    try:
        free = f" ({shutil.disk_usage(output_dir).free / 2**30:.1f} GiB free there)"
    except OSError:
        free = ""
    previous = [p for p in list_checkpoints(output_dir) if p != final]
    if previous:
        kept = (
            f'The previous checkpoint {previous[-1]} is intact: resume with resume_from_checkpoint = "{previous[-1]}".'
        )
    else:
        kept = "No earlier checkpoint exists in output_dir."
    return (
        f"could not write checkpoint {final}: {type(exc).__name__}: {exc}. Make room in output_dir "
        f"{output_dir}{free} or point output_dir at a disk with space (a full disk, a quota or a "
        f"file-size limit cause this). {kept}"
    )


def recover_interrupted_saves(output_dir: Path) -> list[str]:
    """Tidy what a crash while saving left in ``output_dir``; return one line
    per action, for the log. Called when a run starts.

    A ``.tmp-checkpoint-*`` directory was still being written: deleted (it is
    never resumed from, but can be as big as a checkpoint). A complete
    ``.old-checkpoint-N-*`` whose ``checkpoint-N`` is missing was renamed
    aside by :func:`_move_into_place` just before the crash: renamed back.
    Any other ``.old-`` copy is deleted.
    """
    if not output_dir.is_dir():
        return []
    actions = []
    for path in sorted(output_dir.iterdir()):
        if not path.is_dir() or not path.name.startswith(PARTIAL_PREFIXES):
            continue
        if path.name.startswith(".old-"):
            final = output_dir / path.name[len(".old-") :].rsplit("-", 1)[0]
            if not final.exists() and (path / STATE_FILE).is_file():
                path.rename(final)
                actions.append(f"restored {final}: a run crashed while replacing it")
                continue
        shutil.rmtree(path, ignore_errors=True)
        if path.name.startswith(".tmp-"):
            actions.append(f"removed {path}: an incomplete checkpoint left by a run that crashed while saving")
        else:
            actions.append(f"removed {path}: a replaced checkpoint a crashed run had not deleted yet")
    return actions


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX) :]
        if suffix.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found)]


def resolve_resume(spec: str | None, output_dir: Path) -> Path | None:
    """``resume_from_checkpoint``: a path, or ``latest`` (None if there is none yet)."""
    if spec is None:
        return None
    if spec == "latest":
        existing = list_checkpoints(output_dir)
        return existing[-1] if existing else None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a complete grpo checkpoint (no {STATE_FILE})")
    return path


@dataclass
class LoadedCheckpoint:
    """Everything in a checkpoint but the model weights, read and checked."""

    path: Path
    trainer_state: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # damaged files a resume does not need, skipped


def read_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read every state file of ``path`` without running code from it.

    Called before the model loads, so a checkpoint that asks for code is
    refused in seconds (:class:`~grpo_core.checkpointing.safe_load.UnsafeCheckpoint`,
    naming the file) and nothing has been restored from it. Checkpoints
    written before this rule load too: theirs hold the same data, with
    numpy's RNG key as an array, allowed for that file only.

    Every file is then checked against the checkpoint's manifest (sizes and
    checksums) and every safetensors file against its header
    (:func:`~grpo_core.checkpointing.integrity.check_files`): a damaged file a
    resume needs is a :class:`GrpoError` naming it; others become ``notes``."""
    try:
        trainer_state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GrpoError(f"could not read {path / STATE_FILE}: {exc}. Resume from another checkpoint.") from None
    if not isinstance(trainer_state, dict) or not isinstance(trainer_state.get("step"), int):
        raise GrpoError(
            f"{path / STATE_FILE} is not a grpo trainer state (no integer 'step'). Resume from another checkpoint."
        )
    files = {name: path / f"{name}.pt" for name in ("optimizer", "scheduler", "rng_state", "extra_state")}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise GrpoError(
            f"checkpoint {path} is incomplete: {', '.join(missing)} missing. Resume from another checkpoint."
        )
    state: dict[str, Any] = {}
    for name, file in files.items():  # the safe loader first: a file that would run code is named as such
        try:
            state[name] = safe_load(file, allow=numpy_array_types() if name == "rng_state" else ())
        except GrpoError as exc:
            if not differs_from_manifest(path, file.name):
                raise
            raise type(exc)(
                f"{exc} Its bytes also differ from those saved with the checkpoint ({MANIFEST}): it was damaged "
                "or replaced after saving."
            ) from None
    loaded = LoadedCheckpoint(
        path=path,
        trainer_state=trainer_state,
        optimizer=state["optimizer"],
        scheduler=state["scheduler"],
        rng=state["rng_state"],
        extra=state["extra_state"],
    )
    loaded.notes = check_files(path)
    return loaded


def restore_checkpoint(loaded: LoadedCheckpoint, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Put a :func:`read_checkpoint` result's optimizer, scheduler and RNG
    state into place (the model weights are loaded by the caller)."""
    if loaded.optimizer is not None:  # None: the caller restored it (DeepSpeed's own files)
        optimizer.load_state_dict(loaded.optimizer)
    scheduler.load_state_dict(loaded.scheduler)
    set_rng_state(loaded.rng)


def load_checkpoint(
    path: Path, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore optimizer, scheduler and RNG; return (trainer_state, extra_state).

    Model weights are loaded by the caller (adapter vs full model differ)."""
    loaded = read_checkpoint(path)
    restore_checkpoint(loaded, optimizer, scheduler)
    return loaded.trainer_state, loaded.extra


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, or a :class:`GrpoError` naming it."""
    # heavy (safetensors): loaded on first use, not with this module
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors' own SafetensorError, OSError, a JSON error in the header
        raise GrpoError(
            f"could not read {file}: {type(exc).__name__}: {str(exc).strip()[:300]}. The file is damaged (cut short "
            f"by a full disk or an interrupted copy?). {RESUME_OUT}"
        ) from None


def _shape_mismatch(path: Path, exc: RuntimeError) -> GrpoError:
    """The weights of ``path`` do not fit the model this config builds."""
    sizes = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
    shown = "; ".join(sizes[:3]) + (f" (and {len(sizes) - 3} more)" if len(sizes) > 3 else "")
    return GrpoError(
        f"checkpoint {path}'s weights do not fit the model this config builds: {shown or str(exc)[:300]}. Set "
        "base_model, adapter, lora_r, lora_target_modules and special_tokens as they were when it was saved, or "
        "start without resume_from_checkpoint."
    )


def load_model_weights(model: Any, path: Path) -> None:
    """Load checkpointed weights into ``model`` in place (adapter or full)."""
    model_dir = path / "model"
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.is_file():
        # heavy (peft): loaded on first use, not with this module
        from peft import set_peft_model_state_dict

        weights = _read_weights(adapter)
        try:
            set_peft_model_state_dict(model, weights)
        except RuntimeError as exc:  # torch: "Error(s) in loading state_dict ... size mismatch"
            raise _shape_mismatch(path, exc) from None
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GrpoError(f"checkpoint {path} has no weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_read_weights(file))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise _shape_mismatch(path, exc) from None
    real_missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are not saved twice
    if real_missing or unexpected:
        raise GrpoError(
            f"checkpoint {path} does not match the model: missing {real_missing[:3]}, unexpected {unexpected[:3]}"
        )

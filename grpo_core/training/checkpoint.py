"""Checkpoints that are either complete or absent.

A checkpoint is written into a temporary sibling directory and renamed into
place only after every file (weights, optimizer, scheduler, RNG, trainer
state) is on disk and flushed, with ``trainer_state.json`` written last. A
crash while saving therefore leaves at most a ``.tmp-`` directory, which
loading ignores, never a ``checkpoint-N`` that looks valid but is not.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.errors import ConfigError, GrpoError

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
) -> Path:
    """Write ``output_dir/checkpoint-<step>`` atomically and prune old ones."""
    final = output_dir / f"{PREFIX}{step}"
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}{step}-", dir=output_dir))
    try:
        model.save_pretrained(tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng_state.pt")
        torch.save(extra_state, tmp / "extra_state.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GrpoError(f"could not save checkpoint {final}: {exc}. The previous checkpoint is intact.") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if total_limit:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore optimizer, scheduler and RNG; return (trainer_state, extra_state).

    Model weights are loaded by the caller (adapter vs full model differ)."""
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng_state.pt", weights_only=False))
    extra = torch.load(path / "extra_state.pt", weights_only=False)
    state = json.loads((path / STATE_FILE).read_text())
    return state, extra


def load_model_weights(model: Any, path: Path) -> None:
    """Load checkpointed weights into ``model`` in place (adapter or full)."""
    model_dir = path / "model"
    from safetensors.torch import load_file

    adapter = model_dir / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter)))
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GrpoError(f"checkpoint {path} has no weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are not saved twice
    if real_missing or unexpected:
        raise GrpoError(f"checkpoint {path} does not match the model: missing {real_missing[:3]}, unexpected {unexpected[:3]}")

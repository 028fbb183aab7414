"""Whether a folder of weights is whole, read from the files' headers only.

A model or adapter folder grpo loads (``base_model``, a merged model a run
wrote, ``grpo eval --adapter``, ``grpo merge``) can hold a safetensors file
cut short by a full disk or an interrupted copy; the libraries then fail
with ``SafetensorError: Error while deserializing header`` and a traceback.
:func:`check_weight_folder` names the file first, from its header: 8 bytes of
length, a JSON table of tensors and their byte ranges, which must end where
the file ends. The same test serves a checkpoint's weights
(:mod:`grpo_core.checkpointing.integrity`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from grpo_core.contract.errors import ConfigError


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or ``None``."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"it is {size} bytes long, shorter than a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                return f"its header says {length} bytes of table follow, but the file has {size - 8}: cut short"
            table = json.loads(handle.read(length).decode("utf-8"))
    except OSError as exc:
        return f"it cannot be read: {exc}"
    except (UnicodeDecodeError, ValueError) as exc:
        return f"its header is not a safetensors table ({type(exc).__name__}: {str(exc)[:120]})"
    if not isinstance(table, dict):
        return "its header is not a safetensors table"
    end = 0
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"its header's entry for {name!r} has no byte range"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return f"its tensors need {8 + length + end} bytes but the file has {size}: " + (
            "cut short" if size < 8 + length + end else "it has bytes no tensor accounts for"
        )
    return None


def check_weight_folder(folder: str | Path, key: str) -> None:
    """Refuse a local model or adapter folder whose safetensors files or JSON
    configs are damaged, naming the file and ``key`` (the setting or option
    that names the folder). Not a local folder (a hub id): nothing to check."""
    root = Path(folder)
    if not root.is_dir():
        return
    for path in sorted(root.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            raise ConfigError(
                f"{key}: {path} is damaged: {problem}. Copy or write the model again (a full disk or an "
                "interrupted copy causes this)."
            )
    for name in ("config.json", "adapter_config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(
                f"{key}: {path} is damaged ({type(exc).__name__}: {str(exc)[:160]}). Copy or write the model again."
            ) from None

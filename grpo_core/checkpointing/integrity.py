"""Is every file of a checkpoint the one that was saved?

:func:`write_manifest` records, when a checkpoint is written, each file's size
and CRC-32 in ``manifest.json`` (with how the run was made,
:mod:`grpo_core.checkpointing.record`). :func:`check_files` compares them on
resume, before the model loads: a file cut short (a disk that filled during a
copy, an interrupted transfer) or changed by a single byte is named, with the
fix. Files a resume reads (weights, the ``.pt`` state, DeepSpeed's partitions)
refuse the resume; others (the tokenizer and README copies beside the
weights) are reported and skipped. Checkpoints written before the manifest
existed get the checks that need no record: every safetensors file's header
must parse and its tensors must fit in the file.

CRC-32 finds damage, not tampering: what keeps a hostile checkpoint from
running code is the safe loader (:mod:`grpo_core.checkpointing.safe_load`).
Measured on this 2-core machine (shared): ``zlib.crc32`` over 256 MB in memory at
682 MB/s (load ~5); :func:`checksum` of SmolLM2's 538 MB ``model.safetensors`` at
148 MB/s (load ~10). So a LoRA checkpoint (tens of MB) costs a fraction of a
second and SmolLM2's full fine-tune (1.6 GB with the optimizer state) 2-11 s, on
save and again on resume.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from grpo_core.contract.errors import GrpoError
from grpo_core.modeling.weight_files import safetensors_problem

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 1 << 22
RESUME_OUT = "Resume from another checkpoint (resume_from_checkpoint), or start without resume_from_checkpoint."


def checksum(path: Path) -> int:
    """CRC-32 of the file's bytes."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def write_manifest(root: Path, made_with: dict[str, Any] | None, skip: tuple[str, ...] = ()) -> Path:
    """``root/manifest.json``: every file under ``root`` (but ``skip``) with
    its size and CRC-32, and ``made_with``."""
    files = {
        str(f.relative_to(root)): {"bytes": f.stat().st_size, "crc32": checksum(f)}
        for f in _files(root)
        if f.name not in skip and f.name != MANIFEST
    }
    target = root / MANIFEST
    target.write_text(json.dumps({"format": FORMAT, "files": files, "made_with": made_with}, indent=1))
    return target


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of checkpoint ``root``; ``None`` for a checkpoint written
    before grpo kept one. A damaged manifest is an error: nothing else in
    the checkpoint can be checked without it."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise ValueError("no 'files' table")
        for name, entry in data["files"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
                raise ValueError(f"the entry of {name!r} has no size")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GrpoError(
            f"{path} is damaged ({type(exc).__name__}: {str(exc)[:200]}), so checkpoint {root}'s files cannot be "
            f"verified. {RESUME_OUT} (Deleting {MANIFEST} resumes without the check, as for a checkpoint written "
            "before grpo recorded one.)"
        ) from None
    return data


def needed_for_resume(relative: str) -> bool:
    """Whether a resume reads the file: the state files, the weights, a
    training backend's own partitions. The tokenizer, config and README
    copies beside the weights are there for people and other tools."""
    parts = Path(relative).parts
    if len(parts) == 1:
        return relative.endswith(".pt") or relative in {"trainer_state.json", MANIFEST}
    if parts[0] == "model":
        return relative.endswith((".safetensors", ".bin"))
    return True  # a backend's own folder (DeepSpeed's ZeRO partitions)


def differs_from_manifest(root: Path, relative: str) -> bool:
    """Whether ``relative``'s bytes differ from those its checkpoint's manifest
    recorded (``False`` without a manifest, or one that does not list it)."""
    try:
        manifest = read_manifest(root)
    except GrpoError:
        return False
    entry = (manifest or {}).get("files", {}).get(relative)
    path = root / relative
    if entry is None or not path.is_file():
        return False
    if path.stat().st_size != entry["bytes"]:
        return True
    return "crc32" in entry and checksum(path) != entry["crc32"]


def check_files(root: Path) -> list[str]:
    """Check every file of checkpoint ``root`` against its manifest (and every
    safetensors file against its own header). Raises :class:`GrpoError`
    naming each damaged file a resume needs; returns one note per damaged
    file it does not need (skipped)."""
    manifest = read_manifest(root)
    fatal: list[str] = []
    notes: list[str] = []
    named: set[str] = set()

    def found(relative: str, problem: str) -> None:
        named.add(relative)
        (fatal if needed_for_resume(relative) else notes).append(f"{root / relative}: {problem}")

    recorded = manifest["files"] if manifest is not None else {}
    for relative, entry in recorded.items():
        path = root / relative
        if not path.is_file():
            found(relative, "missing (the manifest lists it)")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            how = "cut short" if size < entry["bytes"] else "longer than"
            found(relative, f"{size} bytes, {how} the {entry['bytes']} it had when saved")
        elif "crc32" in entry and checksum(path) != entry["crc32"]:
            found(relative, "damaged: its bytes differ from those saved (CRC-32 mismatch)")
    for path in _files(root):
        relative = str(path.relative_to(root))
        if path.suffix == ".safetensors" and relative not in named:
            problem = safetensors_problem(path)
            if problem is not None:
                found(relative, problem)
    if fatal:
        raise GrpoError(
            f"checkpoint {root} is damaged: "
            + "; ".join(fatal)
            + f". {RESUME_OUT}"
            + (" (A copy that was interrupted or a disk that filled up causes this.)" if manifest else "")
        )
    return [f"{line}; not needed to resume, skipped" for line in notes]

"""Weight syncs through the filesystem, to any engine that loads from a path.

* ``lora_filesystem``: save the PEFT adapter, then the engine loads it in
  place (``/v1/load_lora_adapter``) and serves it.
* ``full_filesystem``: save the weights a LoRA changes merged into the base
  (or all weights, for full fine-tuning) as safetensors; the engine reloads
  them in place (``reload_weights``) and resets its prefix cache.

Both work against any engine handle (:class:`~grpo_core.contract.types.InferenceEngine`)
that declares the capability they need, not a particular client. Each
version goes to a fresh directory (written under a temporary name and
renamed, so the engine never reads half a file; a new path also keeps vLLM
from reusing prefix-cache blocks computed with the old weights). Older
versions are deleted; the newest stays until the next sync, because an
engine that restarts re-applies it (with ``async_prefetch``, the
``prefetch_depth`` before it too: requests made ahead may still use them). NCCL transfer to GPU servers is
:mod:`grpo_plugins.vllm.nccl_sync`; a server that cannot read this machine's files gets the
weights over HTTP (:mod:`grpo_plugins.weight_sync_http`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.plugin_api import (
    ADAPTER_FROM_PATH,
    WEIGHTS_FROM_PATH,
    ConfigError,
    InferenceEngine,
    SyncResult,
    atomic_directory,
    hookimpl,
    in_dtype,
    make_scratch_dir,
    merged_weights,
    remove_scratch_dir,
    save_adapter,
)

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig, RunContext


def memory_backed_dir() -> str | None:
    """``/dev/shm`` where this OS has a writable one (Linux), else the
    system's temporary directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class _FilesystemSync:
    """What both syncs share: versioned directories handed to the engine.

    An engine on this machine reads them from a private (0700) temporary
    directory, memory-backed where the OS has one, so a sync costs no disk
    I/O and leaves nothing in ``output_dir``; an engine elsewhere reads them
    from ``output_dir/<subdir>`` (a filesystem both sides share). Either is
    removed when training ends; a temporary directory left by a killed run
    is removed by the next run's first sync (:mod:`grpo_core.runtime.scratch`)."""

    subdir = ""
    kind = ""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.root: Path | None = None  # chosen at the first sync, by where the engine runs
        self._lock = threading.Lock()

    def _save(self, model: Any, out: Path, engine: InferenceEngine) -> None:
        raise NotImplementedError

    def _apply(self, engine: InferenceEngine, path: Path) -> None:
        raise NotImplementedError

    def _root_for(self, engine: InferenceEngine) -> Path:
        if self.root is None:
            if engine.same_host:
                self.root = make_scratch_dir(f"grpo-{self.kind}-", memory_backed_dir())
            else:
                self.root = Path(self.context.output_dir) / self.subdir
        return self.root

    def _write_version(self, model: Any, version: int, engine: InferenceEngine) -> Path:
        target = self._root_for(engine) / f"v{version}"
        with atomic_directory(target) as tmp:
            self._save(model, tmp, engine)
        return target

    def _kept_versions(self) -> int:
        """Versions whose directories stay on disk. With ``async_prefetch``
        the prefetch thread's requests, submitted under an older version's
        path, may be scheduled after the next sync, and vLLM loads a LoRA
        from its path only then: a deleted directory kills the server's
        engine (FileNotFoundError for adapter_config.json, seen in
        tests/e2e/reliability/test_async_resume.py). So the versions a batch made
        ahead may still be generating with stay too."""
        trl = self.context.config.trl
        return 1 + (int(trl.prefetch_depth or 1) if trl.async_prefetch else 0)

    def _prune(self, keep: Path) -> None:
        def number(path: Path) -> int:
            return int(path.name[1:]) if path.name[1:].isdigit() else -1

        older = sorted((p for p in keep.parent.glob("v*") if p.is_dir() and p != keep), key=number)
        for old in older[: max(0, len(older) - (self._kept_versions() - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        if engine is None:
            raise ConfigError(
                f"weight sync '{self.kind}' sends weights to an inference engine, but the rollout has none: set "
                "trl.use_vllm = true (or choose the rollout's own weight sync)."
            )
        with self._lock:
            start = time.perf_counter()
            path = self._write_version(model, version, engine)
            saved = time.perf_counter()
            self._apply(engine, path.resolve())
            self._prune(path)
            end = time.perf_counter()
        return SyncResult(
            version, end - start, f"{self.kind}: save {saved - start:.2f}s, load {end - saved:.2f}s ({path})"
        )

    @hookimpl
    def grpo_train_end(self) -> None:
        """The engine is done with the files: nothing large stays behind."""
        with self._lock:
            if self.root is not None:
                remove_scratch_dir(self.root)


class LoraFilesystemSync(_FilesystemSync):
    """The LoRA adapter saved to a folder the vLLM server loads.

    ``grpo.weight_sync:lora_filesystem``."""

    subdir = "vllm-adapters"
    kind = "lora_filesystem"
    required_capabilities = frozenset({ADAPTER_FROM_PATH})
    sends = "adapter"  # the base stays as the engine loaded it (a quantised base works)

    @staticmethod
    def grpo_validate_config(config: GRPOConfig) -> list[str]:
        if config.adapter != "lora":
            raise ConfigError(
                "weight sync 'lora_filesystem' (trl.vllm_lora_sync = true) loads a LoRA adapter into the engine, but "
                "no adapter is trained: set adapter = 'lora', or trl.vllm_lora_sync = false (full weights are synced)."
            )
        return []

    def _save(self, model: Any, out: Path, engine: InferenceEngine) -> None:
        save_adapter(model, out, self.kind)

    def _apply(self, engine: InferenceEngine, path: Path) -> None:
        engine.load_adapter(path)


class FullFilesystemSync(_FilesystemSync):
    """Full weights saved to a folder the vLLM server loads.

    ``grpo.weight_sync:full_filesystem``."""

    subdir = "vllm-weights"
    kind = "full_filesystem"
    required_capabilities = frozenset({WEIGHTS_FROM_PATH})

    def _save(self, model: Any, out: Path, engine: InferenceEngine) -> None:
        # in the engine's dtype: what it keeps anyway, fewer bytes to write and read
        weights = in_dtype(merged_weights(model, engine.fused_modules()), engine.weight_dtype)
        save_safetensors(weights, out / "model.safetensors")

    def _apply(self, engine: InferenceEngine, path: Path) -> None:
        engine.load_weights_from_path(path)


def save_safetensors(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` with tied weights (lm_head = embed_tokens) stored once."""
    # heavy (safetensors): loaded on first use, not with this module
    from safetensors.torch import save_file

    seen: set[int] = set()
    unique = {}
    for key, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        unique[key] = tensor.contiguous()
    save_file(unique, str(path), metadata={"format": "pt"})

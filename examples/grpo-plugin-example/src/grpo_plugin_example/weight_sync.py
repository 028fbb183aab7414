"""A weight sync: the trained weights, as HF-named safetensors, loaded by
any inference engine that reloads weights from a path.

``[plugins] weight_sync = "safetensors_dir"`` with a rollout whose engine
declares ``WEIGHTS_FROM_PATH`` (grpo's ``vllm`` rollout does). It shows the
four things a weight sync has to get right:

* **HF names from a PEFT model.** A LoRA-wrapped model's state dict names a
  layer ``...q_proj.base_layer.weight`` beside ``...q_proj.lora_A.default.weight``;
  the engine knows only ``...q_proj.weight``. Each adapted weight is sent as
  ``W + delta`` under its HF name, computed beside ``W`` (the trained model is
  never merged in place, so its frozen base stays exact over many syncs).
* **Tied embeddings.** With ``tie_word_embeddings`` the state dict holds
  ``lm_head.weight`` and ``model.embed_tokens.weight`` as one tensor;
  safetensors refuses shared storage, and the engine ties them itself, so
  the tensor is written once, under the embedding's name.
* **Files.** One folder per policy version (``v000003/model.safetensors``)
  in a :func:`grpo_core.runtime.scratch.make_scratch_dir` folder; the previous
  version's folder is deleted only after the engine has loaded the new one
  (an engine that restarts reloads the last path it was given), and the
  whole folder goes at ``grpo_train_end``.
* **What it reports.** The returned ``SyncResult`` (version, seconds,
  detail) is for plugins that wrap ``grpo_sync_weights``; the run's own
  ``time/weight_sync`` metric times the whole call.

grpo's built-in ``full_filesystem`` sync does the same with more care (only
the modules a LoRA changes, the engine's dtype, fused projections).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from grpo_core.plugin_api import (
    WEIGHTS_FROM_PATH,
    ConfigError,
    InferenceEngine,
    RunContext,
    SyncResult,
    hookimpl,
    make_scratch_dir,
    remove_scratch_dir,
)

FILE = "model.safetensors"


def hf_weights(model: Any) -> dict[str, Any]:
    """HF name -> tensor the engine should hold, for a plain or a PEFT model,
    each shared tensor (tied embeddings) once."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora = {name: module for name, module in base.named_modules() if hasattr(module, "get_delta_weight")}
    weights: dict[str, Any] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for key, value in base.state_dict(keep_vars=False).items():
            if "lora_" in key:
                continue  # the adapter's own matrices: folded into W below
            if value.data_ptr() in seen:
                continue  # tied: lm_head.weight is model.embed_tokens.weight
            seen.add(value.data_ptr())
            name = key.replace(".base_layer.", ".")
            module = lora.get(key.rsplit(".base_layer.", 1)[0]) if ".base_layer." in key else None
            if module is not None and name.endswith(".weight") and not module.merged:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        value = value + module.get_delta_weight(adapter)
            weights[name] = value.detach().contiguous()
    return weights


class SafetensorsDirSync:
    """``grpo.weight_sync`` implementation ``safetensors_dir``."""

    required_capabilities = frozenset({WEIGHTS_FROM_PATH})

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.root: Path | None = None
        self.loaded: Path | None = None  # the folder the engine holds now

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        from safetensors.torch import save_file

        if engine is None:
            raise ConfigError(
                "weight sync 'safetensors_dir' loads weights into an inference engine, but the rollout has none: "
                "set trl.use_vllm = true, or remove plugins.weight_sync."
            )
        start = time.perf_counter()
        if self.root is None:
            self.root = make_scratch_dir("grpo-example-sync-")
        out = self.root / f"v{version:06d}"
        out.mkdir()
        save_file(hf_weights(model), str(out / FILE))
        engine.load_weights_from_path(out)
        if self.loaded is not None and self.loaded != out:
            shutil.rmtree(self.loaded, ignore_errors=True)  # the engine now holds the new version
        self.loaded = out
        return SyncResult(version=version, seconds=time.perf_counter() - start, detail=f"safetensors_dir: {out / FILE}")

    @hookimpl
    def grpo_train_end(self) -> None:
        """Lifecycle hooks reach implementations too: nothing stays behind."""
        if self.root is not None:
            remove_scratch_dir(self.root)
            self.root = self.loaded = None

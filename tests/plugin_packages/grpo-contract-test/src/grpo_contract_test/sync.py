"""A full-weight sync for any engine that loads safetensors from a path.

Written from grpo_core's contract alone: the engine arrives as an argument
(``InferenceEngine``), the sync declares the capability it needs, and it
records each sync (seconds, the engine's weight label and served model) in
``output_dir/timed_full_syncs.jsonl`` so a test can check what happened.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from grpo_core.plugin_api import WEIGHTS_FROM_PATH, InferenceEngine, SyncResult, WeightSyncImplementation, hookimpl


class TimedFullSync(WeightSyncImplementation):  # the Protocol: a type checker checks the attributes below
    required_capabilities = frozenset({WEIGHTS_FROM_PATH})
    sends = "merged_weights"

    class Settings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        folder: str = "timed-full-weights"

    def __init__(self, context: Any, settings: Settings) -> None:
        self.context = context
        self.root = Path(context.output_dir) / settings.folder
        self.log_path = Path(context.output_dir) / "timed_full_syncs.jsonl"

    @staticmethod
    def _weights(model: Any) -> dict[str, Any]:
        """HF-named weights of the policy, a LoRA merged in (peft's own API)."""
        if hasattr(model, "merge_adapter"):
            model.merge_adapter()
            try:
                state = model.get_base_model().state_dict()
                return {
                    k.replace(".base_layer.", "."): v.detach().clone() for k, v in state.items() if "lora_" not in k
                }
            finally:
                model.unmerge_adapter()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        from safetensors.torch import save_file

        assert engine is not None and WEIGHTS_FROM_PATH in engine.capabilities
        start = time.perf_counter()
        target = self.root / f"v{version}"
        target.mkdir(parents=True, exist_ok=True)
        weights = self._weights(model)
        weights.pop("lm_head.weight", None)  # tied to the embeddings
        save_file({k: v.contiguous() for k, v in weights.items()}, str(target / "model.safetensors"))
        label_before = engine.weight_label
        engine.load_weights_from_path(target)
        for old in self.root.iterdir():  # the engine re-applies the newest after a restart: keep only it
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        seconds = time.perf_counter() - start
        record = {
            "version": version,
            "seconds": seconds,
            "label_before": label_before,
            "label_after": engine.weight_label,
            "served_model": engine.served_model,
            "engine": engine.description,
        }
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        return SyncResult(version, seconds, f"timed_full: {target}")

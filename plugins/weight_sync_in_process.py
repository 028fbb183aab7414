"""Weight sync for the transformers rollout: nothing to copy.

The transformers rollout samples with the trainer's own model, so the
"engine" already holds the trained weights the moment the optimizer steps.
A sync only records which policy version is now live (for logs and for
checking that rollouts are stamped with it).
"""

from __future__ import annotations

import time
from typing import Any

from grpo_core.plugin_api import (
    SAMPLES_TRAINER_MODEL,
    InferenceEngine,
    RunContext,
    SyncResult,
    hookimpl,
)


class InProcessSync:
    """Nothing to send: the rollout samples the trained model itself.

    ``grpo.weight_sync:in_process``."""

    required_capabilities = frozenset({SAMPLES_TRAINER_MODEL})
    sends = "nothing"  # the rollout samples the trained model itself

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.version: int | None = None  # the live policy version; None before the first sync
        self.syncs = 0

    @hookimpl
    def grpo_sync_weights(self, model: Any, version: int, engine: InferenceEngine | None) -> SyncResult:
        start = time.perf_counter()
        self.version = version
        self.syncs += 1
        return SyncResult(version=version, seconds=time.perf_counter() - start, detail="in-process")

"""Which DeepSpeed ZeRO stage a config asks for.

A fact about the config (read from the JSON file ``deepspeed`` names) that
the checks, model loading (gradient-checkpointing defaults) and the training
backends all decide on, so it lives below them all, in the config layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


def zero_stage_of_file(deepspeed: str) -> int | None:
    """ZeRO stage of a DeepSpeed config file, or a guess from its name."""
    path = Path(deepspeed)
    try:
        stage = json.loads(path.read_text(encoding="utf-8")).get("zero_optimization", {}).get("stage")
        return int(stage) if stage is not None else None
    except (OSError, ValueError, AttributeError, TypeError):
        name = path.name.lower().replace("-", "").replace("_", "")
        return 3 if "zero3" in name or "z3" in name else None


def zero_stage(cfg: GRPOConfig) -> int | None:
    """The ZeRO stage of ``cfg.deepspeed`` (None when unset or unreadable)."""
    if not cfg.deepspeed:
        return None
    return zero_stage_of_file(cfg.deepspeed)

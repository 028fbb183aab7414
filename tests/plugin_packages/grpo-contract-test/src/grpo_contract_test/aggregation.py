"""Group-normalised advantages times a configurable scale, with an optional
injected failure (to test how grpo reports a plugin that raises)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_core.plugin_api import AdvantageAggregationImplementation, hookimpl


class ScaledGroupAdvantages(AdvantageAggregationImplementation):
    class Settings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        scale: float = Field(1.0, gt=0)
        fail_on_call: int | None = Field(None, ge=1, description="Raise on this call (1-based); for tests.")

    def __init__(self, context: Any, settings: Settings) -> None:
        self.settings = settings
        self.calls = 0
        self.log_path = Path(context.output_dir) / "scaled_group_calls.jsonl"

    @hookimpl
    def grpo_aggregate_advantages(self, rewards: Any, weights: Any, group_size: int) -> Any:
        import torch

        self.calls += 1
        if self.settings.fail_on_call == self.calls:
            raise ZeroDivisionError(f"injected failure on call {self.calls}")
        totals = (torch.nan_to_num(rewards.float(), nan=0.0) * weights.float()).sum(dim=1).view(-1, group_size)
        advantages = (totals - totals.mean(dim=1, keepdim=True)) * self.settings.scale
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(
                json.dumps({"call": self.calls, "scale": self.settings.scale, "max_abs": float(advantages.abs().max())})
                + "\n"
            )
        return advantages.view(-1)

"""Optimizer and learning-rate schedule from the config's names."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from grpo_core.config.schema import GRPOConfig
from grpo_core.errors import ConfigError


def _adamw(fused: bool | None = None, foreach: bool | None = None) -> Any:
    def build(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
        if fused is not None:
            kwargs["fused"] = fused
        if foreach is not None:
            kwargs["foreach"] = foreach
        return torch.optim.AdamW(params, **kwargs)

    return build


def _sgd(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


def _adafactor(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, weight_decay=weight_decay, scale_parameter=False, relative_step=False)


OPTIMIZERS = {
    "adamw_torch": _adamw(),
    "adamw_torch_fused": _adamw(fused=True),
    "adamw_torch_foreach": _adamw(foreach=True),
    "sgd": _sgd,
    "adafactor": _adafactor,
}


def build_optimizer(cfg: GRPOConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters: check `adapter` / `lora_target_modules`")
    builder = OPTIMIZERS.get(cfg.optimizer)
    if builder is None:
        raise ConfigError(f"optimizer '{cfg.optimizer}' is not supported; choose one of {sorted(OPTIMIZERS)}")
    return builder(params, cfg.learning_rate, cfg.weight_decay)


def build_scheduler(cfg: GRPOConfig, optimizer: torch.optim.Optimizer) -> Any:
    from transformers import get_scheduler

    warmup = cfg.warmup_steps or int((cfg.warmup_ratio or 0.0) * cfg.max_steps)
    return get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=cfg.max_steps)


STEP_ORDER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def advance_schedule(scheduler: Any) -> None:
    """Step the learning-rate schedule once per optimizer step, trained or not.

    A step whose micro-batches were all skipped (no advantage signal) still
    counts, so the schedule stays a function of the step number (and a
    resumed run lines up). torch then warns that the scheduler stepped
    before the optimizer: true, and intended, so the user never sees it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=STEP_ORDER_WARNING)
        scheduler.step()

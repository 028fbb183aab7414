"""Optimizer and learning-rate schedule from the config's names."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError


def _adam_args(cfg: GRPOConfig) -> dict[str, Any]:
    """adam_beta1 / adam_beta2 / adam_epsilon (Axolotl's and HF's names); unset ones keep torch's defaults."""
    out: dict[str, Any] = {}
    if cfg.adam_beta1 is not None or cfg.adam_beta2 is not None:
        out["betas"] = (
            0.9 if cfg.adam_beta1 is None else cfg.adam_beta1,
            0.999 if cfg.adam_beta2 is None else cfg.adam_beta2,
        )
    if cfg.adam_epsilon is not None:
        out["eps"] = cfg.adam_epsilon
    return out


def _adamw(fused: bool | None = None, foreach: bool | None = None) -> Any:
    def build(params: Any, cfg: GRPOConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
        kwargs: dict[str, Any] = {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay, **_adam_args(cfg)}
        if fused is not None:
            kwargs["fused"] = fused
        if foreach is not None:
            kwargs["foreach"] = foreach
        return torch.optim.AdamW(params, **{**kwargs, **extra})

    return build


def _sgd(params: Any, cfg: GRPOConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **{"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay, **extra})


def _adafactor(params: Any, cfg: GRPOConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    # heavy (transformers): loaded on first use, not with this module
    from transformers.optimization import Adafactor

    kwargs = {
        "lr": cfg.learning_rate,
        "weight_decay": cfg.weight_decay,
        "scale_parameter": False,
        "relative_step": False,
    }
    return Adafactor(params, **{**kwargs, **extra})


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
    try:
        return builder(params, cfg, dict(cfg.optim_args or {}))
    except TypeError as exc:  # an optim_args key the optimizer does not take
        raise ConfigError(f"optim_args {cfg.optim_args} do not fit optimizer '{cfg.optimizer}': {exc}") from None


def scheduler_choice(cfg: GRPOConfig) -> tuple[str, dict[str, Any]]:
    """The transformers schedule name and its extra arguments.

    ``cosine_min_lr_ratio`` (Axolotl's) turns cosine into transformers'
    ``cosine_with_min_lr``; ``lr_scheduler_kwargs`` go to the schedule as they are.
    """
    name, kwargs = cfg.lr_scheduler, dict(cfg.lr_scheduler_kwargs or {})
    if cfg.cosine_min_lr_ratio is not None:
        if name not in {"cosine", "cosine_with_min_lr"}:
            raise ConfigError(
                f"cosine_min_lr_ratio applies to lr_scheduler = 'cosine', not '{name}': remove one of them."
            )
        name = "cosine_with_min_lr"
        kwargs.setdefault("min_lr_rate", cfg.cosine_min_lr_ratio)
    return name, kwargs


def build_scheduler(cfg: GRPOConfig, optimizer: torch.optim.Optimizer) -> Any:
    # heavy (transformers): loaded on first use, not with this module
    from transformers import get_scheduler

    warmup = cfg.warmup_steps or int((cfg.warmup_ratio or 0.0) * cfg.max_steps)
    name, kwargs = scheduler_choice(cfg)
    try:
        return get_scheduler(
            name,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=cfg.max_steps,
            scheduler_specific_kwargs=kwargs or None,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"lr_scheduler '{name}' with lr_scheduler_kwargs {kwargs}: {exc}") from None


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

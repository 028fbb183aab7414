"""When evaluation runs, as the config says: a rule the config check and
the run's observer both read (:mod:`grpo_core.generation.evaluation` does the work)."""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError


def eval_enabled(cfg: GRPOConfig) -> bool:
    """Whether the run evaluates: ``eval_strategy`` ("steps" by default when
    there is something to evaluate on: ``test_datasets`` or ``val_set_size``)."""
    has_data = bool(cfg.test_datasets) or cfg.val_set_size > 0
    strategy = cfg.eval_strategy or ("steps" if has_data else "no")
    if strategy == "steps" and not has_data:
        raise ConfigError(
            "eval_strategy = 'steps' but there is nothing to evaluate on: set val_set_size (a fraction "
            "or a count of prompts) or add [[test_datasets]]."
        )
    return strategy == "steps"


def eval_every(cfg: GRPOConfig) -> int:
    """Optimizer steps between evaluations (``eval_steps``, else ``logging_steps``)."""
    return int(cfg.eval_steps or cfg.logging_steps)

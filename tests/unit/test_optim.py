"""The learning-rate schedule on steps that train nothing (no model load)."""

from __future__ import annotations

import warnings

import torch
from transformers import get_scheduler

from grpo_core.optimization.optimizer import advance_schedule


def _schedule() -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    return optimizer, get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)


def _step_order_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "lr_scheduler.step()" in str(w.message)]


def test_a_step_that_trained_nothing_advances_the_schedule_silently() -> None:
    # Control: torch does warn when the schedule steps before any optimizer step...
    _, plain = _schedule()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plain.step()
    assert _step_order_warnings(record), "torch no longer warns: this test would prove nothing"
    # ...grpo's step edge (all micro-batches skipped at step 1) does not pass it on.
    optimizer, scheduler = _schedule()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        advance_schedule(scheduler)
        optimizer.step()
        advance_schedule(scheduler)
    assert _step_order_warnings(record) == []
    assert scheduler.last_epoch == 2  # both steps counted: the schedule follows the step number

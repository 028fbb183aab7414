"""The step clock: phases add up to the step's wall time."""

from __future__ import annotations

import time

import pytest

from grpo_core.training.timing import PHASES, StepClock, dominant_phases


def test_phases_and_other_add_up_to_step_time() -> None:
    clock = StepClock()
    with clock.phase("rollout"):
        assert clock.current == "rollout"
        time.sleep(0.02)
    with clock.phase("optimizer"):
        time.sleep(0.01)
    time.sleep(0.01)  # claimed by no phase: "other"
    metrics = clock.metrics()
    assert clock.current is None
    assert sum(metrics[f"time/{p}"] for p in (*PHASES, "other")) == pytest.approx(metrics["step_time"], rel=1e-9)
    assert metrics["time/rollout"] >= 0.02 and metrics["time/other"] >= 0.01 and metrics["time/checkpoint"] == 0.0
    with pytest.raises(ValueError, match="unknown step phase"):
        with clock.phase("napping"):
            pass


def test_dominant_phases_names_the_largest_share_first() -> None:
    history = [{"time/rollout": 6.0, "time/forward_backward": 3.0, "time/other": 1.0}, {"time/rollout": 2.0}]
    assert dominant_phases(history) == "rollout 67%, forward_backward 25%, other 8%"
    assert dominant_phases([]) == ""

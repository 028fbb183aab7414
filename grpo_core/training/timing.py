"""Where the seconds of an optimizer step go.

:class:`StepClock` splits one step's wall time into named phases, measured in
the trainer's thread, so that they add up to ``step_time`` exactly
(``time/other`` is what no phase claimed). With ``async_prefetch`` the
rollout runs ahead in the background; ``time/rollout`` is then only the time
the trainer waited for it, while the producer's own ``time/generation`` and
``time/scoring`` say how long the batch took to make.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("rollout", "forward_backward", "optimizer", "weight_sync", "checkpoint")


class StepClock:
    """Phase timer of one step; :attr:`current` names the phase running now
    (for a progress display)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.current: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown step phase '{name}' (known: {', '.join(PHASES)})")
        previous, self.current = self.current, name
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.current = previous

    def metrics(self) -> dict[str, float]:
        """``time/<phase>`` for every phase, ``time/other`` and ``step_time``."""
        total = time.perf_counter() - self.started
        out = {f"time/{name}": seconds for name, seconds in self.seconds.items()}
        out["time/other"] = max(0.0, total - sum(self.seconds.values()))
        out["step_time"] = total
        return out


def dominant_phases(history: list[dict[str, float]]) -> str:
    """One line for the end of a run: the share of step time each phase
    took, largest first (``rollout 61%, forward_backward 30%, ...``)."""
    keys = [f"time/{name}" for name in (*PHASES, "other")]
    totals = {key.removeprefix("time/"): sum(m.get(key, 0.0) for m in history) for key in keys}
    whole = sum(totals.values())
    if whole <= 0:
        return ""
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {100 * seconds / whole:.0f}%" for name, seconds in ranked if seconds / whole >= 0.005)

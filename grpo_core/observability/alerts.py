"""Live health alerts: the reference guide's quick checks, run every step.

Each alert fires at most once per run: it is printed (``alert: ...`` on
stderr), recorded as ``alerts/<name> = 1`` in that step's metrics (so in
``metrics.jsonl`` and every tracker) and appended with its message to
``output_dir/alerts.jsonl`` (what ``grpo report`` lists). Thresholds live
in ``[alerts]`` (:class:`~grpo_core.config.schema.AlertSettings`);
``alerts.silence`` names alerts never to fire, ``alerts.enabled = false``
turns them all off.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.contract.errors import ConfigError

if TYPE_CHECKING:
    from grpo_core.config.schema import AlertSettings

ALERT_NAMES = (
    "reward_zero",
    "no_signal",
    "entropy_collapse",
    "entropy_explosion",
    "grad_norm_high",
    "grad_norm_zero",
    "is_ratio",
)
LOGP_GAP_KEY = "sampling_logp_difference/mean"


@dataclass(frozen=True)
class Alert:
    name: str
    step: int
    message: str


def _mean(values: deque[float] | list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _find(metrics: dict[str, float], suffix: str) -> float | None:
    """A metric by exact name, or under a prefix (``is/<suffix>``)."""
    if suffix in metrics:
        return metrics[suffix]
    for key, value in metrics.items():
        if key.endswith("/" + suffix):
            return value
    return None


class HealthMonitor:
    """Feed it each step's metrics; it returns the alerts that fire now."""

    def __init__(
        self, settings: AlertSettings, output_dir: Path | None = None, echo: Callable[[str], None] | None = None
    ) -> None:
        unknown = sorted(set(settings.silence) - set(ALERT_NAMES))
        if unknown:
            raise ConfigError(f"alerts.silence names unknown alert(s) {unknown}; known: {', '.join(ALERT_NAMES)}.")
        self.s = settings
        self.path = None if output_dir is None else Path(output_dir) / "alerts.jsonl"
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.fired: dict[str, Alert] = {}
        w = settings.window
        self.reward: deque[float] = deque(maxlen=max(w, settings.reward_zero_steps))
        self.reward_std: deque[float] = deque(maxlen=w)
        self.entropy: deque[float] = deque(maxlen=w)
        self.grad_norm: deque[float] = deque(maxlen=w)
        self.logp_gap: deque[float] = deque(maxlen=w)
        self.steps_seen = 0
        self._skipped = 0.0

    def _checks(self, step: int, m: dict[str, float]) -> list[tuple[str, str]]:
        s, out = self.s, []
        full = self.steps_seen >= s.window
        if (
            self.steps_seen >= s.reward_zero_steps
            and len(self.reward)
            and abs(_mean(list(self.reward)[-s.reward_zero_steps :])) <= s.reward_zero_eps
        ):
            out.append(
                (
                    "reward_zero",
                    f"mean reward is still ~0 ({_mean(self.reward):.3g}) after {self.steps_seen} steps: "
                    "run `grpo rewards test CONFIG` to check the reward functions on real completions.",
                )
            )
        if full and self.reward_std:
            zero = sum(1 for v in self.reward_std if abs(v) < 1e-8) / len(self.reward_std)
            if zero >= s.no_signal_fraction:
                out.append(
                    (
                        "no_signal",
                        f"reward_std is 0 on {zero:.0%} of the last {len(self.reward_std)} steps: every "
                        "completion of a prompt scores the same, so there is no learning signal. Make the task "
                        "easier or the rewards finer-grained, raise trl.num_generations or the temperature.",
                    )
                )
        if full and self.entropy:
            ent = _mean(self.entropy)
            if ent < s.entropy_min:
                out.append(
                    (
                        "entropy_collapse",
                        f"mean entropy {ent:.3g} < {s.entropy_min:g} over the last {len(self.entropy)} "
                        "steps: the policy collapsed to near-deterministic outputs. Lower the learning rate or raise "
                        "the temperature.",
                    )
                )
            elif ent > s.entropy_max:
                out.append(
                    (
                        "entropy_explosion",
                        f"mean entropy {ent:.3g} > {s.entropy_max:g} over the last {len(self.entropy)} "
                        "steps: the policy is drifting towards random text. Lower the learning rate or add a KL "
                        "penalty (trl.beta).",
                    )
                )
        if full and self.grad_norm:
            g = _mean(self.grad_norm)
            if g > s.grad_norm_max:
                out.append(
                    (
                        "grad_norm_high",
                        f"mean grad_norm {g:.3g} > {s.grad_norm_max:g} over the last "
                        f"{len(self.grad_norm)} steps: updates are unstable. Lower the learning rate or max_grad_norm.",
                    )
                )
        g_now, skipped = m.get("grad_norm"), m.get("skipped_zero_adv_batches", 0.0)
        # a step with no tokens at all (partial rollouts: nothing finished in the batch) trained nothing either
        empty = m.get("num_tokens") == 0
        if (
            g_now is not None
            and g_now <= s.grad_norm_min
            and skipped == self._skipped
            and m.get("loss") is not None
            and not empty
        ):
            out.append(
                (
                    "grad_norm_zero",
                    f"grad_norm {g_now:.3g} at step {step} on a step that trained: no gradient "
                    "reaches the trainable weights (frozen adapter, or advantages all 0).",
                )
            )
        if full and self.logp_gap:
            gap = _mean(self.logp_gap)
            if gap > s.logp_gap_max:
                out.append(
                    (
                        "is_ratio",
                        f"the sampler's and trainer's log-probs differ by {gap:.3g} per token on average "
                        f"(IS ratio ~{2.718281828**gap:.2g}x) over the last {len(self.logp_gap)} steps: weight "
                        "sync is stale or broken, or the engine samples at another precision.",
                    )
                )
        return out

    def update(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """Record ``metrics``; add ``alerts/<name> = 1`` for each alert that
        fires for the first time, print and save it, and return those."""
        if not self.s.enabled:
            return []
        self.steps_seen += 1
        for key, queue in (
            ("reward", self.reward),
            ("reward_std", self.reward_std),
            ("entropy", self.entropy),
            ("grad_norm", self.grad_norm),
        ):
            if metrics.get(key) is not None:
                queue.append(float(metrics[key]))
        gap = _find(metrics, LOGP_GAP_KEY)
        if gap is not None:
            self.logp_gap.append(float(gap))
        new = []
        for name, message in self._checks(step, metrics):
            if name in self.fired or name in self.s.silence:
                continue
            alert = Alert(name, step, message)
            self.fired[name] = alert
            new.append(alert)
            metrics[f"alerts/{name}"] = 1.0
            self.echo(f"alert [{name}] step {step}: {message}")
            self._save(alert)
        self._skipped = float(metrics.get("skipped_zero_adv_batches", self._skipped))
        return new

    def _save(self, alert: Alert) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": alert.step, "name": alert.name, "message": alert.message}) + "\n")
        except OSError:
            pass  # the alert was printed and is in metrics.jsonl; a full disk shows at the metrics write

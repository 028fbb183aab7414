"""Replay buffer and deferred re-rolling (``grpo.replay`` implementation ``default``).

Two independent mechanisms, both driven by ``[trl]`` options:

**Replay buffer** (``replay_buffer_size`` > 0). After scoring, groups of the
current batch that have no learning signal (every advantage zero) are
replaced by remembered groups from *earlier* batches that had signal; then the
current batch's groups with signal are remembered. Policy:

* the **newest** remembered group is used first (LIFO): it was sampled by the
  policy closest to the current one, so its importance ratios stay near 1
  and its advantages are the least out of date;
* each remembered group is used **at most once** (taken out of the buffer);
* when the buffer is full the **oldest** group is evicted.

A replayed group is a copy with ``replayed=True`` and its original
``policy_version``, so the trainer can recompute old log-probs for it
(``replay_recompute_logps``) and see how stale it is.

**Deferred re-rolling** (``reroll_start_fraction`` < 1 and
``reroll_max_groups`` > 0). Once ``progress.fraction`` reaches the start
fraction, a prompt whose completions *all* got zero reward (every reward
``None``, NaN or 0) is queued; later batches get up to ``reroll_max_groups``
queued prompts swapped in (first in, first out), replacing the batch's last
prompts, which are skipped. A prompt is re-injected at most ``max_rerolls``
times; the queue holds at most ``max_pending`` prompts (oldest dropped).

Counters are exposed by :meth:`SignalReplay.metrics` and added to the logged
metrics at every optimizer step; :meth:`SignalReplay.state_dict` /
:meth:`SignalReplay.load_state_dict` save and restore everything as plain
dicts/lists/numbers/strings for checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from typing import Any

from grpo_core.plugin_api import (
    GrpoError,
    Prompt,
    RunContext,
    ScoredGroup,
    TrainingProgress,
    hookimpl,
)

STATE_VERSION = 1


def prompt_key(prompt: Prompt) -> str:
    """Identity of a prompt across batches: its dataset index, else its tokens."""
    if prompt.index >= 0:
        return f"i:{prompt.index}"
    return "t:" + ",".join(map(str, prompt.prompt_ids))


def all_rewards_zero(group: ScoredGroup) -> bool:
    """True when no completion got any non-zero reward (``None``/NaN count as 0)."""
    if not group.rewards:
        return False
    return all(r is None or not math.isfinite(r) or r == 0 for row in group.rewards for r in row)


# ---------------------------------------------------------------- plain-data conversion


def _prompt_from(data: dict[str, Any]) -> Prompt:
    return Prompt(**data)


class SignalReplay:
    """Replay buffer of groups with signal, plus deferred re-rolling of
    prompts the model could not yet solve. See the module docstring."""

    _TOTALS = ("replayed", "evicted", "deferred", "injected", "exhausted", "dropped")

    def __init__(self, context: RunContext, *, max_rerolls: int = 2, max_pending: int = 256) -> None:
        trl = context.config.trl
        self.buffer_size: int = trl.replay_buffer_size
        self.reroll_start: float = trl.reroll_start_fraction
        self.reroll_max_groups: int = trl.reroll_max_groups
        self.max_rerolls = max_rerolls
        self.max_pending = max_pending
        self._buffer: deque[ScoredGroup] = deque()  # oldest left, newest right
        self._pending: deque[tuple[Prompt, int]] = deque()  # (prompt, times re-injected so far)
        self._rerolls: dict[str, int] = {}  # prompt key -> times re-injected
        self._totals = dict.fromkeys(self._TOTALS, 0)
        self._step = dict.fromkeys(("replayed", "injected"), 0)  # since the last optimizer step
        self._lock = threading.Lock()  # prompts may be chosen on a prefetch thread

    # ------------------------------------------------------------------ switches

    @property
    def replay_enabled(self) -> bool:
        return self.buffer_size > 0

    @property
    def reroll_enabled(self) -> bool:
        return self.reroll_start < 1.0 and self.reroll_max_groups > 0

    def _rerolling(self, progress: TrainingProgress) -> bool:
        return self.reroll_enabled and progress.fraction >= self.reroll_start

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def grpo_replay_prompts(self, prompts: list[Prompt], progress: TrainingProgress) -> list[Prompt]:
        out = list(prompts)
        with self._lock:
            if not self._pending or not self._rerolling(progress):
                return out
            present = {prompt_key(p) for p in out}
            waiting: list[tuple[Prompt, int]] = []
            injected = 0
            limit = min(self.reroll_max_groups, len(out))
            while self._pending and injected < limit:
                prompt, count = self._pending.popleft()
                key = prompt_key(prompt)
                if key in present:  # already in this batch: keep it for a later one
                    waiting.append((prompt, count))
                    continue
                injected += 1
                out[len(out) - injected] = prompt
                present.add(key)
                self._rerolls[key] = count + 1
            self._pending.extendleft(reversed(waiting))
            self._step["injected"] += injected
            self._totals["injected"] += injected
        return out

    @hookimpl
    def grpo_replay_groups(self, groups: list[ScoredGroup], progress: TrainingProgress) -> list[ScoredGroup]:
        out = list(groups)
        with self._lock:
            if self._rerolling(progress):
                for group in groups:
                    if not group.replayed and all_rewards_zero(group):
                        self._defer(group.group.prompt)
            if not self.replay_enabled:
                return out
            # replace first, remember after: a group never stands in for one of its own batch
            for i, group in enumerate(out):
                if not self._buffer:
                    break
                if not group.has_signal and not group.replayed:
                    out[i] = dataclasses.replace(self._buffer.pop(), replayed=True)
                    self._step["replayed"] += 1
                    self._totals["replayed"] += 1
            for group in groups:
                if group.has_signal and not group.replayed:
                    self._buffer.append(group)
            while len(self._buffer) > self.buffer_size:
                self._buffer.popleft()
                self._totals["evicted"] += 1
        return out

    @hookimpl
    def grpo_step_end(self, metrics: dict[str, float]) -> None:
        """Log the enabled mechanisms' counters; per-step counters restart."""
        with self._lock:
            current = self._metrics()
            self._step = dict.fromkeys(self._step, 0)
        if self.replay_enabled:
            metrics.update({k: v for k, v in current.items() if k.startswith("replay/")})
        if self.reroll_enabled:
            metrics.update({k: v for k, v in current.items() if k.startswith("reroll/")})

    # ------------------------------------------------------------------ internals

    def _defer(self, prompt: Prompt) -> None:
        key = prompt_key(prompt)
        count = self._rerolls.get(key, 0)
        if count >= self.max_rerolls:
            self._totals["exhausted"] += 1
            return
        if any(prompt_key(p) == key for p, _ in self._pending):
            return
        self._pending.append((prompt, count))
        self._totals["deferred"] += 1
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self._totals["dropped"] += 1

    # ------------------------------------------------------------------ metrics and checkpoints

    def metrics(self) -> dict[str, float]:
        """Current counters. ``replay/replayed_groups`` and ``reroll/injected``
        count since the last optimizer step; ``*_total`` since the start."""
        with self._lock:
            return self._metrics()

    def _metrics(self) -> dict[str, float]:
        return {
            "replay/buffer_size": float(len(self._buffer)),
            "replay/replayed_groups": float(self._step["replayed"]),
            "replay/replayed_total": float(self._totals["replayed"]),
            "replay/evicted_total": float(self._totals["evicted"]),
            "reroll/pending": float(len(self._pending)),
            "reroll/injected": float(self._step["injected"]),
            "reroll/injected_total": float(self._totals["injected"]),
            "reroll/deferred_total": float(self._totals["deferred"]),
            "reroll/exhausted_total": float(self._totals["exhausted"]),
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain Python data (pickle/JSON-safe)."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "buffer": [g.to_dict() for g in self._buffer],
                "pending": [{"prompt": dataclasses.asdict(p), "rerolls": n} for p, n in self._pending],
                "rerolls": dict(self._rerolls),
                "totals": dict(self._totals),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. A smaller ``replay_buffer_size``
        than when it was saved keeps only the newest groups."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise GrpoError(
                f"replay state in the checkpoint has version {found!r}, this grpo reads version {STATE_VERSION}: "
                "resume with the grpo version that wrote it, or start without resume_from_checkpoint."
            )
        with self._lock:
            self._buffer = deque(ScoredGroup.from_dict(g) for g in state["buffer"])
            while len(self._buffer) > self.buffer_size:
                self._buffer.popleft()
            self._pending = deque((_prompt_from(e["prompt"]), int(e["rerolls"])) for e in state["pending"])
            self._rerolls = {str(k): int(v) for k, v in state["rerolls"].items()}
            totals = {k: int(v) for k, v in state["totals"].items() if k in self._TOTALS}
            self._totals = dict.fromkeys(self._TOTALS, 0) | totals

"""Plain data passed across the plugin contract.

These types are what the hooks in :mod:`grpo_core.hookspecs` take and return.
They are deliberately small, dependency-free dataclasses (token ids are plain
``list[int]``) so a plugin can build them without knowing the trainer's
tensors, and so they pickle cleanly to subprocess reward workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Messages = list[dict[str, Any]]
"""A conversational prompt or completion: ``[{"role": ..., "content": ...}]``."""


@dataclass
class Prompt:
    """One dataset row, ready to be sampled from.

    ``prompt`` is what the user wrote (a string, or a list of chat messages);
    ``prompt_ids`` is its tokenisation after the chat template, so rollout
    engines never re-tokenise. ``columns`` are the remaining dataset columns,
    handed to reward functions as keyword arguments.
    """

    prompt: str | Messages
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    index: int = -1  # position in the (shuffled) dataset, for resumption

    @property
    def is_conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class SamplingSettings:
    """How completions are sampled; mirrors the seed's generation options."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    guided_regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # generation_kwargs
    seed: int | None = None


@dataclass
class Completion:
    """One sampled completion.

    ``logprobs`` are the *sampler's* log-probabilities of ``token_ids`` (one per
    token) when the engine reports them; importance-sampling correction needs
    them. ``truncated`` is true when generation stopped at ``max_tokens``
    rather than at an end-of-sequence or stop token. ``extra`` holds
    per-completion values a rollout wants reward functions to see (they
    arrive as keyword arguments, like dataset columns).
    """

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutGroup:
    """All completions sampled for one prompt: the unit of group-relative
    advantages, of streaming scoring and of replay."""

    prompt: Prompt
    completions: list[Completion]
    policy_version: int = 0  # the weight version that generated it


@dataclass
class ScoredGroup:
    """A rollout group with its rewards and advantages.

    ``rewards`` has one row per completion and one column per reward function;
    ``None`` marks a value a function chose not to give. ``advantages`` is one
    float per completion.
    """

    group: RolloutGroup
    rewards: list[list[float | None]]
    advantages: list[float]
    replayed: bool = False

    @property
    def has_signal(self) -> bool:
        """True when some advantage is non-zero, i.e. the group can teach."""
        return any(abs(a) > 1e-8 for a in self.advantages)

    @property
    def total_rewards(self) -> list[float]:
        """Unweighted sum per completion, ``None`` counted as 0 (for logs)."""
        return [sum(r for r in row if r is not None and math.isfinite(r)) for row in self.rewards]


@dataclass
class TrainingProgress:
    """Where the run stands; handed to hooks that schedule by progress."""

    step: int
    max_steps: int

    @property
    def fraction(self) -> float:
        return self.step / self.max_steps if self.max_steps > 0 else 0.0


@runtime_checkable
class RewardFunction(Protocol):
    """What the core calls to score completions (TRL's calling convention).

    ``__call__(prompts=..., completions=..., completion_ids=..., **columns)``
    returns one ``float`` or ``None`` per completion. ``__name__`` names it in
    logs (``rewards/<name>/mean``) and in error messages.
    """

    __name__: str

    def __call__(self, *, prompts: list, completions: list, completion_ids: list[list[int]], **columns: Any) -> list[float | None]:
        ...


@dataclass
class SyncResult:
    """What a weight sync did, for logs: the new policy version and how long
    it took."""

    version: int
    seconds: float
    detail: str = ""

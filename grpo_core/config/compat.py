"""Keys grpo accepts for compatibility but does not act on.

A config written for another framework (the reference guide, Axolotl, TRL)
carries keys that mean nothing for a GRPO run here, or whose effect grpo
gets another way. They are accepted so that config runs, and named in a
warning by ``grpo config check`` and ``grpo run`` so nothing is ignored
silently. ``tests/test_option_coverage.py`` proves every schema field is
either read by the code or listed here.

Each entry: dotted key -> (when it counts as set, what the user should know).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


@dataclass(frozen=True)
class CompatKey:
    key: str
    is_set: Callable[[GRPOConfig], bool]
    note: str


COMPATIBILITY_ONLY: tuple[CompatKey, ...] = (
    CompatKey(
        "skip_prepare_dataset",
        lambda c: c.skip_prepare_dataset,
        "grpo has no dataset preparation step to skip: prompts are templated and tokenised once at start",
    ),
    CompatKey(
        "trl.use_data_producer",
        lambda c: c.trl.use_data_producer,
        "grpo always runs through its data producer; trl.async_prefetch alone decides whether generation "
        "runs ahead in the background",
    ),
)


def compat_warnings(cfg: GRPOConfig) -> list[str]:
    """One warning per compatibility-only key the config sets."""
    return [f"{item.key} is accepted for compatibility and has no effect: {item.note}." for item in COMPATIBILITY_ONLY if item.is_set(cfg)]


def compat_keys() -> set[str]:
    return {item.key for item in COMPATIBILITY_ONLY}


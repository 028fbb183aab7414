"""A reward for completion length, in TRL's reward-function convention,
configurable from the run's config:

.. code-block:: toml

    [plugins.length_bonus]
    target_tokens = 32
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TARGET_TOKENS = 64


class LengthBonusSettings(BaseModel):
    """``[plugins.length_bonus]``: validated by grpo before the run starts."""

    model_config = ConfigDict(extra="forbid")

    target_tokens: int = Field(TARGET_TOKENS, ge=1, description="Completion length (tokens) that earns the full bonus.")


def length_bonus(
    completions: list, completion_ids: list[list[int]] | None = None, target_tokens: int = TARGET_TOKENS, **_: Any
) -> list[float]:
    """1.0 for completions of ``target_tokens`` tokens, falling linearly to
    0.0 at zero length and at twice the target.

    Useful as a small extra term (weight 0.1-0.2) next to a correctness
    reward, to keep answers from rambling or collapsing to nothing. grpo
    passes ``target_tokens`` from ``[plugins.length_bonus]``.
    """
    if completion_ids is None:  # called without token ids: fall back to words
        lengths = [len(_text(c).split()) for c in completions]
    else:
        lengths = [len(ids) for ids in completion_ids]
    return [max(0.0, 1.0 - abs(n - target_tokens) / target_tokens) for n in lengths]


length_bonus.Settings = LengthBonusSettings  # type: ignore[attr-defined]


def _text(completion: Any) -> str:
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)

"""A reward for completion length, in TRL's reward-function convention."""

from __future__ import annotations

from typing import Any, Callable

TARGET_TOKENS = 64


def make_length_bonus(target_tokens: int = TARGET_TOKENS) -> Callable[..., list[float]]:
    """A reward that peaks at 1.0 for completions of ``target_tokens`` tokens
    and falls linearly to 0.0 at zero length and at twice the target.

    Useful as a small extra term (weight 0.1-0.2) next to a correctness
    reward, to keep answers from rambling or collapsing to nothing.
    """
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be >= 1, got {target_tokens}")

    def length_bonus(completions: list, completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:
        if completion_ids is None:  # called without token ids: fall back to words
            lengths = [len(_text(c).split()) for c in completions]
        else:
            lengths = [len(ids) for ids in completion_ids]
        return [max(0.0, 1.0 - abs(n - target_tokens) / target_tokens) for n in lengths]

    length_bonus.__name__ = "length_bonus"
    return length_bonus


def _text(completion: Any) -> str:
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


length_bonus = make_length_bonus()

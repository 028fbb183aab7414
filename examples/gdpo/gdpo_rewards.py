"""Reward functions for the GDPO example, on deliberately different scales.

``correct_answer`` is 0 or 1; ``length_penalty`` is minus the length in tens
of characters (0 to about -20). Summed first (GRPO's sum_then_normalize), the
length term's spread dominates each group's advantages; normalised first
(GDPO's normalize_then_sum), both count by their weights. Named
``gdpo_rewards`` so it never shadows another example's ``rewards`` module.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the answer."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = NUMBER.findall(_text(completion))
        out.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return out


def length_penalty(completions, **kwargs) -> list[float]:
    """Minus the completion's length in tens of characters."""
    return [-len(_text(c).strip()) / 10.0 for c in completions]

"""Reward functions for the arithmetic example (TRL calling convention).

``correct_answer`` is the verifiable signal; ``short_answer`` is a mild
format preference so the model learns to answer rather than ramble.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = NUMBER.findall(_text(completion))
        rewards.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return rewards


def short_answer(completions, **kwargs) -> list[float]:
    """1.0 for an answer of at most 12 words that contains a number, else 0."""
    rewards = []
    for completion in completions:
        text = _text(completion).strip()
        rewards.append(1.0 if NUMBER.search(text) and len(text.split()) <= 12 else 0.0)
    return rewards

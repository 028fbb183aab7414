"""Rewards of the tool-use example: the model's final answer, and whether it used the tool."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*")


def final_answer_correct(completions, answer, **kwargs):
    """1.0 when the last number of the model's last turn is the answer."""
    rewards = []
    for messages, expected in zip(completions, answer, strict=True):
        last = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        numbers = NUMBER.findall(last.replace(",", ""))
        rewards.append(1.0 if numbers and int(numbers[-1]) == int(expected) else 0.0)
    return rewards

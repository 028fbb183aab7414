"""Built-in reward functions, published under ``grpo.reward`` so a config can
name them directly (``reward_funcs = ["last_number_match"]``). They serve the
arithmetic example and follow TRL's calling convention."""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def completion_text(completion: Any) -> str:
    """Text of a completion: plain text, or what the model wrote in
    conversational messages (``[{"role": "assistant", "content": ...}]``;
    in an episode, the environment's and tools' messages are left out)."""
    if isinstance(completion, list):
        return "".join(
            str(m.get("content") or "")
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        )
    return str(completion)


def _as_float(text: Any) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def last_number_match(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the last number in the completion equals the ``answer``
    column (compared as numbers, thousands separators ignored), else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = NUMBER.findall(completion_text(completion))
        got = _as_float(numbers[-1]) if numbers else None
        want = _as_float(expected)
        rewards.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return rewards


def think_answer_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion has a closed ``<think>...</think>`` and a
    closed ``<answer>...</answer>`` block, else 0.0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(1.0 if THINK.search(text) and ANSWER.search(text) else 0.0)
    return rewards


def environment(
    completions: list[Any], environment_reward: list[float | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """The reward the environment gave each episode (the sum of its
    replies' rewards); ``None`` where it gave none, or the episode failed.
    Added to ``reward_funcs`` by itself when the environment declares
    ``provides_reward``."""
    if environment_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in environment_reward]

"""Reward functions and the dataset transform for the quick-start config.

grpo calls reward functions the way TRL does: keyword arguments
``prompts``, ``completions`` (chat completions arrive as
``[{"role": "assistant", "content": ...}]``), ``completion_ids`` and every
dataset column the transform kept (here ``answer``). Each returns one float
per completion, or ``None`` to abstain.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_THEN_ANSWER = re.compile(r"<think>.+?</think>\s*<answer>.+?</answer>", re.DOTALL)

SYSTEM_PROMPT = (
    "Solve the math problem. Reason inside <think></think>, then give only the final number inside <answer></answer>."
)


def _text(completion: Any) -> str:
    """Plain text of a completion, whether chat-formatted or a string."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _final_number(text: str) -> float | None:
    """The number inside <answer> if tagged, else the last number written."""
    tagged = _ANSWER_TAG.search(text)
    found = _NUMBER.findall(tagged.group(1) if tagged else text)
    return _as_number(found[-1]) if found else None


def accuracy_reward(completions: list, answer: list, **_: Any) -> list[float]:
    """1.0 when the completion's final number equals the reference answer."""
    scores = []
    for completion, expected in zip(completions, answer):
        got, want = _final_number(_text(completion)), _as_number(str(expected))
        scores.append(1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0)
    return scores


def format_reward(completions: list, **_: Any) -> list[float]:
    """1.0 for reasoning in <think> followed by an <answer>, else 0.0."""
    return [1.0 if _THINK_THEN_ANSWER.search(_text(c)) else 0.0 for c in completions]


def prompt_transform(cfg: Any, *args: Any, **kwargs: Any):
    """GSM8K rows -> chat prompts plus the numeric ``answer`` column.

    GSM8K answers end with ``#### <number>``; only that number is kept so the
    reward can compare it. ``question`` is consumed here and removed.
    """

    def to_prompt(row: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
        final = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": row["question"]},
            ],
            "answer": final,
        }

    return to_prompt, {"remove_columns": ["question"]}

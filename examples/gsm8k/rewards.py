"""The reference quickstart's reward module, for GSM8K-format data.

Rows have ``question`` and ``answer`` (worked solution ending in
``#### N``). The transform turns them into chat prompts and keeps only the
final number as ``answer`` for the accuracy reward.
"""

from __future__ import annotations

import re

SYSTEM = (
    "Solve the math problem. Think step by step inside <think></think>, "
    "then give only the final number inside <answer></answer>."
)
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the number in <answer> (or, failing that, the last number) is right."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = _text(completion)
        tagged = ANSWER_TAG.search(text)
        numbers = NUMBER.findall(tagged.group(1) if tagged else text)
        scores.append(1.0 if numbers and numbers[-1] == str(expected) else 0.0)
    return scores


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when both the <think> and <answer> blocks are present."""
    pattern = re.compile(r"<think>.*?</think>.*?<answer>.*?</answer>", re.DOTALL)
    return [1.0 if pattern.search(_text(c)) else 0.0 for c in completions]


def prompt_transform(cfg, *args, **kwargs):
    """GSM8K rows -> chat prompts; the final number becomes ``answer``."""

    def to_prompt(example, tokenizer=None):
        final = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": example["question"]},
            ],
            "answer": final,
        }

    return to_prompt, {"remove_columns": ["question"]}

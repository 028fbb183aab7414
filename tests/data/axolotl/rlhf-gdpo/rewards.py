"""Reward module for the GDPO config of Axolotl's docs/rlhf.qmd.

``oai_gsm8k_transform`` and ``format_reward`` are the guide's own; its
``correctness_reward`` is a stub ("Your scoring logic here", an undefined
``score``, an ``answers`` column the transform does not produce), completed
here to read the ``answer`` column the transform keeps."""

import re


def oai_gsm8k_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        label = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "user", "content": example["question"]},
            ],
            "answer": label,
        }

    return transform_fn, {"remove_columns": ["question"]}


def format_reward(completions, **kwargs) -> list[float]:
    return [1.0 if len(c) > 10 else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for completion, correct in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion[0]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == str(correct) else 0.0)
    return rewards

"""Reward module for Axolotl's examples/llama-3/qlora-1b-gdpo.yaml, which names
``rwd.format_reward``, ``rwd.correctness_reward`` and ``rwd.gsm8k_transform``
but does not ship them. Written for grpo's tests in the shape of Axolotl's
GRPO guide (docs/grpo.qmd): GSM8K rows -> chat prompts with an ``answer``
column; rewards read the completion text."""

import re


def gsm8k_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        label = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "system", "content": "Solve the problem. Put the final number in <answer></answer> tags."},
                {"role": "user", "content": example["question"]},
            ],
            "answer": label,
        }

    return transform_fn, {"remove_columns": ["question"]}


def format_reward(completions, **kwargs) -> list[float]:
    return [1.0 if re.search(r"<answer>.*?</answer>", c[0]["content"], re.S) else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for completion, correct in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion[0]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == str(correct) else 0.0)
    return rewards

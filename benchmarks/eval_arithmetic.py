"""Held-out greedy accuracy on the arithmetic example, before and after GRPO.

    .venv/bin/python benchmarks/eval_arithmetic.py                       # base model
    .venv/bin/python benchmarks/eval_arithmetic.py grpo-output/arithmetic  # + trained adapter

Greedy-decodes the 64 held-out prompts of examples/arithmetic/data/test.jsonl
(no (a, b) pair of them is in the training split) with transformers, and
scores them with the example's own `correct_answer` reward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", nargs="?", help="a trained adapter (or model) directory; omit for the base model")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.model_files import DEFAULT_MODEL, resolve_model_dir

    sys.path.insert(0, str(EXAMPLE))
    from rewards import correct_answer  # noqa: E402

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter).merge_and_unload()
    model.eval()
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "test.jsonl").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = correct_answer([[{"role": "assistant", "content": c}] for c in completions], [r["answer"] for r in rows])
    accuracy = sum(scores) / len(scores)
    print(f"held-out greedy accuracy: {accuracy:.1%} ({int(sum(scores))}/{len(scores)})  model: {args.adapter or 'base'}")
    for text, completion, score in list(zip(rows, completions, scores))[:3]:
        print(f"  {text['prompt'][-1]['content']!r} -> {completion.strip()[:80]!r} ({'right' if score else 'wrong'})")


if __name__ == "__main__":
    main()

"""Held-out greedy accuracy on the arithmetic example, before and after GRPO.

    .venv/bin/python benchmarks/eval_arithmetic.py                       # base model
    .venv/bin/python benchmarks/eval_arithmetic.py grpo-output/arithmetic  # + trained adapter

A call of ``grpo eval``: the example's config with its 64 held-out prompts
(examples/arithmetic/data/test.jsonl; no (a, b) pair of them is in the
training split) as ``test_datasets``, greedy decoding with transformers, and
the example's own ``correct_answer`` reward, whose mean is the accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", nargs="?", help="a trained adapter directory; omit for the base model")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    from grpo_core.interface.cli import main as grpo

    test_set = (EXAMPLE / "data" / "test.jsonl").as_posix()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        argv = [
            "eval",
            str(EXAMPLE / "config.toml"),
            "--output",
            str(out),
            "--set",
            f'test_datasets=[{{path = "{test_set}"}}]',
            "--set",
            'trl.reward_funcs=["rewards.correct_answer"]',
            "--set",
            "trl.reward_weights=[1.0]",
            "--set",
            f"trl.max_completion_length={args.max_new_tokens}",
        ]
        if args.adapter:
            argv += ["--adapter", args.adapter]
        code = grpo(argv)
        if code:
            return code
        metrics = json.loads(out.read_text())
    accuracy, n = metrics["eval/rewards/correct_answer/mean"], int(metrics["eval/num_samples"])
    print(f"held-out greedy accuracy: {accuracy:.1%} ({round(accuracy * n)}/{n})  model: {args.adapter or 'base'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How a step's completions are laid out into micro-batches, and what
``torch_compile`` would buy: one step's LoRA forward+backward of the
arithmetic example's 4 prompts x 8 completions, prompts shared
(``share_prompt_prefix``), three ways:

* ``sorted 2x16``: grpo's layout for ``micro_batch_size = 16``,
  ``gradient_accumulation_steps = 2`` (:func:`grpo_core.optimization.batch.micro_batches`:
  sorted by length, so each micro-batch pads little, but each holds rows of
  every prompt, and each prompt runs once per micro-batch);
* ``grouped 2x16``: two whole groups per micro-batch (each prompt runs once
  per step, completions pad to the longest of two groups);
* ``1x32``: ``micro_batch_size = 32``, ``gradient_accumulation_steps = 1``;
* ``balanced 2``: sorted, two micro-batches cut where they pad least
  (:func:`grpo_core.optimization.batch.least_padding_cuts`; grpo's layout for
  the token-sum losses, ``dapo`` by default).

Completion lengths are drawn uniformly from ``--lengths`` ranges (an early
step's answers, then a trained policy's); ``lo-hi+N`` adds N answers cut at
``hi`` tokens to the 32 - N short ones (what a step looks like while a
policy learns to answer briefly: most answers short, some running to the
length limit). The layouts alternate, each round in an order rotated by one
(so no layout is always timed last), median of ``--repeats``. ``--compile``
also times the ``sorted 2x16`` step through a ``torch.compile``d decoder body
(what ``torch_compile = true`` runs; prompts are then not shared), with the
first call's seconds (compilation) apart.

    .venv/bin/python benchmarks/bench_micro_batch_layout.py --repeats 3 [--compile]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPTS, GENERATIONS, VOCAB = 4, 8, 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--lengths",
        nargs="+",
        default=["15-48", "8-16", "6-14+6@48"],
        help="completion length ranges, lo-hi, or lo-hi+N@cap: N of the 32 at cap tokens",
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time a torch.compile'd body (minutes to compile on 2 cores)"
    )
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary
    from grpo_core.optimization.batch import Sample, collate, micro_batches
    from grpo_core.optimization.logprobs import token_logprobs

    torch.manual_seed(0)
    rng = random.Random(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(DEFAULT_MODEL), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    compiled = None
    compile_seconds = None

    def step(batches, share: bool, body=None) -> float:
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        for mb in batches:
            logps, _ = token_logprobs(
                model,
                mb.input_ids,
                mb.attention_mask,
                mb.num_completion_tokens,
                with_entropy=True,
                share_prompts=share,
                body=body,
            )
            (logps * mb.completion_mask).sum().backward()
        return time.perf_counter() - began

    results = []
    for spec in args.lengths:
        span, _, capped = spec.partition("+")
        lo, hi = (int(x) for x in span.split("-"))
        long_count, _, cap = capped.partition("@")
        lengths = [rng.randint(lo, hi) for _ in range(PROMPTS * GENERATIONS)]
        for i in rng.sample(range(len(lengths)), int(long_count or 0)):
            lengths[i] = int(cap)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(33, 35))] for _ in range(PROMPTS)]
        samples = [
            Sample(
                prompt_ids=prompts[i // GENERATIONS],
                completion_ids=[rng.randrange(VOCAB) for _ in range(n)],
                advantage=1.0,
            )
            for i, n in enumerate(lengths)
        ]
        half = len(samples) // 2
        layouts = {
            "sorted 2x16": micro_batches(samples, half, 0, False),
            "grouped 2x16": [collate(samples[:half], 0, False), collate(samples[half:], 0, False)],
            "1x32": [collate(samples, 0, False)],
            "balanced 2": micro_batches(samples, half, 0, False, balanced=True),
        }
        times: dict[str, list[float]] = {name: [] for name in layouts}
        names = list(layouts)
        for round_ in range(args.repeats + 1):  # the first round is warm-up
            # Each round starts one layout later: the one timed last read slower in
            # every round of a fixed order (the machine warming), which no layout should carry.
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(step(layouts[name], share=True))
        row = {
            "lengths": spec,
            **{f"{name} s": statistics.median(t[1:]) for name, t in times.items()},
            **{f"{name} tokens": _tokens(batches) for name, batches in layouts.items()},
        }
        if args.compile:
            from grpo_core.modeling.compile import compiled_body

            if compiled is None:
                compiled = torch.compile(compiled_body(model), dynamic=True)
                compile_seconds = step(layouts["sorted 2x16"], share=False, body=compiled)
            runs = [step(layouts["sorted 2x16"], share=False, body=compiled) for _ in range(args.repeats + 1)]
            row["compiled sorted 2x16 s"] = statistics.median(runs[1:])  # the first may recompile for a new shape
        results.append(row)

    flags = cpu_flag_summary()
    print(
        f"CPU flags: {flags}; {torch.get_num_threads()} threads; one step's LoRA r16 forward+backward, "
        f"{PROMPTS} prompts x {GENERATIONS}, median of {args.repeats}"
    )
    for row in results:
        base = row["sorted 2x16 s"]
        print(f"completions {row['lengths']} tokens:")
        for name in ("sorted 2x16", "grouped 2x16", "1x32", "balanced 2"):
            print(
                f"  {name:<14}{row[name + ' s']:>7.2f} s  {base / row[name + ' s']:.2f}x  "
                f"{row[name + ' tokens']} tokens through the decoder (padding included)"
            )
        if "compiled sorted 2x16 s" in row:
            print(
                f"  compiled, sorted 2x16, prompts not shared: {row['compiled sorted 2x16 s']:.2f} s  "
                f"{base / row['compiled sorted 2x16 s']:.2f}x"
            )
    if compile_seconds is not None:
        print(f"first compiled step (compilation included): {compile_seconds:.0f} s")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "micro_batch_layout.json").write_text(
        json.dumps({"cpu_flags": flags, "first_compiled_step_seconds": compile_seconds, "rows": results}, indent=2)
    )


def _tokens(batches) -> int:
    """Tokens the shared-prompt forward pushes through the decoder: each
    distinct prompt once (at the micro-batch's prompt width), then every
    row's padded completion."""
    total = 0
    for mb in batches:
        c = mb.num_completion_tokens
        prompts = mb.input_ids[:, :-c]
        total += torch.unique(prompts, dim=0).shape[0] * prompts.shape[1] + mb.input_ids.shape[0] * c
    return total


if __name__ == "__main__":
    main()

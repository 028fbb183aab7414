"""The trainer's forward+backward with each distinct prompt run once
(``share_prompt_prefix = true``, the default) against every row run whole.

    .venv/bin/python benchmarks/bench_shared_prompts.py --repeats 5

The arithmetic example's micro-batch: SmolLM2-135M-Instruct + LoRA r16 on all
linear layers, 16 rows holding 4 distinct prompts of 34 tokens (the example's
chat-templated prompts are 33-35 tokens; 4 prompts x 8 completions sorted by
length spread each group over both micro-batches), completions of
``--completion-tokens`` (48: an early step's; the answers shorten to ~10
tokens as the policy learns). The two ways alternate, so a change in machine
load hits both; prints the median seconds, the ratio, the tokens each pushes
through the decoder, and the largest log-prob difference between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=34)
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[48, 12])
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_core.logprobs import token_logprobs
    from grpo_core.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.precision import cpu_flag_summary

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(DEFAULT_MODEL), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    generator = torch.Generator().manual_seed(0)
    results = []
    for completion in args.completion_tokens:
        prompts = torch.randint(0, 49152, (args.prompts, args.prompt_tokens), generator=generator)
        ids = torch.cat([prompts[torch.arange(args.rows) % args.prompts],
                         torch.randint(0, 49152, (args.rows, completion), generator=generator)], dim=1)  # fmt: skip
        mask = torch.ones_like(ids)
        times: dict[bool, list[float]] = {False: [], True: []}
        logps: dict[bool, torch.Tensor] = {}
        for _ in range(args.repeats + 1):
            for share in (False, True):
                model.zero_grad(set_to_none=True)
                began = time.perf_counter()
                lp, _ = token_logprobs(model, ids, mask, completion, with_entropy=True, share_prompts=share)
                lp.mean().backward()
                times[share].append(time.perf_counter() - began)
                logps[share] = lp.detach()
        whole, shared = (statistics.median(times[s][1:]) for s in (False, True))  # the first pass is warm-up
        row = {
            "completion_tokens": completion, "whole_seconds": whole, "shared_seconds": shared, "speedup": whole / shared,
            "whole_tokens": args.rows * (args.prompt_tokens + completion),
            "shared_tokens": args.prompts * args.prompt_tokens + args.rows * completion,
            "max_abs_logp_difference": float((logps[True] - logps[False]).abs().max()),
        }  # fmt: skip
        results.append(row)
    flags = cpu_flag_summary()
    print(f"CPU flags: {flags}; {torch.get_num_threads()} threads; LoRA r16 forward+backward of {args.rows} rows, "
          f"{args.prompts} distinct prompts of {args.prompt_tokens} tokens, median of {args.repeats}")
    print(f"{'completion tokens':>18}{'whole s':>10}{'shared s':>10}{'speed-up':>10}{'tokens':>16}{'max |dlogp|':>13}")
    for r in results:
        tokens = f"{r['whole_tokens']} -> {r['shared_tokens']}"
        print(f"{r['completion_tokens']:>18}{r['whole_seconds']:>10.2f}{r['shared_seconds']:>10.2f}{r['speedup']:>9.2f}x"
              f"{tokens:>16}{r['max_abs_logp_difference']:>13.1e}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "shared_prompts.json").write_text(json.dumps({"cpu_flags": flags, "rows": results}, indent=2))


if __name__ == "__main__":
    main()

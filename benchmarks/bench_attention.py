"""transformers' attention implementations in the trainer's forward+backward:
``sdpa`` (its default, PyTorch's CPU flash attention) against ``eager``
(matmuls and a softmax) and grpo's ``sdpa_float32`` (the flash kernel on
float32 q/k/v inside a bf16 pass, grpo_core/modeling/attention.py), interleaved, on the arithmetic micro-batch with
shared prompts (RESULTS.md, "Rates against this CPU's ceilings").

    .venv/bin/python benchmarks/bench_attention.py --precision bf16 --completion-tokens 48 --rounds 3
    .venv/bin/python benchmarks/bench_attention.py --precision bf16 --completion-tokens 400 --rounds 2

One model per implementation (the same seed, so the same LoRA), one
untimed warm-up round, then ``--rounds`` timed rounds, alternating;
prints each pass and the medians. bf16 runs as grpo's ``bf16`` does
(:func:`bench_ceiling.compute_context`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=["float32", "bf16"], default="bf16")
    parser.add_argument("--completion-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up")
    parser.add_argument(
        "--implementations",
        default="sdpa,eager,sdpa_float32",
        help="attn_implementation values to compare (sdpa_float32: grpo's float32 attention in a bf16 pass)",
    )
    args = parser.parse_args()

    from bench_ceiling import PROMPT_TOKENS, PROMPTS, ROWS, compute_context, grpo_pass
    from bench_shared_prompts import lora_model, micro_batch

    from grpo_core.modeling.precision import cpu_flag_summary

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    ids = micro_batch(torch.Generator().manual_seed(0), PROMPTS, ROWS, PROMPT_TOKENS, args.completion_tokens)
    from grpo_core.modeling.attention import register_sdpa_float32

    register_sdpa_float32()
    models = {}
    for implementation in args.implementations.split(","):
        torch.manual_seed(0)
        models[implementation] = lora_model(dtype, implementation)
    compute = compute_context(args.precision)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds + 1):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            grpo_pass(model, ids, args.completion_tokens, True, compute)
            took = time.perf_counter() - began
            if round_:
                times[name].append(took)
            print(f"  round {round_} {name}: {took:.2f} s", flush=True)
    print(
        f"CPU flags: {cpu_flag_summary()}; {torch.get_num_threads()} threads; {args.precision}; {ROWS} rows, "
        f"{PROMPTS} prompts of {PROMPT_TOKENS} tokens, {args.completion_tokens} completion tokens; "
        f"median of {args.rounds}: " + ", ".join(f"{n} {statistics.median(t):.2f} s" for n, t in times.items())
    )


if __name__ == "__main__":
    main()

"""Seconds of one arithmetic generation in an in-process vLLM engine (as
``vllm_mode = "colocate"`` builds it), split into the prefill and the decode
steps, optionally with a per-op profile of one 48-token generation.

    .venv/bin/python benchmarks/bench_vllm_decode.py --block-size 32 --eager
    .venv/bin/python benchmarks/bench_vllm_decode.py --block-size 32 --profile

The 4 chat-templated arithmetic prompts x 8 samples (``n = 8``), temperature
1, ``ignore_eos``, log-probs on, as grpo asks for them. One warm-up, then
``--rounds`` pairs of a 1-token request (the prefill, once per sample unless
prefix caching shares the prompt) and a 48-token one; a decode step is the
difference over 47 steps. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees its ops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=32, help="KV block size (vLLM's CPU default: 128)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (grpo's CPU default); else vLLM compiles the graph")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print the ops of one 48-token generation by self CPU time")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from bench_ceiling import arithmetic_prompts
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in arithmetic_prompts(AutoTokenizer.from_pretrained(model_dir), 4)]
    llm = LLM(model=model_dir, dtype=args.dtype, max_model_len=512, block_size=args.block_size, enforce_eager=args.eager, seed=0)

    def seconds(tokens: int) -> float:
        sampling = SamplingParams(n=8, max_tokens=tokens, temperature=1.0, ignore_eos=True, logprobs=0)
        began = time.perf_counter()
        llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - began

    seconds(48)  # warm-up
    print(f"CPU flags: {cpu_flag_summary()}; {args.dtype}, block size {args.block_size}, {'eager' if args.eager else 'compiled'}")
    for _ in range(args.rounds):
        prefill, whole = seconds(1), seconds(48)
        print(f"  1 token {prefill:.3f} s  48 tokens {whole:.3f} s  per decode step {(whole - prefill) / 47 * 1000:.0f} ms", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds(48)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()

"""What a vLLM completion request's seconds go to, by request shape: whether
the samples of one prompt share its prefill (RESULTS.md, "Rates against this
CPU's ceilings", the generation bullet).

    .venv/bin/python benchmarks/bench_vllm_prefill.py

Starts a float32 server of its own on all cores without LoRA layers (as
``bench_ceiling.py --vllm`` does), sends one 4 x 8 x 48-token warm-up, then
``--rounds`` rounds of each case, in turn: 1 prompt x 1 sample, the 4
chat-templated arithmetic prompts x 8 samples, 1 prompt x 32 samples and 32
separate copies of the prompts x 1 sample (1 token each: the prefill), and
4 x 8 with 2 and 48 tokens, with and without log-probs. If the 8 samples of
a prompt shared its prefill, 1 x 32 would cost about what 1 x 1 does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def seconds(url: str, prompts: list[list[int]], samples: int, tokens: int, logprobs: int | None = 0) -> float:
    body = {
        "model": "base",
        "prompt": prompts,
        "n": samples,
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    began = time.perf_counter()
    requests.post(url, json=body, timeout=600).raise_for_status()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's KV block size (its CPU default: 128)")
    args = parser.parse_args()

    from bench_ceiling import arithmetic_prompts, start_server
    from transformers import AutoTokenizer

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    prompts = arithmetic_prompts(AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL)), 4)
    server, base_url = start_server(("--block-size", str(args.block_size)) if args.block_size else ())
    url = base_url + "/v1/completions"
    cases = {  # label: (prompts, samples, tokens, logprobs)
        "1 prompt x 1, 1 token": (prompts[:1], 1, 1, 0),
        "4 prompts x 8, 1 token": (prompts, 8, 1, 0),
        "4 prompts x 8, 1 token, no logprobs": (prompts, 8, 1, None),
        "4 prompts x 8, 2 tokens": (prompts, 8, 2, 0),
        "4 prompts x 8, 48 tokens": (prompts, 8, 48, 0),
        "4 prompts x 8, 48 tokens, no logprobs": (prompts, 8, 48, None),
        "1 prompt x 32, 1 token": (prompts[:1], 32, 1, 0),
        "32 prompts x 1, 1 token": (prompts * 8, 1, 1, 0),
    }
    try:
        seconds(url, prompts, 8, 48)  # warm-up
        taken: dict[str, list[float]] = {label: [] for label in cases}
        for _ in range(args.rounds):
            for label, case in cases.items():
                taken[label].append(seconds(url, *case))
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
    print(f"CPU flags: {cpu_flag_summary()}; vLLM float32, all cores, no LoRA; seconds per request, each round:")
    for label, values in taken.items():
        print(f"  {label:<40}" + "  ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()

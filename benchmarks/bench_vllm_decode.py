"""Seconds of one arithmetic generation in an in-process vLLM engine (as
``vllm_mode = "colocate"`` builds it), split into the prefill and the decode
steps, optionally with a per-op profile of one 48-token generation.

    .venv/bin/python benchmarks/bench_vllm_decode.py --block-size 32 --eager
    .venv/bin/python benchmarks/bench_vllm_decode.py --block-size 32 --profile
    .venv/bin/python benchmarks/bench_vllm_decode.py --eager --dtype bfloat16 --compare-kernels --rounds 3

``--kernels`` builds the engine with vLLM's CPU sampler and RMSNorm
(``vllm``), grpo's (``grpo``, what ``[vllm] cpu_kernels`` installs:
grpo_plugins/vllm/cpu_kernels.py), or one of grpo's (``sampler``,
``norms``). ``--compare-kernels`` builds one engine and switches it between
the four, alternating within each of ``--rounds`` rounds, and prints the
median decode step of each.

The 4 chat-templated arithmetic prompts x 8 samples (``n = 8``), temperature
1, ``ignore_eos``, log-probs on (``processed_logprobs``), as grpo asks for them. One warm-up, then
``--rounds`` pairs of a 1-token request (the prefill, once per sample unless
prefix caching shares the prompt) and a 48-token one; a decode step is the
difference over 47 steps. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees its ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=32, help="KV block size (vLLM's CPU default: 128)")
    parser.add_argument(
        "--eager", action="store_true", help="enforce_eager (grpo's CPU default); else vLLM compiles the graph"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="print the ops of one 48-token generation by self CPU time"
    )
    parser.add_argument(
        "--kernels", choices=KERNELS, default="vllm", help="whose CPU sampler and RMSNorm (module docstring)"
    )
    parser.add_argument(
        "--compare-kernels", action="store_true", help="one engine switched between the --kernels choices, alternating"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if args.compare_kernels:
        compare_kernels(args)
        return

    _, seconds = warm_engine(args, args.kernels)
    print(f"{args.kernels} kernels")
    for _ in range(args.rounds):
        prefill, whole = seconds(1), seconds(48)
        print(
            f"  1 token {prefill:.3f} s  48 tokens {whole:.3f} s  per decode step {(whole - prefill) / 47 * 1000:.0f} "
            "ms",
            flush=True,
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds(48)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


KERNELS = ("vllm", "grpo", "sampler", "norms")


def warm_engine(args: argparse.Namespace, kernels: str):
    """The in-process engine with ``kernels`` (after one warm-up generation,
    its settings printed), and ``seconds(tokens)``: one generation of the
    arithmetic batch of that many tokens, timed."""
    from bench_ceiling import arithmetic_prompts
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    prompts = [
        TokensPrompt(prompt_token_ids=p) for p in arithmetic_prompts(AutoTokenizer.from_pretrained(model_dir), 4)
    ]
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=512,
        block_size=args.block_size,
        enforce_eager=args.eager,
        seed=0,
        logprobs_mode="processed_logprobs",
        **kernel_arguments(kernels),
    )

    def seconds(tokens: int) -> float:
        sampling = SamplingParams(n=8, max_tokens=tokens, temperature=1.0, ignore_eos=True, logprobs=0)
        began = time.perf_counter()
        llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - began

    seconds(48)  # warm-up
    print(
        f"CPU flags: {cpu_flag_summary()}; {args.dtype}, block size {args.block_size}, "
        f"{'eager' if args.eager else 'compiled'}",
        end="; ",
    )
    return llm, seconds


def kernel_arguments(kernels: str) -> dict:
    """Install the kernels ``kernels`` names in this process; the engine arguments that pick them."""
    from grpo_plugins.vllm import cpu_kernel_impls, cpu_kernels

    cpu_kernels.install(enabled=kernels in ("grpo", "sampler"))
    cpu_kernel_impls.register_norms(cpu_kernels.PROVIDER)
    return {"ir_op_priority": cpu_kernels.IR_OP_PRIORITY} if kernels in ("grpo", "norms") else {}


def use_kernels(llm, kernels: str) -> None:
    """Switch ``llm``'s engine (in this process) to ``kernels``: its sampler's
    bound ``forward`` and the RMSNorm ops' dispatch priority."""
    from vllm import ir

    from grpo_plugins.vllm import cpu_kernels

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    sampler = runner.sampler.topk_topp_sampler
    grpo_sampler = type(sampler).forward_cpu
    forward = grpo_sampler if kernels in ("grpo", "sampler") else grpo_sampler._vllm_forward_cpu
    sampler.forward = forward.__get__(sampler)
    for name, priority in cpu_kernels.IR_OP_PRIORITY.items():
        getattr(ir.ops, name).set_default(priority if kernels in ("grpo", "norms") else priority[1:])


def compare_kernels(args: argparse.Namespace) -> None:
    """One engine built with grpo's kernels, switched between the four choices
    (:func:`use_kernels`), alternating within each round: the machine's drift
    between rounds falls on every choice alike."""
    llm, seconds = warm_engine(args, "grpo")
    print("kernels switched per round")
    steps: dict[str, list[float]] = {k: [] for k in KERNELS}
    for round_ in range(args.rounds):
        for kernels in KERNELS:
            use_kernels(llm, kernels)
            prefill, whole = seconds(1), seconds(48)
            steps[kernels].append((whole - prefill) / 47 * 1000)
        print(f"  round {round_}: " + "  ".join(f"{k} {v[-1]:.0f} ms" for k, v in steps.items()), flush=True)
    vllm = statistics.median(steps["vllm"])
    for kernels, ms in steps.items():
        print(
            f"{kernels:8s} median {statistics.median(ms):.0f} ms per decode step: {vllm / statistics.median(ms):.2f}x "
            "vLLM's"
        )


if __name__ == "__main__":
    main()

"""vLLM engine start against generation speed, with and without graph
compilation (``[vllm] enforce_eager``), for an in-process engine as
``vllm_mode = "colocate"`` builds it.

    .venv/bin/python benchmarks/bench_vllm_startup.py

Each mode runs in its own process (an in-process engine changes process-wide
state): SmolLM2-135M-Instruct in float32, 4 prompts x 8 samples x 48 tokens
(``ignore_eos``), one cold and one warm request. Also times a trainer
forward/backward (batch 8 x 64 tokens) before and after the engine starts,
to show the engine's thread pinning does not slow the trainer. Prints the
start-up seconds, warm tokens/s and the ratio of eager to compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def measure(model_dir: str, eager: bool) -> dict[str, float]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from transformers import AutoModelForCausalLM

    def train_step_seconds(model: torch.nn.Module) -> float:
        ids = torch.randint(0, 1000, (8, 64))
        start = time.perf_counter()
        for _ in range(2):
            model(input_ids=ids).logits.float().mean().backward()
        return (time.perf_counter() - start) / 2

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = train_step_seconds(model)
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype="float32", max_model_len=512, logprobs_mode="processed_logprobs", enforce_eager=eager
    )
    startup = time.perf_counter() - start
    params = SamplingParams(n=8, max_tokens=48, temperature=1.0, logprobs=0, ignore_eos=True, seed=1)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}] * 4
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        rates.append(tokens / (time.perf_counter() - start))
    return {
        "startup_s": startup,
        "cold_tok_s": rates[0],
        "warm_tok_s": rates[1],
        "train_step_s_before": before,
        "train_step_s_after": train_step_seconds(model),
    }


def main() -> None:
    if len(sys.argv) == 3:  # child: one mode
        print("RESULT " + json.dumps(measure(sys.argv[1], sys.argv[2] == "eager")), flush=True)
        return
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    rows = {}
    for mode in ("eager", "compiled"):
        done = subprocess.run([sys.executable, __file__, model_dir, mode], capture_output=True, text=True, check=True)
        rows[mode] = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[7:])
    print(f"{'mode':<10}{'start s':>10}{'cold tok/s':>12}{'warm tok/s':>12}{'train step s before/after':>28}")
    for mode, r in rows.items():
        print(
            f"{mode:<10}{r['startup_s']:>10.1f}{r['cold_tok_s']:>12.1f}{r['warm_tok_s']:>12.1f}"
            f"{r['train_step_s_before']:>16.2f} / {r['train_step_s_after']:.2f}"
        )
    e, c = rows["eager"], rows["compiled"]
    print(
        f"eager vs compiled: start {c['startup_s'] / e['startup_s']:.1f}x faster, warm generation "
        f"{e['warm_tok_s'] / c['warm_tok_s']:.2f}x"
    )


if __name__ == "__main__":
    main()

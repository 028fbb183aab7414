"""What vLLM's one-second busy-wait after each request costs a trainer that
shares the server's CPU cores, with vLLM's default and with grpo's
(``GRPO_VLLM_IDLE_SPIN_S=0``, grpo_plugins/vllm/idle_spin.py), in one run.

    .venv/bin/python benchmarks/bench_idle_spin.py [--repeats 5]

For each setting, one server as ``grpo run`` starts it (server_spec:
SmolLM2-135M-Instruct, float32, LoRA loading on; only the variable differs),
then ``--repeats`` times: a generation request (8 samples x 16 tokens), and
right after it the trainer's side of a sync check (a 48-token forward of the
LoRA policy, 2 torch threads) and 20 matmuls of the MLP's shape; then the
same again 1.5 s after a request. Also the server's CPU seconds in the second
after it answered. Prints medians, the ratio of the spinning server's numbers
to grpo's, and the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from process_group import group_cpu_seconds  # noqa: E402


def measure(spin: str | None, model_dir: str, policy, repeats: int) -> dict[str, float]:
    from transformers import AutoTokenizer
    from vllm_session import make_config

    from grpo_core.sync.verify import probe_ids, trainer_logprobs
    from grpo_plugins.vllm.client import VLLMClient
    from grpo_plugins.vllm.command_line import server_spec
    from grpo_plugins.vllm.idle_spin import IDLE_SPIN_ENV
    from grpo_plugins.vllm.server import ManagedServer

    out = Path(tempfile.mkdtemp(prefix="grpo-bench-spin-"))
    spec = server_spec(make_config(model_dir, out), lora=True)
    if spin is None:
        spec.env.pop(IDLE_SPIN_ENV, None)  # vLLM's own default: one second
    else:
        spec.env[IDLE_SPIN_ENV] = spin
    server = ManagedServer(spec, out / "vllm-server.log")
    server.start()
    server.wait_ready(600)
    client = VLLMClient(server.base_url, spec.api_key)
    ids = probe_ids(AutoTokenizer.from_pretrained(model_dir))

    class Float32:
        def autocast(self, device_type: str):
            import contextlib

            return contextlib.nullcontext()

    x, w = torch.randn(512, 576), torch.randn(576, 1536)

    def generate() -> None:
        client.completions(
            {"model": "base", "prompt": ids[:20], "max_tokens": 16, "n": 8, "temperature": 1.0}, parse=lambda d: d
        )

    def work() -> tuple[float, float]:
        start = time.perf_counter()
        trainer_logprobs(policy, ids, Float32())
        forward = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(20):
            x @ w
        return forward, time.perf_counter() - start

    try:
        generate()  # warm-up
        time.sleep(1.5)
        after, later, idle_cpu = [], [], []
        for _ in range(repeats):
            generate()
            after.append(work())
            time.sleep(1.5)
            generate()
            before = group_cpu_seconds(server.process.pid)
            time.sleep(1.0)
            idle_cpu.append(group_cpu_seconds(server.process.pid) - before)
            time.sleep(0.5)
            later.append(work())
    finally:
        server.stop()
    return {
        "forward_right_after_s": statistics.median(a[0] for a in after),
        "forward_later_s": statistics.median(a[0] for a in later),
        "matmuls_right_after_s": statistics.median(a[1] for a in after),
        "matmuls_later_s": statistics.median(a[1] for a in later),
        "server_cpu_s_in_the_second_after": statistics.median(idle_cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir
    from grpo_core.modeling.precision import cpu_flag_summary

    torch.manual_seed(0)
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
    )
    results = {
        "vllm_default": measure(None, model_dir, policy, args.repeats),
        "grpo": measure("0", model_dir, policy, args.repeats),
    }
    spin, grpo = results["vllm_default"], results["grpo"]
    print(f"{'':34s} {'vLLM default':>12s} {'grpo (0 s)':>12s} {'ratio':>7s}")
    for key in spin:
        ratio = spin[key] / grpo[key] if grpo[key] > 0 else float("inf")
        print(f"{key:34s} {spin[key]:12.3f} {grpo[key]:12.3f} {ratio:7.2f}x")
    flags = cpu_flag_summary()
    print(f"cpu flags: {flags}; torch threads {torch.get_num_threads()}")
    print("RESULT " + json.dumps({"cpu_flags": flags, **results}))


if __name__ == "__main__":
    main()

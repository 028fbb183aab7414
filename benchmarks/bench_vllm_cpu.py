"""Generation throughput of vLLM's CPU backend under the settings grpo
chooses, against the alternatives, and against transformers `generate`, in
one invocation:

    .venv/bin/python benchmarks/bench_vllm_cpu.py

Each case serves SmolLM2-135M-Instruct and generates 4 prompts x 8 samples
x 48 tokens (the arithmetic example's batch shape, `ignore_eos`), twice;
the second (warm) request is reported. Cases:

* bf16, default core reservation (what a hand-started server does here)
* float32, default reservation
* float32, all cores (grpo's managed default on CPUs without native bf16)
* float32, all cores, LoRA enabled, request through a loaded adapter
* transformers `generate` (fp32, the same batch) as the peer

Writes benchmarks/results/vllm_cpu.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
PROMPTS, SAMPLES, TOKENS = 4, 8, 48


def serve(
    model_dir: str, port: int, dtype: str, all_cores: bool, lora: bool, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if all_cores:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        "base",
        "--dtype",
        dtype,
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", "16"]
    argv += list(extra)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("vLLM did not come up")


def make_adapter(model_dir: str, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=16, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.save_pretrained(out)


def tokens_per_second(port: int, model: str) -> float:
    prompt = list(range(100, 132))
    body = {
        "model": model,
        "prompt": [prompt] * PROMPTS,
        "n": SAMPLES,
        "max_tokens": TOKENS,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    rate = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        response = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=900)
        response.raise_for_status()
        rate = PROMPTS * SAMPLES * TOKENS / (time.perf_counter() - t0)
    return rate


def transformers_rate(model_dir: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.arange(100, 132).repeat(PROMPTS * SAMPLES, 1)
    rate = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=True
        )
        rate = PROMPTS * SAMPLES * TOKENS / (time.perf_counter() - t0)
    return rate


def main() -> None:
    from grpo_core.modeling.model_files import DEFAULT_MODEL, resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    cases = [
        ("vllm bf16, 1 engine core", "bfloat16", False, False),
        ("vllm fp32, 1 engine core", "float32", False, False),
        ("vllm fp32, all cores (grpo CPU default)", "float32", True, False),
        ("vllm fp32, all cores, LoRA adapter", "float32", True, True),
    ]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(tmp) / "adapter"
        make_adapter(model_dir, adapter)
        for name, dtype, all_cores, lora in cases:
            proc = serve(model_dir, 8197, dtype, all_cores, lora)
            try:
                model = "base"
                if lora:
                    requests.post(
                        "http://127.0.0.1:8197/v1/load_lora_adapter",
                        json={"lora_name": "policy", "lora_path": str(adapter)},
                        timeout=60,
                    ).raise_for_status()
                    model = "policy"
                results[name] = tokens_per_second(8197, model)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(60)
            print(f"{name:<45}{results[name]:>8.1f} tok/s", flush=True)
    results["transformers generate fp32"] = transformers_rate(model_dir)
    peer = results["transformers generate fp32"]
    print(f"{'transformers generate fp32':<45}{peer:>8.1f} tok/s")
    print("\nratio to transformers generate:")
    for name, rate in results.items():
        print(f"  {name:<45}{rate / peer:>6.2f}x")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "vllm_cpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

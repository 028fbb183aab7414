"""Run by test_vllm_colocate.py in its own interpreter: an in-process vLLM
engine changes process-wide state (environment, thread affinity, logging)
that must not leak into the pytest process.

Builds the colocated rollout and in-memory sync exactly as ``grpo run``
does, syncs a LoRA model whose adapter covers only *some* members of vLLM's
fused projections (q and v without k; gate without up), and prints JSON:
how far the engine's log-probs are from the trainer's PEFT forward and from
the base model, before and after the sync.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, output_dir: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import Prompt, SamplingSettings
    from grpo_core.host.plugin_host import PluginHost

    cfg = validate(
        {
            "base_model": model_dir,
            "adapter": "lora",
            "output_dir": output_dir,
            "sequence_len": 256,
            "vllm": {"dtype": "float32", "max_model_len": 256, "cpu_kvcache_space": 1},
            "trl": {"use_vllm": True, "vllm_mode": "colocate"},
        }
    )
    context = RunContext(config=cfg, output_dir=Path(output_dir))
    host = PluginHost()
    rollout = host.load_implementation("rollout", "vllm_colocate", context)
    sync = host.load_implementation("weight_sync", "vllm_in_memory", context)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for i, q in enumerate(["What is 3 + 4?", "Name a colour."]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(Prompt(prompt=q, prompt_ids=list(ids["input_ids"] if hasattr(ids, "keys") else ids), index=i))

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.06)
    model.eval()
    frozen_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}

    def logprob_gap(groups, reference) -> float:
        diffs = []
        for group in groups:
            for c in group.completions:
                ids = torch.tensor([group.prompt.prompt_ids + c.token_ids])
                with torch.no_grad():
                    logits = reference(input_ids=ids).logits[0, len(group.prompt.prompt_ids) - 1 : -1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                diffs += (ref - torch.tensor(c.logprobs)).abs().tolist()
        return sum(diffs) / len(diffs)

    sampling = SamplingSettings(max_tokens=12, seed=3)
    rollout.grpo_train_start()
    before = rollout.grpo_rollout_generate(prompts=prompts, num_generations=3, sampling=sampling, policy_version=0)
    result = sync.grpo_sync_weights(model=model, version=1, engine=host.hook.grpo_inference_engine())
    after = rollout.grpo_rollout_generate(prompts=prompts, num_generations=3, sampling=sampling, policy_version=1)
    with model.disable_adapter():
        before_vs_base = logprob_gap(before, model)
        after_vs_base = logprob_gap(after, model)
    after_vs_policy = logprob_gap(after, model)
    unchanged = all(torch.equal(v, model.get_base_model().state_dict()[k]) for k, v in frozen_before.items())
    rollout.grpo_train_end()
    print(
        "PROBE "
        + json.dumps(
            {
                "before_vs_base": before_vs_base,
                "after_vs_base": after_vs_base,
                "after_vs_policy": after_vs_policy,
                "sync_seconds": result.seconds,
                "detail": result.detail,
                "trainer_base_unchanged": unchanged,
                "groups": [len(g.completions) for g in after],
                "versions": [g.policy_version for g in after],
            }
        )
    )


if __name__ == "__main__":  # vLLM's engine needs the guard
    main(sys.argv[1], sys.argv[2])

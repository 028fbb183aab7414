"""LoRA inputs stay in the compute dtype under autocast
(grpo_core/modeling/adapter_casts.py): exact, and peft's switch is restored."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from tiny_model import random_llama

from grpo_core.modeling.adapter_casts import adapter_inputs_uncast
from grpo_core.modeling.precision import Precision
from grpo_core.optimization.logprobs import token_logprobs

BF16 = Precision(torch.bfloat16, torch.bfloat16, "test: bf16 compute")


def lora_llama(use_dora: bool = False) -> torch.nn.Module:
    """A tiny Llama as grpo loads a LoRA policy for bf16 compute: frozen base in bf16, adapters float32."""
    model = random_llama(hidden_size=32, num_hidden_layers=2, num_attention_heads=4).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=use_dora))
    with torch.no_grad():  # a trained adapter (a fresh one has B = 0 and adds nothing)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def cast_switches(model: torch.nn.Module) -> list[bool]:
    return [m.cast_input_dtype_enabled for m in model.modules() if isinstance(m, LoraLinear)]


def forward_backward(model: torch.nn.Module, with_model: bool):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    with BF16.autocast("cpu", model if with_model else None):
        logps, _ = token_logprobs(model, ids, torch.ones_like(ids), 6)
    logps.float().sum().backward()
    return logps.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_under_autocast_the_adapters_see_the_compute_dtype_and_nothing_changes() -> None:
    model = lora_llama()
    seen: list[torch.dtype] = []
    hooks = [
        m.lora_A["default"].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
        for m in model.modules()
        if isinstance(m, LoraLinear)
    ]
    peft_logps, peft_grads = forward_backward(model, with_model=False)
    assert set(seen) == {torch.float32}  # peft's own cast: bf16 activations to the adapters' float32
    seen.clear()
    logps, grads = forward_backward(model, with_model=True)
    assert set(seen) == {torch.bfloat16}
    for hook in hooks:
        hook.remove()
    # the cast was a round trip autocast undid: log-probs and gradients are bit-identical
    assert torch.equal(logps, peft_logps)
    assert all(torch.equal(a, b) for a, b in zip(grads, peft_grads))
    assert all(cast_switches(model))  # restored: a forward outside autocast casts again


def test_outside_the_region_a_bf16_input_still_reaches_float32_adapters() -> None:
    model = lora_llama()
    with BF16.autocast("cpu", model):
        assert not any(cast_switches(model))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids)  # no autocast: would fail with bf16 inputs meeting float32 adapters if not restored


def test_nested_and_overlapping_regions_restore_the_switch_once_all_end() -> None:
    model = lora_llama()
    inner_entered, release = threading.Event(), threading.Event()

    def other_thread() -> None:  # a rollout thread's region overlapping the trainer's
        with adapter_inputs_uncast(model):
            inner_entered.set()
            release.wait(10)

    with adapter_inputs_uncast(model):
        with adapter_inputs_uncast(model):
            assert not any(cast_switches(model))
        thread = threading.Thread(target=other_thread)
        thread.start()
        inner_entered.wait(10)
    assert not any(cast_switches(model))  # the other region is still open
    release.set()
    thread.join()
    assert all(cast_switches(model))


def test_a_setting_made_before_is_kept_and_an_error_still_restores() -> None:
    model = lora_llama()
    first = next(m for m in model.modules() if isinstance(m, LoraLinear))
    first.cast_input_dtype_enabled = False  # somebody's own choice
    with pytest.raises(RuntimeError, match="boom"), adapter_inputs_uncast(model):
        raise RuntimeError("boom")
    assert cast_switches(model) == [False] + [True] * (len(cast_switches(model)) - 1)


def test_dora_layers_and_float32_runs_are_left_alone() -> None:
    dora = lora_llama(use_dora=True)
    with BF16.autocast("cpu", dora):
        assert all(cast_switches(dora))  # a variant may use its input outside autocast's ops
    model = lora_llama()
    with Precision(torch.float32, None, "float32").autocast("cpu", model):
        assert all(cast_switches(model))

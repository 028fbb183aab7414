"""Mixed precision chosen by the hardware (the CPU's flags are faked here,
never read from the machine running the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_model import random_llama
from transformers import LlamaForCausalLM

from grpo_core.config.loader import validate
from grpo_core.modeling.precision import native_bf16, resolve_precision
from grpo_core.optimization.logprobs import token_logprobs

AVX2 = {"avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}


def config(**top: object):
    return validate({"base_model": "m", **top})


@pytest.mark.parametrize(
    ("flags", "native"), [(AVX2, False), (AVX512, False), (AVX512_BF16, True), (AMX, True), (set(), False)]
)
def test_native_bf16_by_cpu_class(flags: set[str], native: bool) -> None:
    assert native_bf16("cpu", flags) is native


@pytest.mark.parametrize(("flags", "auto_on"), [(AVX2, False), (AVX512, False), (AVX512_BF16, True), (AMX, True)])
@pytest.mark.parametrize("adapter", ["lora", None])
def test_bf16_auto_only_where_native_and_trained_weights_stay_float32(
    flags: set[str], auto_on: bool, adapter: str | None
) -> None:
    auto = resolve_precision(config(bf16="auto", adapter=adapter), "cpu", flags)
    forced = resolve_precision(config(bf16=True, adapter=adapter), "cpu", flags)
    off = resolve_precision(config(bf16=False, adapter=adapter), "cpu", flags)
    assert auto.compute_dtype == (torch.bfloat16 if auto_on else None)
    assert forced.compute_dtype == torch.bfloat16  # asked for: honoured even where emulated
    assert off.compute_dtype is None and off.load_dtype == torch.float32
    # only a LoRA's frozen base may live in bf16; anything trained keeps float32 master weights
    expected_load = torch.bfloat16 if adapter == "lora" else torch.float32
    assert forced.load_dtype == expected_load
    assert auto.load_dtype == (expected_load if auto_on else torch.float32)


def tiny_llama(vocab_size: int = 64) -> LlamaForCausalLM:
    return random_llama(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_key_value_heads=1)


def test_lora_in_bf16_loads_a_bf16_base_with_float32_adapters(tmp_path: Path, smollm2_tokenizer) -> None:
    from grpo_core.modeling.models import load_policy

    tiny_llama(len(smollm2_tokenizer)).save_pretrained(tmp_path)
    cfg = config(bf16=True, adapter="lora", lora_r=4)
    model = load_policy(cfg, str(tmp_path), smollm2_tokenizer)
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32} and all("lora_" in n for n in trainable)
    assert set(frozen.values()) == {torch.bfloat16}


def test_full_fine_tune_in_bf16_keeps_float32_master_weights_and_optimizer_state() -> None:
    precision = resolve_precision(config(bf16=True), "cpu", AVX2)
    model = tiny_llama()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seen: list[torch.dtype] = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.randint(0, 64, (2, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with precision.autocast("cpu"):
        logps, _ = token_logprobs(model, ids, torch.ones_like(ids), 4)
    handle.remove()
    assert seen == [torch.bfloat16]  # the matmuls ran in bf16
    (-logps.float().mean()).backward()
    optimizer.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    state = optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_cpu_flag_summary_names_the_flags_that_decide_speed():
    from grpo_core.modeling.precision import cpu_flag_summary

    assert cpu_flag_summary({"fpu", "avx2", "sse4_2"}) == "avx2"
    assert (
        cpu_flag_summary({"avx512_bf16", "avx2", "avx512f", "amx_tile", "amx_bf16"})
        == "avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
    )
    assert cpu_flag_summary(set()) == "none of avx2/avx512/amx"

"""``sdpa_float32``: attention in float32 inside a bf16 pass on a CPU
(grpo_core/modeling/attention.py). The CPU's flags are faked here, never read
from the machine running the tests."""

from __future__ import annotations

import pytest
import torch
from tiny_model import random_llama
from transformers import LlamaForCausalLM

from grpo_core.config.loader import validate
from grpo_core.modeling.attention import SDPA_FLOAT32, register_sdpa_float32, sdpa_float32_forward
from grpo_core.modeling.models import resolve_attn_implementation
from grpo_core.optimization.logprobs import token_logprobs

AVX2 = {"avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}
AMX = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


def config(**top: object):
    return validate({"base_model": "m", "adapter": "lora", **top})


@pytest.mark.parametrize(
    ("bf16", "flags", "device", "expected"),
    [
        ("auto", AMX, "cpu", SDPA_FLOAT32),  # bf16 compute on a native-bf16 CPU
        ("auto", AVX512, "cpu", None),  # float32 pass: transformers' default
        ("auto", AVX2, "cpu", None),
        (True, AVX2, "cpu", SDPA_FLOAT32),  # bf16 asked for, emulated: attention still float32
        (False, AMX, "cpu", None),
        (True, AMX, "cuda", None),  # GPUs keep transformers' default
    ],
)
def test_a_bf16_pass_on_a_cpu_gets_float32_attention_unless_told_otherwise(bf16, flags, device, expected) -> None:
    assert resolve_attn_implementation(config(bf16=bf16), device, flags) == expected


def test_what_the_user_names_wins() -> None:
    assert resolve_attn_implementation(config(bf16=True, attn_implementation="sdpa"), "cpu", AMX) == "sdpa"
    assert resolve_attn_implementation(config(bf16=True, sdp_attention=False), "cpu", AMX) == "eager"
    assert resolve_attn_implementation(config(attn_implementation=SDPA_FLOAT32), "cpu", AVX2) == SDPA_FLOAT32


def test_the_kernel_sees_float32_and_hands_back_the_input_dtype() -> None:
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, 4, 7, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_float32_forward(module, q, k, v, None, scaling=0.25)
    # transformers hands sdpa [B, H, L, D] and gets [B, L, H, D] back
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=0.25
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected.transpose(1, 2).to(torch.bfloat16))
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


def tiny_llama(attn_implementation: str) -> LlamaForCausalLM:
    return random_llama(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, attn_implementation=attn_implementation
    )


@pytest.mark.parametrize("share_prompts", [False, True])
def test_in_float32_it_is_sdpa_exactly_padding_and_shared_prompts_included(share_prompts: bool) -> None:
    """The same masks as sdpa (left-padded prompts, the shared-prompt KV cache):
    in a float32 pass the casts are no-ops, so log-probs and gradients are equal."""
    register_sdpa_float32()
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    ids[2:, :8] = ids[:2, :8]  # rows 2 and 3 repeat the prompts of rows 0 and 1
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt
    mask[3, :3] = 0
    results = []
    for implementation in ("sdpa", SDPA_FLOAT32):
        model = tiny_llama(implementation)
        logps, _ = token_logprobs(model, ids, mask, 4, share_prompts=share_prompts)
        logps.sum().backward()
        results.append((logps.detach(), [p.grad.clone() for p in model.parameters()]))
    (sdpa, sdpa_grads), (ours, our_grads) = results
    assert torch.equal(sdpa, ours)
    assert all(torch.equal(a, b) for a, b in zip(sdpa_grads, our_grads))


def test_a_bf16_pass_runs_its_attention_kernel_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observed, not mocked: the real kernel runs, this only records its dtypes."""
    register_sdpa_float32()
    seen: list[torch.dtype] = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        seen.append(query.dtype)
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    for implementation, dtype in (("sdpa", torch.bfloat16), (SDPA_FLOAT32, torch.float32)):
        seen.clear()
        model = tiny_llama(implementation).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logps, _ = token_logprobs(model, ids, torch.ones_like(ids), 4)
        logps.float().sum().backward()
        assert seen == [dtype, dtype], implementation  # one call per layer
        assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters())

"""grpo's CPU kernels for vLLM (grpo_plugins/vllm/cpu_kernels.py and
cpu_kernel_impls.py): the
inverse-CDF sampler draws from the same distribution as vLLM's, the C++
RMSNorm provider computes what vLLM's native forms compute, and grpo asks
for them only for the CPU engines it starts. The real engines of the other
vLLM tests (the session's server, the colocated runs) run with them on."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_plugins.vllm import cpu_kernel_impls, cpu_kernels, machine
from grpo_plugins.vllm.command_line import server_spec
from grpo_plugins.vllm.engine_settings import ir_op_priority

CHI_SQUARE_P_1E6 = {4: 33.4, 5: 35.9}
"""Critical values of the chi-square distribution at p = 1e-6 by degrees of freedom."""


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_inverse_cdf_sampling_draws_from_the_rows_distribution() -> None:
    """A goodness-of-fit test over 200k draws; a removed token (-inf, as
    top-k/top-p leave them) is never drawn, however the rounding falls."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.0, 0.04, 0.01])
    logprobs = probs.log().expand(200_000, -1).contiguous()
    drawn = cpu_kernel_impls.sample_inverse_cdf(logprobs, {})
    assert drawn.shape == (200_000,) and drawn.dtype == torch.int64
    counts = torch.bincount(drawn, minlength=probs.numel()).double()
    assert counts[4] == 0
    assert chi_square(counts, probs.double()) < CHI_SQUARE_P_1E6[5]


def test_inverse_cdf_sampling_over_a_real_vocabulary_keeps_rare_tokens_rare() -> None:
    """49k entries, one token at 0.6 and the rest spread thin: the frequent
    token's share and the tail's both hold (float64 cumulative sums)."""
    torch.manual_seed(1)
    logits = torch.randn(49152) * 2
    logits[123] = logits.max() + 12
    logprobs = torch.log_softmax(logits, -1)
    p_top = float(logprobs[123].exp())
    rows = logprobs.expand(250, -1)
    drawn = torch.cat([cpu_kernel_impls.sample_inverse_cdf(rows, {}) for _ in range(40)])  # 10k draws
    share = float((drawn == 123).double().mean())
    assert abs(share - p_top) < 5 * math.sqrt(p_top * (1 - p_top) / drawn.numel())
    assert drawn.max() < 49152 and drawn.min() >= 0


def test_seeded_rows_draw_from_their_own_generator() -> None:
    """A request with its own seed repeats its tokens whatever the rest of
    the batch draws; the rest follow torch's global generator."""
    logprobs = torch.log_softmax(torch.randn(4, 1000), -1)

    def draw(global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        generators = {1: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}
        return torch.stack([cpu_kernel_impls.sample_inverse_cdf(logprobs, generators) for _ in range(20)])

    first, again, other = draw(0), draw(0), draw(1)
    assert torch.equal(first, again)
    assert torch.equal(first[:, [1, 3]], other[:, [1, 3]])
    assert not torch.equal(first[:, [0, 2]], other[:, [0, 2]])


def test_installed_sampler_returns_vllms_log_probs_and_respects_top_k() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    try:
        assert cpu_kernels.install()
        assert cpu_kernels.install()  # idempotent
        sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
        logits = torch.randn(64, 500)
        top3 = logits.topk(3, -1).indices
        tokens, logprobs = sampler(logits.clone(), {}, torch.full((64,), 3), None)
        assert (tokens[:, None] == top3).any(-1).all()  # never outside the top 3
        filtered = torch.full_like(logits, -math.inf).scatter(-1, top3, logits.gather(-1, top3))
        torch.testing.assert_close(logprobs, torch.log_softmax(filtered, -1))

        cpu_kernels.install(enabled=False)  # vLLM's own again for the next engine built
        assert not getattr(TopKTopPSampler.forward_cpu, "_grpo_inverse_cdf", False)
        assert TopKTopPSampler(logprobs_mode="processed_logprobs").forward.__func__ is TopKTopPSampler.forward_cpu
    finally:
        cpu_kernels.install(enabled=False)


def test_the_rank_count_is_eager_and_counts_what_vllms_does() -> None:
    """vLLM's sampler ranks a token's log-prob among its row's with a
    compiled count (2.8 s of compilation at an engine's first request);
    grpo's counts the same entries eagerly."""
    from vllm.v1.sample import sampler

    try:
        assert cpu_kernels.install()
        assert sampler.batched_count_greater_than is cpu_kernel_impls.count_at_least
        logprobs = torch.log_softmax(torch.randn(6, 300), -1)
        tokens = torch.randint(0, 300, (6, 1))
        ranks = sampler.batched_count_greater_than(logprobs, logprobs.gather(-1, tokens))
        expected = [
            int((row > row[t]).sum()) + 1 for row, t in zip(logprobs, tokens[:, 0], strict=True)
        ]  # 1 = the most likely
        assert ranks.tolist() == expected
        cpu_kernels.install(enabled=False)
        assert sampler.batched_count_greater_than is not cpu_kernel_impls.count_at_least
    finally:
        cpu_kernels.install(enabled=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_rms_norm_provider_computes_vllms_native_forms(dtype: torch.dtype) -> None:
    from vllm import ir

    assert cpu_kernels.install()
    cpu_kernels.install(enabled=False)
    norm, fused = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    assert norm.impls[cpu_kernels.PROVIDER].supported and fused.impls[cpu_kernels.PROVIDER].supported
    torch.manual_seed(2)
    x, residual, weight = (
        torch.randn(32, 576, dtype=dtype),
        torch.randn(32, 576, dtype=dtype),
        torch.randn(576, dtype=dtype),
    )
    takes = norm.impls[cpu_kernels.PROVIDER].supports_args
    takes_fused = fused.impls[cpu_kernels.PROVIDER].supports_args
    out, summed = fused.impls[cpu_kernels.PROVIDER].impl_fn(x.clone(), residual.clone(), weight, 1e-5)
    native_out, native_summed = fused.impls["native"].impl_fn(x, residual, weight, 1e-5)
    if dtype not in cpu_kernel_impls.cpp_norm_dtypes(machine.cpu_flags()):
        # this CPU lacks AVX512-BF16: vLLM's kernels truncate to bf16, so the provider
        # leaves bf16 to the native forms (the priority's next provider)
        assert not takes(x, weight, 1e-5) and not takes_fused(x, residual, weight, 1e-5)
        wide = x.float() + residual.float()
        assert torch.equal(summed, (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype))  # why
        assert not torch.equal(summed, native_summed)
        return
    # float32: the same arithmetic to rounding; bf16: the C++ kernel rounds once where the native form rounds twice
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.07, "rtol": 0.016}
    ours = norm.impls[cpu_kernels.PROVIDER].impl_fn(x, weight, 1e-5)
    torch.testing.assert_close(ours, norm.impls["native"].impl_fn(x, weight, 1e-5), **tolerance)
    torch.testing.assert_close(out, native_out, **tolerance)
    assert torch.equal(summed, native_summed)  # the residual sum: one rounding on both sides
    # what the kernels do not take falls through to the next provider in the priority (native)
    assert takes(x, weight, 1e-5) and takes_fused(x, residual, weight, 1e-5) and not takes(x, weight, 1e-5, 288)
    assert not takes(x.t().contiguous().t(), weight, 1e-5) and not takes(
        x, weight.float() if dtype != torch.float32 else weight.double(), 1e-5
    )


@pytest.mark.parametrize(
    ("flags", "bf16"),
    [
        ("fpu avx2 fma", False),
        ("avx2 avx512f avx512bw", False),
        ("avx2 avx512f avx512_bf16", True),
        ("avx512f avx512_bf16 amx_bf16 amx_tile", True),
    ],
)
def test_the_cpp_norms_take_bf16_only_where_the_cpu_rounds_it_to_nearest(flags: str, bf16: bool) -> None:
    dtypes = cpu_kernel_impls.cpp_norm_dtypes(flags)
    assert torch.float32 in dtypes and (torch.bfloat16 in dtypes) is bf16


def test_grpo_asks_for_the_kernels_only_for_its_eager_cpu_engines(
    smollm2_dir, tmp_path, config_for, monkeypatch
) -> None:
    cfg = config_for(smollm2_dir, tmp_path)
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    spec = server_spec(cfg)
    assert spec.env[cpu_kernels.CPU_KERNELS_ENV] == "1"
    assert json.loads(spec.argv[spec.argv.index("--ir-op-priority") + 1]) == cpu_kernels.IR_OP_PRIORITY
    cfg.vllm.enforce_eager = False  # compiled: Inductor fuses vLLM's native RMSNorm itself; the sampler stays
    assert ir_op_priority(cfg) is None and "--ir-op-priority" not in server_spec(cfg).argv
    assert server_spec(cfg).env[cpu_kernels.CPU_KERNELS_ENV] == "1"
    cfg.vllm.enforce_eager, cfg.vllm.cpu_kernels = None, False
    assert cpu_kernels.CPU_KERNELS_ENV not in server_spec(cfg).env and "--ir-op-priority" not in server_spec(cfg).argv
    cfg.vllm.cpu_kernels = True
    monkeypatch.setattr(machine, "cuda_available", lambda: True)  # faked: no GPU here
    assert cpu_kernels.CPU_KERNELS_ENV not in server_spec(cfg).env and "--ir-op-priority" not in server_spec(cfg).argv


def test_the_plugin_installs_nothing_unless_grpo_asked(monkeypatch) -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    try:
        monkeypatch.delenv(cpu_kernels.CPU_KERNELS_ENV, raising=False)
        cpu_kernels.register()
        assert not getattr(TopKTopPSampler.forward_cpu, "_grpo_inverse_cdf", False)
        monkeypatch.setenv(cpu_kernels.CPU_KERNELS_ENV, "1")
        cpu_kernels.register()
        assert TopKTopPSampler.forward_cpu._grpo_inverse_cdf
    finally:
        cpu_kernels.install(enabled=False)

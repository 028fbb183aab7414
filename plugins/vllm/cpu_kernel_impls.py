"""The kernels of :mod:`grpo_plugins.vllm.cpu_kernels` (see there for why):
vLLM's C++ RMSNorm registered as an IR op provider for the CPU, an
inverse-CDF sampler in place of ``TopKTopPSampler.forward_cpu``, and an
eager count for the log-probs' ranks. Imported only inside a vLLM engine's
process; free of grpo_core."""

from __future__ import annotations

import inspect

import torch

from grpo_plugins.vllm import machine

_SAMPLER_ARGS = ["self", "logits", "generators", "k", "p"]
"""``forward_cpu``'s parameters in the vLLM this replaces; another signature keeps vLLM's."""


# ---------------------------------------------------------------- RMSNorm


def cpp_norm_dtypes(flags: str) -> tuple[torch.dtype, ...]:
    """The dtypes vLLM's C++ RMSNorm kernels compute as the native forms do on
    a CPU with cpuinfo ``flags``: float32 always; bfloat16 only with
    AVX512-BF16, whose conversion rounds to nearest. Without it vLLM's kernels
    narrow float32 to bf16 by dropping the low 16 bits (round toward zero),
    so the residual sum they write would be one bf16 step smaller in
    magnitude than PyTorch's in about a quarter of its elements, and each
    layer's error would add up along the residual stream."""
    return (torch.float32, torch.bfloat16) if "avx512_bf16" in flags.split() else (torch.float32,)


def register_norms(provider: str) -> bool:
    """Register vLLM's C++ kernels as IR op ``provider`` for ``rms_norm`` and
    ``fused_add_rms_norm`` (idempotent); False where this vLLM has no such IR ops."""
    try:
        # vLLM is optional and slow to import: only inside an engine's process
        from vllm import ir
        from vllm.platforms import current_platform
    except ImportError:
        return False
    ops = getattr(ir, "ops", None)
    norm, fused = getattr(ops, "rms_norm", None), getattr(ops, "fused_add_rms_norm", None)
    if norm is None or fused is None:
        return False
    if provider in norm.impls and provider in fused.impls:
        return True
    supported = (
        current_platform.is_cpu() and hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")
    )
    dtypes = cpp_norm_dtypes(machine.cpu_flags())

    def takes(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
        return (
            variance_size is None
            and weight is not None
            and weight.dtype == x.dtype
            and x.dtype in dtypes
            and x.is_contiguous()
        )

    def takes_fused(
        x: torch.Tensor,
        x_residual: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> bool:
        return takes(x, weight, epsilon, variance_size) and x_residual.dtype == x.dtype and x_residual.is_contiguous()

    if provider not in norm.impls:

        @norm.register_impl(provider, supported=supported, supports_args=takes)
        def rms_norm(
            x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
        ) -> torch.Tensor:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, epsilon)
            return out

    if provider not in fused.impls:

        @fused.register_impl(provider, supported=supported, supports_args=takes_fused, inplace=True)
        def fused_add_rms_norm(
            x: torch.Tensor,
            x_residual: torch.Tensor,
            weight: torch.Tensor | None,
            epsilon: float,
            variance_size: int | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
            return x, x_residual

    return True


# ---------------------------------------------------------------- sampling


def sample_inverse_cdf(logprobs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``logprobs`` ``[rows, vocabulary]`` (float32,
    ``-inf`` where top-k/top-p removed a token), drawn from ``exp(logprobs)``:
    one uniform number per row, from the row's generator where
    ``generators`` has one (a request with its own seed), else from torch's
    global generator, located in the row's cumulative sum (float64)."""
    rows = logprobs.shape[0]
    cumulative = logprobs.exp().to(torch.float64).cumsum_(-1)
    total = cumulative[:, -1:]
    uniform = (
        torch.rand(rows, 1, dtype=torch.float64)
        if len(generators) != rows
        else torch.empty(rows, 1, dtype=torch.float64)
    )
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator, dtype=torch.float64)
    # strictly below the total, so the last token with any probability is the furthest one reachable
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    # the first token whose cumulative sum exceeds the target: zero-probability tokens have no interval
    return torch.searchsorted(cumulative, target, right=True).squeeze(-1)


def install_sampler(module: object) -> bool:
    """Put :func:`sample_inverse_cdf` behind ``TopKTopPSampler.forward_cpu`` of
    ``module`` (vLLM's sampler module) for the samplers built from now on."""
    sampler = getattr(module, "TopKTopPSampler", None)
    apply_top_k_top_p = getattr(module, "apply_top_k_top_p", None)
    original = getattr(sampler, "forward_cpu", None)
    if getattr(original, "_grpo_inverse_cdf", False):
        return True
    if original is None or apply_top_k_top_p is None or list(inspect.signature(original).parameters) != _SAMPLER_ARGS:
        return False

    def forward_cpu(self, logits, generators, k, p):  # type: ignore[no-untyped-def]
        """grpo's CPU sampler (:func:`sample_inverse_cdf`); vLLM's where it asks for float64 Gumbel noise."""
        if getattr(self, "use_fp64_gumbel", False):
            return original(self, logits, generators, k, p)
        logits = apply_top_k_top_p(logits, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        mode = getattr(self, "logprobs_mode", None)
        returned = logits if mode == "processed_logits" else logprobs if mode == "processed_logprobs" else None
        return sample_inverse_cdf(logprobs, generators), returned

    forward_cpu._grpo_inverse_cdf = True  # type: ignore[attr-defined]
    forward_cpu._vllm_forward_cpu = original  # type: ignore[attr-defined]
    sampler.forward_cpu = forward_cpu
    return True


def restore_sampler(module: object) -> None:
    """vLLM's own ``forward_cpu`` again, for the samplers built from now on."""
    sampler = getattr(module, "TopKTopPSampler", None)
    original = getattr(getattr(sampler, "forward_cpu", None), "_vllm_forward_cpu", None)
    if original is not None:
        sampler.forward_cpu = original


# ---------------------------------------------------------------- log-prob ranks


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, the entries at least that row's ``values`` (the rank
    of a sampled or prompt token's log-prob): what vLLM's
    ``batched_count_greater_than`` computes, without its ``torch.compile``
    (2.8 s of Inductor compilation at an engine's first request with
    log-probs, for one comparison and a sum)."""
    return (x >= values).sum(-1)


def install_rank_count(module: object) -> bool:
    """Put :func:`count_at_least` in place of ``batched_count_greater_than`` in
    ``module`` (vLLM's ``sampler`` module, which imported it by name)."""
    current = getattr(module, "batched_count_greater_than", None)
    if current is None:
        return False
    if current is not count_at_least:
        module._vllm_batched_count_greater_than = current  # type: ignore[attr-defined]
        module.batched_count_greater_than = count_at_least  # type: ignore[attr-defined]
    return True


def restore_rank_count(module: object) -> None:
    """vLLM's compiled count again."""
    original = getattr(module, "_vllm_batched_count_greater_than", None)
    if original is not None:
        module.batched_count_greater_than = original  # type: ignore[attr-defined]

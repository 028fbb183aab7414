"""Faster kernels for vLLM's eager CPU engine, as a vLLM general plugin
(``vllm.general_plugins`` entry point) that grpo turns on for the engines it
starts on a CPU.

Three costs that profiles of the colocated bf16 engine show (32 sequences of SmolLM2-135M, 115 ms a step; benchmarks/
RESULTS.md, "vLLM's sampler and RMSNorm on a CPU"), two in every decode
step and one at the start:

- **Sampling, 15 ms a step.** vLLM's CPU sampler draws one Gumbel variate
  per vocabulary entry (``fused_gumbel_argmax``: 1.6 M random numbers and
  two logarithms each for 32 x 49k). :func:`~grpo_plugins.vllm.cpu_kernel_impls.sample_inverse_cdf` draws one
  uniform number per sequence instead and finds it in the cumulative
  distribution (float64, so a token's interval is its probability to 1e-16):
  the same distribution, ~2 ms on top of the log-softmax the sampler
  already computes for the log-probs grpo asks for.
- **RMSNorm, ~6 ms a step.** On a CPU vLLM dispatches its ``rms_norm`` and
  ``fused_add_rms_norm`` IR ops to their PyTorch ``native`` forms (eight
  element-wise passes each, 61 calls a step) because its C++ kernels are
  registered for GPUs only, although its CPU build ships them
  (``torch.ops._C.rms_norm``). :data:`PROVIDER` registers those kernels for
  the CPU through vLLM's IR op API, and the engine's ``ir_op_priority``
  (:data:`IR_OP_PRIORITY`, which grpo passes to the engines it starts eager)
  picks them (float32 always, bf16 only on a CPU with AVX512-BF16, where
  their conversion rounds to nearest: ``cpp_norm_dtypes``). With graph
  compilation Inductor fuses the native forms itself, so compiled engines
  keep vLLM's priority.

- **Log-prob ranks, 2.8 s once.** vLLM counts a token's rank among the
  log-probs with a ``torch.compile``d comparison, compiled by Inductor at
  the engine's first request with log-probs (the first weight-sync check
  or generation of a run); an eager count takes a millisecond.

vLLM loads every general plugin in each of its processes; this one does
nothing unless :data:`CPU_KERNELS_ENV` is ``"1"``, which grpo sets only for
the CPU engines it starts (``[vllm] cpu_kernels``, default on), so another
vLLM in the same environment keeps vLLM's behaviour. The sampler and the
rank count are patches of vLLM's ``TopKTopPSampler.forward_cpu`` and of
the name ``batched_count_greater_than`` in its sampler module: where those
are not what this module expects (another vLLM version), vLLM's are kept.
This module must stay free of grpo_core: it runs inside vLLM's processes.
It imports no torch, so that a server's command line can read its
constants; the kernels are in :mod:`grpo_plugins.vllm.cpu_kernel_impls`.
"""

from __future__ import annotations

import os
import sys

CPU_KERNELS_ENV = "GRPO_VLLM_CPU_KERNELS"
"""``"1"``: install this module's kernels in the vLLM process."""

PROVIDER = "grpo_cpu"
"""The IR op provider name of vLLM's C++ RMSNorm kernels on a CPU."""

IR_OP_PRIORITY = {"rms_norm": [PROVIDER, "native"], "fused_add_rms_norm": [PROVIDER, "native"]}
"""vLLM's ``ir_op_priority`` for an eager CPU engine with these kernels."""

INSTALLED = "grpo: CPU sampler, RMSNorm and rank kernels installed"
"""What a vLLM process with these kernels prints (to its log)."""


def register() -> None:
    """vLLM's entry point: install the kernels if :data:`CPU_KERNELS_ENV` asks for them."""
    if os.environ.get(CPU_KERNELS_ENV) != "1":
        return
    if install():
        print(f"{INSTALLED} (process {os.getpid()})", file=sys.stderr, flush=True)
    else:
        print(
            "grpo: this vLLM lacks the sampler or IR ops [vllm] cpu_kernels replaces; its own run",
            file=sys.stderr,
            flush=True,
        )


def install(enabled: bool = True) -> bool:
    """Register the RMSNorm provider and put grpo's sampler and rank count in
    place of vLLM's in this process (idempotent), or, ``enabled=False``, put
    vLLM's back (a colocated engine started in a process where an earlier
    one had them). False where this vLLM lacks something they replace."""
    try:
        # vLLM is optional and slow to import: only inside an engine's process
        import vllm._custom_ops  # noqa: F401  registers torch.ops._C
        from vllm.v1.sample import sampler
        from vllm.v1.sample.ops import topk_topp_sampler

        from grpo_plugins.vllm import cpu_kernel_impls as impls
    except ImportError:
        return False
    if not enabled:
        impls.restore_sampler(topk_topp_sampler)
        impls.restore_rank_count(sampler)
        return True
    installed = [
        impls.register_norms(PROVIDER),
        impls.install_sampler(topk_topp_sampler),
        impls.install_rank_count(sampler),
    ]
    return all(installed)

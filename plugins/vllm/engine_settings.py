"""The engine settings grpo decides from the config and the machine, shared
by a vLLM server's command line and the colocated engine: dtype, context
length, eager mode, KV cache size and block size, whole-prompt prefill and
kernels on CPU."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_plugins.vllm import machine
from grpo_plugins.vllm.cpu_kernels import IR_OP_PRIORITY
from grpo_plugins.vllm.settings import vllm_settings

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig


def resolve_dtype(dtype: str, flags: str | None = None, cuda: bool | None = None) -> str:
    """The dtype vLLM is started with; explicit dtypes pass through.

    ``auto`` on a GPU is left to vLLM. On a CPU it is decided here, never
    left to vLLM (whose CPU backend picks bf16 for a fp32 checkpoint where
    bf16 is native, so the same config would compute differently on two
    machines without saying so):

    - AVX2 only, or AVX512 without AVX512-BF16/AMX: ``float32`` (no native
      bf16 arithmetic: measured 21 vs 114 tokens/s on an AVX2 core);
    - AVX512-BF16 or AMX: ``bfloat16`` (native; the arithmetic example's
      4x8x48-token batch in ~2 s, /work/shared/ENVIRONMENT.md). The trainer
      keeps its own precision (``bf16``); the gap between the two is what
      the importance-sampling correction is for. Set ``[vllm] dtype =
      "float32"`` to sample at the trainer's float32 precision.

    ``flags`` / ``cuda`` stand for this machine's when unset (tests fake them)."""
    if dtype != "auto":
        return dtype
    if machine.cuda_available() if cuda is None else cuda:
        return dtype
    return "bfloat16" if machine.cpu_has_fast_bf16(flags) else "float32"


def known_dtype(cfg: GRPOConfig) -> str | None:
    """The dtype an engine grpo starts from ``cfg`` keeps its weights in, where
    :func:`resolve_dtype` decides it; ``None`` where ``auto`` is left to vLLM (a GPU)."""
    dtype = resolve_dtype(vllm_settings(cfg).dtype)
    return None if dtype == "auto" else dtype


def max_model_len(cfg: GRPOConfig) -> int:
    """The engine's context length: ``[vllm] max_model_len``, else room for
    the longest prompt plus completion the config allows."""
    trl = cfg.trl
    return vllm_settings(cfg).max_model_len or max(
        cfg.sequence_len, (trl.max_prompt_length or 0) + (trl.max_completion_length or 0)
    )


def enforce_eager(cfg: GRPOConfig) -> bool:
    """``[vllm] enforce_eager``; unset, true on CPU: vLLM's graph compilation
    there costs 89 s of engine start to generate 7% faster (4.7 s vs 94 s,
    223 vs 239 tokens/s; benchmarks/RESULTS.md), a loss for any run under
    ~170 steps of the arithmetic example. On a GPU vLLM's default (CUDA
    graphs) stands."""
    if vllm_settings(cfg).enforce_eager is not None:
        return vllm_settings(cfg).enforce_eager
    return not machine.cuda_available()


def cpu_kernels(cfg: GRPOConfig) -> bool:
    """``[vllm] cpu_kernels`` on a CPU: grpo's sampler, vLLM's C++ RMSNorm and
    an eager rank count in the engines grpo starts (:mod:`grpo_plugins.vllm.cpu_kernels`)."""
    return vllm_settings(cfg).cpu_kernels and not machine.cuda_available()


def ir_op_priority(cfg: GRPOConfig) -> dict[str, list[str]] | None:
    """vLLM's ``ir_op_priority`` for an engine grpo starts: the C++ RMSNorm
    where :func:`cpu_kernels` and the engine runs eager (compiled, Inductor
    fuses vLLM's native form itself); ``None``: vLLM's own."""
    if not (cpu_kernels(cfg) and enforce_eager(cfg)) or not _vllm_has_ir_ops():
        return None
    return IR_OP_PRIORITY


def _vllm_has_ir_ops() -> bool:
    """Whether the installed vLLM dispatches ops by ``ir_op_priority`` (read from
    its files: importing vLLM takes seconds, and a server runs it elsewhere)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None and (Path(spec.origin).parent / "ir" / "ops").is_dir()


CPU_BLOCK_SIZE = 32


def block_size(cfg: GRPOConfig) -> int | None:
    """``[vllm] block_size``; unset, 32 on CPU and vLLM's own on a GPU.

    Prefix caching shares a prompt's KV only in whole blocks, so the
    samples of a group share their prompt's prefill up to its last full
    block. vLLM's CPU default of 128 tokens shares nothing of the
    arithmetic example's 35-token prompts: each of a prompt's 8 samples
    prefilled it again. 32 (the smallest block vLLM's CPU attention takes)
    made the 4 x 8 prefill 4.5x faster and a 48-token generation 25% faster
    (benchmarks/RESULTS.md, "Sharing a group's prompt in vLLM")."""
    if vllm_settings(cfg).block_size is not None:
        return vllm_settings(cfg).block_size
    return None if machine.cuda_available() else CPU_BLOCK_SIZE


DEFAULT_CPU_KVCACHE_GIB = 2


def cpu_kvcache_gib(cfg: GRPOConfig) -> int | None:
    """GiB of KV cache for vLLM on CPU (``VLLM_CPU_KVCACHE_SPACE``), or
    ``None`` to leave it to vLLM (on a GPU, or when the environment sets it).

    Unset, vLLM's CPU backend sizes its cache to ``gpu_memory_utilization``
    of *host* memory (85%), which leaves nothing for a trainer on the same
    machine; grpo asks for a fixed 2 GiB instead unless told otherwise."""
    if vllm_settings(cfg).cpu_kvcache_space is not None:
        return vllm_settings(cfg).cpu_kvcache_space
    if machine.cuda_available() or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return None
    return DEFAULT_CPU_KVCACHE_GIB


def cpu_whole_prefill_args(max_len: int) -> list[str]:
    """vLLM 0.32's CPU backend kills its engine ("CPU Generator does not use
    offset") when a request with a ``seed`` is only partly prefilled in a
    step: chunked prefill rewinds the request's generator, which CPU
    generators cannot do. Many long prompts at once (multi-turn episodes)
    make that happen. Prefilling whole prompts avoids it; the step budget
    must then hold the longest prompt."""
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 2048))]

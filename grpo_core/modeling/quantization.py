"""``load_in_4bit`` / ``load_in_8bit``: a bitsandbytes-quantised frozen base for LoRA (QLoRA).

bitsandbytes runs on CUDA GPUs and, through its CPU backend, on x86-64 CPUs
(measured here: bitsandbytes 0.50.2 loads SmolLM2 in NF4 and in 8 bits and
trains LoRA on it, on an AVX512 CPU without avx512_bf16). Whether it works is
asked of the library itself with one tiny quantisation, so a machine where it
does not is refused before the model loads, with the hardware it needs.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import lru_cache
from typing import Any

HARDWARE = "a CUDA GPU, or an x86-64 CPU that bitsandbytes' CPU backend supports (bitsandbytes >= 0.48)"


KERNEL_NOTICE_LOGGER = "bitsandbytes.backends.cpu.ops"
KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
"""What bitsandbytes logs when it is imported on a CPU with AVX512-BF16 and
the optional ``kernels`` package is absent. peft imports bitsandbytes
whenever it is installed, so every CPU run printed it, 4-bit model or not;
it only matters to ``load_in_4bit`` on a CPU, where :func:`cpu_kernel_note`
says it once, in grpo's words."""


class _KernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(KERNEL_NOTICE)


def quiet_kernel_notice() -> None:
    """Drop :data:`KERNEL_NOTICE` (only that record of bitsandbytes' logger); safe to call again."""
    logger = logging.getLogger(KERNEL_NOTICE_LOGGER)
    if not any(isinstance(f, _KernelNotice) for f in logger.filters):
        logger.addFilter(_KernelNotice())


def cpu_kernel_note(load_in_4bit: bool, cuda: bool, flags: set[str]) -> str | None:
    """The warning :data:`KERNEL_NOTICE` stood for, where it applies: 4-bit
    on a CPU with AVX512-BF16 and no ``kernels`` package."""
    if not load_in_4bit or cuda or "avx512_bf16" not in flags or importlib.util.find_spec("kernels") is not None:
        return None
    return (
        "load_in_4bit on this CPU: bitsandbytes' faster 4-bit matmul for AVX512-BF16 comes from the `kernels` package "
        "(pip install kernels); without it bitsandbytes uses its built-in CPU kernel."
    )


@lru_cache(maxsize=1)
def bitsandbytes_problem() -> str | None:
    """None when bitsandbytes can quantise on this machine, else why not."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return (
            f"bitsandbytes is not installed: `pip install bitsandbytes` (or grpo's `qlora` extra); it needs {HARDWARE}."
        )
    try:
        # bitsandbytes is optional: imported only where used, so grpo runs without it
        import bitsandbytes.functional as bnbf
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        packed, state = bnbf.quantize_4bit(torch.randn(64, 64, device=device), quant_type="nf4")
        bnbf.dequantize_4bit(packed, state)
    except Exception as exc:  # any failure means "not on this hardware"
        return f"bitsandbytes could not quantise on this machine ({type(exc).__name__}: {exc}); it needs {HARDWARE}."
    return None


def quantization_config(
    compute_dtype: Any, *, load_in_4bit: bool, load_in_8bit: bool, bnb_config_kwargs: dict[str, Any] | None
) -> Any | None:
    """transformers' BitsAndBytesConfig for the config's k-bit keys, or None (no k-bit loading)."""
    if not (load_in_4bit or load_in_8bit):
        return None
    # heavy (transformers): loaded on first use, not with this module
    from transformers import BitsAndBytesConfig

    kwargs: dict[str, Any] = (
        {"load_in_8bit": True}
        if load_in_8bit
        else {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_compute_dtype": compute_dtype,
        }
    )
    kwargs.update(bnb_config_kwargs or {})
    return BitsAndBytesConfig(**kwargs)

"""Mixed precision, chosen by the hardware.

``bf16 = true`` means bf16 *compute* (``torch.autocast``) with trainable
weights and optimizer state kept in float32, for LoRA and full fine-tuning
alike: a LoRA's frozen base is loaded in bf16 (it never changes, and half
the memory), its adapters stay float32 (peft's default); a full fine-tune
keeps float32 master weights. ``bf16 = "auto"`` turns it on only where the
hardware computes bf16 natively: a CUDA device that supports it, or an x86
CPU with AVX512-BF16 or AMX. On a CPU that only emulates bf16 (AVX2, or
AVX512 without BF16) it is slower than float32, so ``auto`` stays float32.
``fp16 = true`` is the same with float16 (no loss scaling is applied).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.modeling.adapter_casts import adapter_inputs_uncast

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """This machine's x86 feature flags (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The x86 flags that decide how fast this CPU trains (recorded with every benchmark number)."""


def cpu_flag_summary(flags: set[str] | None = None) -> str:
    """Which of :data:`SPEED_FLAGS` this CPU has, e.g. ``"avx2 avx512f"``."""
    found = cpu_flags() if flags is None else flags
    return " ".join(f for f in SPEED_FLAGS if f in found) or "none of avx2/avx512/amx"


def native_bf16(device_type: str, flags: set[str] | None = None) -> bool:
    """Whether ``device_type`` computes bf16 natively (``flags``: the CPU's,
    read from the machine when not given)."""
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return any(flag in (cpu_flags() if flags is None else flags) for flag in NATIVE_BF16_CPU_FLAGS)


@dataclass(frozen=True)
class Precision:
    """How the policy is loaded and run."""

    load_dtype: torch.dtype
    """Dtype the weights are loaded in (float32 for anything trained in full)."""
    compute_dtype: torch.dtype | None
    """Autocast dtype of forward passes; ``None``: float32 throughout."""
    reason: str

    def autocast(self, device_type: str, model: torch.nn.Module | None = None) -> Any:
        """The context to run forward passes of ``model`` in: autocast to the
        compute dtype, with the LoRA layers' redundant input casts off
        (:mod:`grpo_core.modeling.adapter_casts`)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return _compute_region(device_type, self.compute_dtype, model)


@contextlib.contextmanager
def _compute_region(device_type: str, dtype: torch.dtype, model: torch.nn.Module | None) -> Iterator[None]:
    with torch.autocast(device_type=device_type, dtype=dtype), adapter_inputs_uncast(model):
        yield


def resolve_precision(cfg: GRPOConfig, device_type: str | None = None, flags: set[str] | None = None) -> Precision:
    """The precision ``cfg`` asks for on this hardware (``device_type`` and
    ``flags`` default to this machine's; tests pass others)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    lora = cfg.adapter == "lora"
    if cfg.bf16 == "auto":
        if not native_bf16(device_type, flags):
            return Precision(torch.float32, None, f"bf16 = 'auto': float32, {device_type} has no native bf16")
        use_bf16, why = True, f"bf16 = 'auto': bf16 compute, {device_type} computes bf16 natively"
    else:
        use_bf16, why = bool(cfg.bf16), "bf16 = true: bf16 compute"
    if use_bf16:
        base = "frozen base in bf16, adapters in float32" if lora else "float32 master weights and optimizer state"
        return Precision(torch.bfloat16 if lora else torch.float32, torch.bfloat16, f"{why}, {base}")
    if cfg.fp16:
        base = "frozen base in float16, adapters in float32" if lora else "float32 master weights and optimizer state"
        return Precision(
            torch.float16 if lora else torch.float32, torch.float16, f"fp16 = true: float16 compute, {base}"
        )
    return Precision(torch.float32, None, "float32")

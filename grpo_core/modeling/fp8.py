"""``fp8``: FP8 matmuls for training, through accelerate's torchao backend.

accelerate (``mixed_precision = "fp8"`` with ``AORecipeKwargs``) swaps the
model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear``
(dims divisible by 16; the first and last linear layers stay in high
precision, accelerate's default filter), whose matmuls run in FP8 with
dynamic scaling while the weights and optimizer state keep their dtype.
State-dict keys do not change, so checkpoints and weight syncs are those
of a run without fp8.

FP8 matmuls (``torch._scaled_mm``) need an NVIDIA GPU of compute capability
8.9 or newer (Ada: L4, L40S, RTX 4090; Hopper: H100, H200; Blackwell) and
the ``torchao`` package. Anywhere else ``fp8 = true`` is refused by
``grpo config check`` with what is missing. Not yet run on such a GPU:
``benchmarks/gpu_check.sh`` is the prepared check.
"""

from __future__ import annotations

import importlib.util
from typing import Any

MIN_CAPABILITY = (8, 9)
GPUS = "an NVIDIA GPU of compute capability >= 8.9 (Ada: L4, L40S, RTX 4090; Hopper: H100, H200; Blackwell)"


def _cuda_capability() -> tuple[int, int] | None:
    # heavy (torch): loaded on first use, not with this module
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def _torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def fp8_problem(capability: tuple[int, int] | None | str = "detect", torchao: bool | None = None) -> str | None:
    """Why ``fp8 = true`` cannot run here, or ``None``. ``capability``
    (``None``: no CUDA) and ``torchao`` default to this machine's; tests
    pass others."""
    cap = _cuda_capability() if capability == "detect" else capability
    if cap is None:
        return (
            f"fp8 = true needs {GPUS}; this machine has no CUDA device. Set fp8 = false "
            "(bf16 = true is the fastest here)."
        )
    if tuple(cap) < MIN_CAPABILITY:
        return (
            f"fp8 = true needs {GPUS}; this GPU has compute capability {cap[0]}.{cap[1]}, which has no FP8 matmul. "
            "Set fp8 = false and use bf16 = true."
        )
    if not (_torchao_available() if torchao is None else torchao):
        return "fp8 = true runs through torchao, which is not installed: pip install torchao (or set fp8 = false)."
    return None


def accelerator_kwargs(fp8: bool) -> dict[str, Any]:
    """Arguments of ``accelerate.Accelerator`` for the ``fp8`` choice."""
    if not fp8:
        return {}
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate.utils import AORecipeKwargs

    return {"mixed_precision": "fp8", "kwargs_handlers": [AORecipeKwargs()]}

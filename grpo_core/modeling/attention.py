"""Attention in float32 inside a bf16 pass, for CPUs.

Why: under bf16 autocast on a CPU, transformers' ``sdpa`` runs PyTorch's CPU
flash attention in bf16, whose backward is ~7x slower than in float32 on a
CPU with AMX (benchmarks/RESULTS.md, "Rates against this CPU's ceilings"), so
the matmuls bf16 speeds up are paid back in attention. ``sdpa_float32`` runs
the same kernel on float32 copies of q, k and v with autocast off and hands
back the input dtype: the projections and the MLP stay in bf16, attention is
computed as in a float32 run (more exact than bf16 attention, not less).
"""

from __future__ import annotations

from typing import Any

import torch

SDPA_FLOAT32 = "sdpa_float32"
"""The ``attn_implementation`` name grpo registers with transformers."""


def sdpa_float32_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' sdpa attention on float32 q/k/v, output in ``query``'s dtype."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    with torch.autocast(device_type=query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


def register_sdpa_float32() -> str:
    """Make ``attn_implementation = "sdpa_float32"`` known to transformers
    (idempotent); returns the name. Masks are built as for ``sdpa``."""
    # heavy (transformers): loaded on first use, not with this module
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_FLOAT32, sdpa_float32_forward)
    AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)
    return SDPA_FLOAT32

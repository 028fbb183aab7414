"""LoRA inputs left in the compute dtype under autocast.

Why: peft's LoRA linear layer casts its input to the adapter weights' dtype
before ``lora_A`` (bf16 activations to float32, since grpo keeps the
adapters in float32), and autocast then casts that float32 input straight
back to bf16 for the product. Under autocast the round trip is exact and
pure cost: two copies of every adapted layer's input in forward, two of its
gradient in backward (0.2-0.4 s of a 4.2-4.8 s bf16 forward+backward of the
arithmetic micro-batch on an AMX CPU, benchmarks/RESULTS.md). peft exposes
the switch (``cast_input_dtype_enabled``, what ``peft.helpers.
disable_input_dtype_casting`` sets); :func:`adapter_inputs_uncast` turns it off
for the duration of an autocast region only, since outside autocast a bf16
input would meet float32 adapter weights.

Only plain LoRA linear layers are touched: a LoRA variant (DoRA, ...) may
compute with its input outside the autocast-listed ops, where the cast
matters. The switch is counted per model, so nested regions and the
trainer's and a rollout thread's regions overlapping leave it as found.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCK = threading.Lock()
_STATE_ATTR = "_grpo_uncast_state"
"""On the model while a region is open: [depth, each layer's setting before the outermost]."""


def _plain_lora_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    # heavy (peft): loaded on first use, not with grpo_core.modeling.precision
    from peft.tuners.lora.layer import Linear as LoraLinear

    return [m for m in model.modules() if type(m) is LoraLinear and not getattr(m, "lora_variant", None)]


@contextlib.contextmanager
def adapter_inputs_uncast(model: torch.nn.Module | None) -> Iterator[None]:
    """Within an autocast region: peft's LoRA layers of ``model`` skip the
    cast of their input to the adapters' dtype (exact there: autocast casts
    it to the compute dtype anyway). Restored when the outermost region of
    this model ends."""
    layers = [] if model is None else _plain_lora_linears(model)
    if not layers:
        yield
        return
    with _LOCK:
        state = getattr(model, _STATE_ATTR, None)
        if state is None:
            state = [0, [getattr(layer, "cast_input_dtype_enabled", True) for layer in layers]]
            object.__setattr__(model, _STATE_ATTR, state)
            for layer in layers:
                layer.cast_input_dtype_enabled = False
        state[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            state[0] -= 1
            if state[0] == 0:
                for layer, before in zip(layers, state[1]):
                    layer.cast_input_dtype_enabled = before
                object.__delattr__(model, _STATE_ATTR)

"""The weights an inference engine needs from the trainer's model.

Shared by every weight sync that sends weights (files, HTTP, NCCL, in
memory), whichever engine receives them: part of the contract for sync
implementations (:func:`~grpo_core.contract.hookspecs.grpo_sync_weights`), so a sync
for another engine never imports it from the vLLM plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_core.contract.errors import ConfigError

ADAPTER_CONFIG_KEY = "adapter_config"
"""The safetensors metadata key under which :func:`adapter_body` carries ``adapter_config.json``."""


def is_peft(model: Any) -> bool:
    """``model`` is a PEFT model (an adapter trained over a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# An engine that fuses projections into one weight (vLLM: qkv_proj,
# gate_up_proj) needs every member of a group in a partial update; the
# engine says which groups (InferenceEngine.fused_modules).


def _lora_modules(base: Any) -> dict[str, Any]:
    return {name: m for name, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def _modules_to_send(base: Any, lora: dict[str, Any], packed_groups: tuple[tuple[str, ...], ...]) -> set[str] | None:
    """Names of the modules whose weights training changes (LoRA-wrapped
    ones, plus their fused siblings); ``None`` when other weights train too
    (everything is sent then)."""
    if any(p.requires_grad and "lora_" not in n for n, p in base.named_parameters()):
        return None
    names = set(lora)
    for name in lora:
        parent, _, leaf = name.rpartition(".")
        for group in packed_groups:
            if leaf in group:
                names.update(f"{parent}.{member}" if parent else member for member in group)
    return names


def merged_weights(model: Any, packed_groups: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """The HF-named weights the inference engine needs to sample from
    ``model``: every weight for full fine-tuning; for a LoRA, only the
    adapted modules (and their fused siblings), as ``W + delta``.

    The delta is computed beside the weights, never merged into them, so the
    trainer's frozen base stays bit-exact however many syncs run (a merge
    followed by an unmerge does not round-trip in floating point), and the
    ~25% of the model a LoRA never touches (embeddings, norms) is neither
    copied nor sent. vLLM's in-place reload keeps weights it is not given.
    """
    # heavy (torch): loaded on first use, not with this module
    import torch

    if not is_peft(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    base = model.get_base_model()
    lora = _lora_modules(base)
    send = _modules_to_send(base, lora, packed_groups)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            name = key.replace(".base_layer.", ".")
            module_name, _, param = name.rpartition(".")
            if send is not None and module_name not in send:
                continue
            module = lora.get(module_name)
            if module is not None and param == "weight" and not module.merged:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        value = value + module.get_delta_weight(adapter)
            state[name] = value.detach()
    return state


def in_dtype(weights: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """``weights`` with every floating tensor cast to ``dtype`` (a torch dtype
    name, an engine's ``weight_dtype``; ``None``: as they are). The engine keeps
    that dtype anyway, so a sync sends no more bytes than it stores and the
    engine casts nothing (vLLM warns once per tensor when it narrows one).
    Tied tensors (one storage under two names) are cast once and stay shared."""
    if dtype is None:
        return weights
    # heavy (torch): loaded on first use, not with this module
    import torch

    target = getattr(torch, dtype)
    cast: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for key, value in weights.items():
        if value.data_ptr() not in cast:
            cast[value.data_ptr()] = value.to(target) if value.is_floating_point() else value
        out[key] = cast[value.data_ptr()]
    return out


def save_adapter(model: Any, out: Path, sync: str) -> None:
    """Write ``model``'s active PEFT adapter into ``out`` as an engine loads
    one (``adapter_model.safetensors``, ``adapter_config.json``, directly in
    ``out``); ``sync`` names the weight sync for the error a model without
    an adapter gets."""
    if not is_peft(model):
        raise ConfigError(
            f"weight sync '{sync}' (trl.vllm_lora_sync = true) needs a LoRA adapter: set adapter = 'lora', or use "
            "a full-weight sync (plugins.weight_sync = 'full_filesystem' or 'full_http') for full fine-tuning."
        )
    name = getattr(model, "active_adapter", "default")
    model.save_pretrained(str(out), selected_adapters=[name])
    if name != "default":  # PEFT writes non-default adapters into a subfolder
        for item in (out / name).iterdir():
            item.rename(out / item.name)
        (out / name).rmdir()


def adapter_body(directory: Path) -> bytes:
    """The adapter :func:`save_adapter` wrote in ``directory`` as one
    safetensors body, its config in the metadata (:data:`ADAPTER_CONFIG_KEY`):
    what an engine fetches for :meth:`~grpo_core.contract.types.InferenceEngine.load_adapter_from_url`."""
    # heavy (safetensors): loaded on first use, not with this module
    from safetensors.torch import load_file, save

    config = (directory / "adapter_config.json").read_text(encoding="utf-8")  # as PEFT wrote it
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    return save(tensors, metadata={"format": "pt", ADAPTER_CONFIG_KEY: config})

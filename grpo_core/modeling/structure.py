"""A causal LM's parts, found through a PEFT wrapper: the transformers model
inside it, its decoder body and LM head, and the scale or softcap some
architectures apply to the logits. What the log-prob path, fused losses and
``torch_compile`` need to run the body and the head separately.
"""

from __future__ import annotations

from typing import Any

from grpo_core.contract.errors import GrpoError


def unwrap_peft(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (LoRA layers stay injected
    in it, so running it directly still applies the adapter)."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is None or not hasattr(model, "peft_config"):
        return model
    config = getattr(model, "active_peft_config", None)
    if config is not None and getattr(config, "is_prompt_learning", False):
        raise GrpoError(
            f"token_logprobs: PEFT method '{config.peft_type}' adds virtual tokens, which this log-prob path does "
            "not support; use a LoRA-type adapter (adapter = 'lora')."
        )
    return get_base()


def decoder_and_head(model: Any) -> tuple[Any, Any]:
    """(decoder body, LM head) of a causal LM, through a PEFT wrapper: the
    body runs once per micro-batch and the head only on completion positions,
    here and in losses that fuse the head themselves."""
    lm = unwrap_peft(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    prefix = getattr(lm, "base_model_prefix", "model")
    body = getattr(lm, prefix, None)
    if head is None or body is None or body is lm:
        raise GrpoError(
            f"token_logprobs: {type(lm).__name__} is not a causal LM with a separate decoder body "
            f"(`.{prefix}`) and LM head (`get_output_embeddings()`); load it with AutoModelForCausalLM."
        )
    return body, head


def logit_transform(lm: Any) -> tuple[float, float | None]:
    """(scale, softcap) some architectures apply after the head (Cohere's
    ``logit_scale``, Gemma-2's ``final_logit_softcapping``)."""
    config = getattr(lm, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text_config, "logit_scale", None)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return (1.0 if scale is None else float(scale)), softcap

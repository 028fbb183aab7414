"""What grpo adds to every vLLM worker: methods called through
``/collective_rpc`` on a server (started with ``--worker-extension-cls``, as
``grpo run`` and ``grpo vllm-serve`` do) and through ``LLM.collective_rpc``
in the colocated engine.

Imported inside vLLM's worker processes: keep it free of grpo imports.
"""

from __future__ import annotations

from typing import Any

EXTENSION_CLASS = "grpo_plugins.vllm.worker_extension.GrpoWorkerExtension"
RETIE_METHOD = "grpo_retie_output_embeddings"


def retie_output_embeddings(worker: Any) -> bool:
    """After an in-place weight reload: point a tied LM head at the
    embeddings' current weight and redo its post-load processing.

    vLLM's CPU backend packs a private copy of the LM head for its GEMM when
    the model loads; an in-place reload refreshes the embeddings but never
    the head tied to them (its name is skipped in the checkpoint), so a
    model with tied embeddings (SmolLM2, Llama 3.2, Qwen2.5 small) kept
    sampling with the head it started with after a full fine-tuning sync.
    Returns whether a tied head was found (and refreshed)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    text_config = worker.model_runner.model_config.hf_text_config
    if head is None or embed is None or not getattr(text_config, "tie_word_embeddings", False):
        return False
    head.weight = embed.weight  # a reload may have replaced the embeddings' parameter
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def grpo_retie_output_embeddings(self) -> bool:
        return retie_output_embeddings(self)

"""Runs inside each vLLM worker (``--worker-extension-cls``, which managed
servers and ``grpo vllm-serve`` pass): lets the trainer's weight sync hand
weights over the network, with no filesystem shared between the two
machines, and refreshes a tied LM head after every in-place reload.

``/collective_rpc {"method": "grpo_load_weights_from_url", ...}`` makes
every worker fetch the safetensors bytes the trainer serves
(:mod:`grpo_plugins.weight_sync_http`) and load them in place, exactly as
``reload_weights`` loads files: weights not in the payload keep their
values. Nothing is written to disk on the server's side.

``/collective_rpc {"method": "grpo_fetch_adapter", ...}`` makes the first
worker fetch a LoRA adapter (``lora_http``) into a private folder on the
server's machine, which the server then loads as an adapter: the server
never reads the trainer's disk.

This module is imported by the vLLM server process: it must stay free of
grpo_core and of anything heavy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import urllib.request
from typing import Any

FETCH_TIMEOUT_S = 600.0
RETIE_METHOD = "grpo_retie_output_embeddings"
ADAPTER_CONFIG_KEY = (
    "adapter_config"  # as grpo_core.modeling.engine_weights.ADAPTER_CONFIG_KEY (this module imports no grpo_core)
)


def fetch(url: str, token: str, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """GET ``url`` with the sync's bearer token; no proxy from the
    environment (the trainer is reached directly)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with opener.open(request, timeout=timeout) as response:
        return response.read()


def safetensors_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors body (its header: an 8-byte
    little-endian length, then that many bytes of JSON)."""
    (length,) = struct.unpack("<Q", body[:8])
    return dict(json.loads(body[8 : 8 + length]).get("__metadata__") or {})


def write_adapter(body: bytes, kept: list[str], keep: int) -> str:
    """The adapter ``body`` as the two files vLLM loads, in a fresh private
    folder (memory-backed where the machine has /dev/shm), appended to
    ``kept`` (the folders written before, oldest first); all but the newest
    ``keep`` go. vLLM 0.32 reads an adapter loaded in place from its folder
    again at every engine step of every request that uses it
    (``WorkerLoRAManager.add_adapter``), so a folder must outlive the load
    after it and the requests sampled under it: a folder deleted too early
    kills the engine ("No adapter found")."""
    config = safetensors_metadata(body).get(ADAPTER_CONFIG_KEY)
    if config is None:
        raise ValueError(f"the adapter body has no {ADAPTER_CONFIG_KEY!r} metadata: not sent by grpo's lora_http sync")
    directory = tempfile.mkdtemp(prefix="grpo-adapter-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as handle:
        handle.write(body)
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as handle:
        handle.write(config)
    kept.append(directory)
    while len(kept) > max(keep, 2):  # never fewer than the new one and the one the server serves now
        shutil.rmtree(kept.pop(0), ignore_errors=True)
    return directory


def retie_output_embeddings(worker: Any) -> bool:
    """After an in-place weight reload: point a tied LM head at the
    embeddings' current weight and redo its post-load processing.

    vLLM's CPU backend packs a private copy of the LM head for its GEMM when
    the model loads; an in-place reload refreshes the embeddings but never
    the head tied to them (its name is skipped in the checkpoint), so a
    model with tied embeddings (SmolLM2, Llama 3.2, Qwen2.5 small) kept
    sampling with the head it started with after a full fine-tuning sync.
    Returns whether a tied head was found (and refreshed). The colocated
    engine calls it through ``LLM.collective_rpc`` too."""
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
    """Mixed into vLLM's worker class by vLLM itself."""

    def grpo_retie_output_embeddings(self) -> bool:
        return retie_output_embeddings(self)

    def grpo_load_weights_from_url(self, url: str, token: str) -> int:
        """Fetch and load the weights; returns how many tensors were loaded
        (the trainer checks it)."""
        # heavy (safetensors): loaded on first use, not with this module
        from safetensors.torch import load

        tensors: dict[str, Any] = load(fetch(url, token))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        retie_output_embeddings(self)
        return len(tensors)

    def grpo_fetch_adapter(self, url: str, token: str, keep: int = 2) -> str:
        """Fetch the adapter into a private folder on this machine and return
        its path, keeping the newest ``keep`` folders (:func:`write_adapter`);
        only the first worker does (they share the machine the API server
        loads from), the others return ""."""
        if int(getattr(self, "rank", 0) or 0) != 0:
            return ""
        if not hasattr(self, "_grpo_adapter_dirs"):
            self._grpo_adapter_dirs: list[str] = []
        return write_adapter(fetch(url, token), self._grpo_adapter_dirs, keep)

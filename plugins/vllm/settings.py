"""The ``[vllm]`` table: the vLLM plugin's own settings.

The plugin claims the top-level table ``[vllm]`` through the
``grpo.settings`` entry point group (docs/plugins.md), so grpo's core
schema holds none of these keys: the config validates ``[vllm]`` with
:class:`VllmSettings` and the plugin reads it as ``config.table("vllm")``
(:func:`vllm_settings`, typed). Light on purpose (pydantic only): every
config validation imports it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

COLOCATE_GPU_MEMORY_UTILIZATION = 0.3
"""``vllm.gpu_memory_utilization`` when vLLM runs in the trainer's process
(``trl.vllm_mode = 'colocate'``) and the config leaves it unset: TRL's
colocate default, leaving the trainer 70% of the GPU."""


class VllmSettings(BaseModel):
    """The inference servers grpo starts: how ``grpo vllm-serve`` (or a managed server) starts vLLM.

    The vLLM plugin's ``[vllm]`` table. ``extra="forbid"`` turns a typo into an error naming the key.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field(
        "127.0.0.1", description="Bind address. Loopback by default: the server loads adapters from its own filesystem."
    )
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one (managed mode).")
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory vLLM may take (colocate mode: of the trainer's own GPU). Default "
        "0.85 for a server (it has its GPU to itself), "
        f"{COLOCATE_GPU_MEMORY_UTILIZATION} with trl.vllm_mode = 'colocate': vLLM then shares the "
        "GPU with the trainer's weights, gradients, optimizer state and activations (a full fine-tune's AdamW state "
        "alone is twice the fp32 weights), so it takes what TRL's colocate default takes, well under the half a "
        "shared GPU may give vLLM.",
    )
    dtype: str = Field("auto", description="Model dtype in vLLM (auto, bfloat16, float16, float32).")
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Engine context length. Unset: max(sequence_len, trl.max_prompt_length + "
        "trl.max_completion_length).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs each vLLM engine shards the model over (vLLM's tensor parallelism)."
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Managed mode: start this many separate vLLM servers (each its own process and socket); prompt "
        "groups are spread across them. `grpo vllm-serve` passes it to vLLM's own data parallelism.",
    )
    devices: list[int] | None = Field(
        None,
        description="GPU indices (of those this process sees) the managed servers get: server i takes the i-th "
        "tensor_parallel_size of them (CUDA_VISIBLE_DEVICES). Unset: vLLM's default (all visible).",
    )
    trainer_devices: list[int] | None = Field(
        None,
        description="GPU indices the trainer keeps (its CUDA_VISIBLE_DEVICES is narrowed to them before CUDA starts). "
        "Unset: the trainer uses its default device (index 0).",
    )
    enable_prefix_caching: bool | None = Field(
        None, description="Turn vLLM's prefix caching on or off. Unset: vLLM's default."
    )
    block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per KV cache block: prefix caching shares whole blocks only, so a group's samples share "
        "their prompt's prefill only up to its last full block. Default: 32 on CPU (the smallest vLLM's CPU "
        "attention takes; its own default, 128, shares nothing of a prompt under 128 tokens), vLLM's own on GPU.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip vLLM's graph compilation: much faster engine start, slightly slower generation. Default: "
        "true on CPU, vLLM's own on GPU.",
    )
    cpu_kernels: bool = Field(
        True,
        description="On a CPU, give the engines grpo starts (managed servers, colocated) a sampler that draws one "
        "number per sequence instead of one per vocabulary entry (the same distribution), log-prob ranks counted "
        "without a 3 s compilation and, when eager, vLLM's own C++ RMSNorm kernels in place of their PyTorch forms. "
        "Off: vLLM's CPU defaults. No effect on a GPU or an external server.",
    )
    api_key: str | None = Field(
        None,
        description="Require this key on every request but /health (default: VLLM_API_KEY, else one made up per TCP "
        "server); the trainer sends it.",
    )
    transport: Literal["unix", "tcp"] | None = Field(
        None,
        description="How `grpo run` reaches the server it starts: 'unix' (default where available) is a socket in a "
        "private directory, no TCP port; 'tcp' binds host:port with a per-run API key.",
    )
    expose_dev_endpoints: bool = Field(
        False,
        description="Serve vLLM's dev endpoints (/collective_rpc: load weights from any path) on a non-loopback host. "
        "Off: such a bind is refused for full-weight sync.",
    )
    cpu_kvcache_space: int | None = Field(
        None,
        ge=1,
        description="GiB of KV cache on CPU (VLLM_CPU_KVCACHE_SPACE). Default 2: vLLM would otherwise take 85% of "
        "host memory.",
    )
    engine_cpus: str | None = Field(
        None,
        description="CPU cores a managed server computes on ('0-3', '0,2'); the trainer keeps the others. "
        "Unset: with trl.async_prefetch on a CPU machine, the first half of the cores; a synchronous run splits "
        "nothing. 'all': no split.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` command-line arguments.")

    @model_validator(mode="after")
    def _colocate_memory(self, info: ValidationInfo) -> VllmSettings:
        """vLLM in the trainer's process shares its GPU: a smaller default (the user's value always wins)."""
        config = (info.context or {}).get("config") if info is not None else None
        if config is None or config.trl.vllm_mode != "colocate" or "gpu_memory_utilization" in self.model_fields_set:
            return self
        written = set(self.model_fields_set)
        self.gpu_memory_utilization = COLOCATE_GPU_MEMORY_UTILIZATION
        object.__setattr__(self, "__pydantic_fields_set__", written)  # still unset: derived again from the mode
        return self


def vllm_settings(config: Any) -> VllmSettings:
    """The run's ``[vllm]`` table, typed."""
    table = config.table("vllm")
    assert isinstance(table, VllmSettings)
    return table

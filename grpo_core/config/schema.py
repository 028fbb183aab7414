"""The config schema: one pydantic model per TOML table.

Names, types and defaults follow the reference feature list
(``shared/reference/grpo-training-seed.md``): training keys at the top
level, a ``[vllm]`` table for the inference server, a ``[trl]`` table for
every GRPO option, ``[[datasets]]`` entries. Where the reference's default is
``null`` ("use TRL's default"), the field's default stays ``None`` in the
schema and :data:`EFFECTIVE_DEFAULTS` fills the concrete value after
validation, so ``grpo config check`` shows what will actually run.

``[plugins]`` is grpo's own: it picks an implementation per extension point
by name and restricts which plugin distributions may load.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from grpo_core.contract.extension_points import EXTENSION_POINTS


class _Table(BaseModel):
    # extra="forbid" is what turns a typo into an error naming the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VllmSettings(_Table):
    """``[vllm]``: how ``grpo vllm-serve`` (or a managed server) starts vLLM."""

    host: str = Field(
        "127.0.0.1", description="Bind address. Loopback by default: the server loads adapters from its own filesystem."
    )
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one (managed mode).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    dtype: str = Field("auto", description="Model dtype in vLLM (auto, bfloat16, float16, float32).")
    max_model_len: int | None = Field(None, gt=0)
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Managed mode: start this many separate vLLM servers (each its own process and socket); prompt groups are spread across them. `grpo vllm-serve` passes it to vLLM's own data parallelism.",
    )
    devices: list[int] | None = Field(
        None,
        description="GPU indices (of those this process sees) the managed servers get: server i takes the i-th tensor_parallel_size of them (CUDA_VISIBLE_DEVICES). Unset: vLLM's default (all visible).",
    )
    trainer_devices: list[int] | None = Field(
        None,
        description="GPU indices the trainer keeps (its CUDA_VISIBLE_DEVICES is narrowed to them before CUDA starts). Unset: the trainer uses its default device (index 0).",
    )
    enable_prefix_caching: bool | None = None
    block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per KV cache block: prefix caching shares whole blocks only, so a group's samples share their "
        "prompt's prefill only up to its last full block. Default: 32 on CPU (the smallest vLLM's CPU attention takes; "
        "its own default, 128, shares nothing of a prompt under 128 tokens), vLLM's own on GPU.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip vLLM's graph compilation: much faster engine start, slightly slower generation. Default: true on CPU, vLLM's own on GPU.",
    )
    cpu_kernels: bool = Field(
        True,
        description="On a CPU, give the engines grpo starts (managed servers, colocated) a sampler that draws one number "
        "per sequence instead of one per vocabulary entry (the same distribution), log-prob ranks counted without a "
        "3 s compilation and, when eager, vLLM's own C++ RMSNorm kernels in place of their PyTorch forms. Off: vLLM's "
        "CPU defaults. No effect on a GPU or an external server.",
    )
    api_key: str | None = Field(
        None,
        description="Require this key on every request but /health (default: VLLM_API_KEY, else one made up per TCP server); the trainer sends it.",
    )
    transport: Literal["unix", "tcp"] | None = Field(
        None,
        description="How `grpo run` reaches the server it starts: 'unix' (default where available) is a socket in a private directory, no TCP port; 'tcp' binds host:port with a per-run API key.",
    )
    expose_dev_endpoints: bool = Field(
        False,
        description="Serve vLLM's dev endpoints (/collective_rpc: load weights from any path) on a non-loopback host. Off: such a bind is refused for full-weight sync.",
    )
    cpu_kvcache_space: int | None = Field(
        None,
        ge=1,
        description="GiB of KV cache on CPU (VLLM_CPU_KVCACHE_SPACE). Default 2: vLLM would otherwise take 85% of host memory.",
    )
    engine_cpus: str | None = Field(
        None,
        description="CPU cores a managed server computes on ('0-3', '0,2'); the trainer keeps the others. "
        "Unset: with trl.async_prefetch on a CPU machine, the first half of the cores; a synchronous run splits nothing. 'all': no split.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` command-line arguments.")


class DatasetSpec(_Table):
    """One ``[[datasets]]`` entry."""

    path: str = Field(description="Hub id, local directory, or a .json/.jsonl/.csv/.parquet file.")
    name: str | None = Field(None, description="Dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = "train"
    type: str | None = Field(
        None, description="'module.function' transform: fn(cfg) -> map_fn or (map_fn, {'remove_columns': [...]})."
    )
    data_files: str | list[str] | None = None


class _PluginTable(BaseModel):
    """``[plugins]``: choose an implementation per extension point by name,
    restrict which distributions may load, and configure implementations.

    Unset entries are derived from the reference options (e.g. ``trl.use_vllm``
    picks the rollout, ``trl.vllm_lora_sync`` the weight sync). A sub-table
    ``[plugins.<name>]`` holds the settings of the implementation or named
    reward function ``<name>``; that implementation validates it.
    """

    # extra="allow": the [plugins.<name>] settings tables; each is checked to
    # be a table here and validated by its implementation later.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    allow: list[str] | None = Field(
        None, description="Only these plugin distributions may load (grpo itself always may)."
    )

    @model_validator(mode="after")
    def _settings_are_tables(self) -> _PluginTable:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                points = [p.name for p in EXTENSION_POINTS]
                close = difflib.get_close_matches(key, [*points, "allow"], n=1, cutoff=0.6)
                guess = f"did you mean 'plugins.{close[0]}'? " if close else ""
                raise ValueError(
                    f"unknown key 'plugins.{key}': {guess}[plugins] names an implementation per extension point "
                    f"({', '.join(points)}) and the allowlist ('allow'); the settings of an implementation go in "
                    f"a table of their own, [plugins.{key}], with key = value lines."
                )
        return self

    def settings_table(self, name: str) -> dict[str, Any] | None:
        """The ``[plugins.<name>]`` table, if the config has one."""
        return (self.model_extra or {}).get(name)

    def settings_tables(self) -> dict[str, dict[str, Any]]:
        return dict(self.model_extra or {})


MANY_IMPLEMENTATIONS = frozenset({"environment"})
"""Extension points a run may choose several implementations of, as a list:
several environments in one run, each dataset row naming its own."""

PluginSettings = create_model(
    "PluginSettings",
    __base__=_PluginTable,
    **{
        point.name: (
            (str | list[str] | None) if point.name in MANY_IMPLEMENTATIONS else (str | None),
            Field(
                None,
                description=f"{point.summary}: the implementation's name (or 'distribution:name')"
                + (
                    ", or a list of names: rows choose theirs by their 'environment' column"
                    if point.name in MANY_IMPLEMENTATIONS
                    else ""
                )
                + f". Unset: decided by {point.decided_by}.",
            ),
        )
        for point in EXTENSION_POINTS
    },
)  # type: ignore[call-overload]


ScaleRewards = Literal["group", "batch", "none"]


class AlertSettings(_Table):
    """``[alerts]``: live health checks printed once when they fire
    (:mod:`grpo_core.observability.alerts`). Thresholds follow the reference guide's quick
    health checks; ``silence`` lists alert names not to print."""

    enabled: bool = True
    silence: list[str] = Field(
        default_factory=list,
        description="Alert names never to print: reward_zero, no_signal, entropy_collapse, entropy_explosion, grad_norm_high, grad_norm_zero, is_ratio.",
    )
    window: int = Field(10, ge=1, description="Steps the windowed checks average over.")
    reward_zero_steps: int = Field(20, ge=1, description="Steps after which a mean reward still ~0 fires reward_zero.")
    reward_zero_eps: float = Field(0.01, ge=0, description="|mean reward| at or below this counts as ~0.")
    no_signal_fraction: float = Field(
        0.8, gt=0, le=1, description="Fire no_signal when reward_std is 0 on this fraction of the last `window` steps."
    )
    entropy_min: float = Field(0.01, ge=0, description="Mean entropy below this: mode collapse.")
    entropy_max: float = Field(5.0, gt=0, description="Mean entropy above this: the policy is falling apart.")
    grad_norm_max: float = Field(10.0, gt=0, description="Mean grad norm above this: unstable updates.")
    grad_norm_min: float = Field(
        1e-6, ge=0, description="Grad norm at or below this on steps that trained: no gradient flows."
    )
    logp_gap_max: float = Field(
        0.7,
        gt=0,
        description="Mean |trainer - sampler| log-prob gap above this (IS ratio beyond ~2x): stale or broken weight sync.",
    )


class EpisodeSettings(_Table):
    """``[episodes]``: how multi-turn episodes are driven (any environment)."""

    max_turns: int = Field(
        8,
        ge=1,
        description="Model turns per episode at most; an episode still going then ends with ended_by = 'max_turns'.",
    )
    max_tokens_per_turn: int | None = Field(
        None,
        ge=1,
        description="Tokens one model turn may sample. Unset: what is left of trl.max_completion_length, which bounds the whole episode.",
    )
    step_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one environment step may take; a step still running then ends its episode (ended_by = 'timeout').",
    )
    max_concurrent_steps: int = Field(
        32, ge=1, description="Environment steps run at once (threads), across the episodes in flight."
    )


class TrlSettings(_Table):
    """``[trl]``: every GRPO option of the reference, same names and defaults.

    ``None`` means "the default": :data:`EFFECTIVE_DEFAULTS` fills it after
    validation (see :func:`grpo_core.config.loader.apply_effective_defaults`).
    """

    # --- core GRPO
    use_vllm: bool = False
    vllm_mode: Literal["server", "colocate"] | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: int | None = Field(
        None, gt=0, description="Seconds to wait for a vLLM response (and for it to come up). Default 240."
    )
    vllm_server_base_url: str | None = Field(
        None,
        description="Full base URL of an external server (http://host:port, or unix:/path/to/socket); overrides host/port.",
    )
    vllm_server_base_urls: list[str] | None = Field(
        None,
        description="Several external servers (base URLs as in vllm_server_base_url): prompt groups are spread across them, weights are synced to all.",
    )
    vllm_managed: bool | None = Field(
        None,
        description="Start and own the vLLM server as a subprocess. Default: true unless a server already answers at host:port.",
    )
    num_generations: int | None = Field(None, ge=1, description="Completions per prompt. Default 8.")
    generation_batch_size: int | None = Field(
        None,
        ge=1,
        description="Completions per generation (TRL's meaning): a multiple of micro_batch_size x gradient_accumulation_steps; each multiple is one optimizer step fed by the same generation. Default micro_batch_size x gradient_accumulation_steps.",
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per generation (TRL's meaning; generation_batch_size = micro_batch_size x this). Exclusive with generation_batch_size. Default gradient_accumulation_steps.",
    )
    max_completion_length: int | None = Field(None, ge=1, description="Default 256.")
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        description="Prompts longer than this (in tokens) are dropped with a warning. Default: sequence_len.",
    )
    beta: float | None = Field(
        None, ge=0, description="KL coefficient against the reference policy. Default 0.0 (no reference model)."
    )
    num_iterations: int | None = Field(None, ge=1, description="Updates per generated batch (mu). Default 1.")
    epsilon: float | None = Field(None, ge=0, description="Lower clip bound. Default 0.2.")
    epsilon_high: float | None = Field(None, ge=0, description="Upper clip bound. Default: epsilon.")
    delta: float | None = Field(
        None, gt=0, description="Two-sided clipping of the ratio for negative advantages (INTELLECT-2)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] | None = Field(
        None, description="Default dapo."
    )
    scale_rewards: ScaleRewards | bool = Field(
        True, validate_default=True, description="true/'group', 'batch', false/'none'."
    )
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)
    sapo_temperature_pos: float = Field(1.0, gt=0)
    sapo_temperature_neg: float = Field(1.05, gt=0)

    # --- rewards
    reward_funcs: list[str] | None = None
    reward_weights: list[float] | None = None
    multi_objective_aggregation: str | None = Field(
        None, description="'sum_then_normalize' (default) or 'normalize_then_sum' (GDPO), or a plugin's name."
    )
    rollout_func: str | None = Field(
        None,
        description="'module.function' custom rollout: f(prompts, trainer) -> dict with prompt_ids, completion_ids, logprobs.",
    )
    tools: list[str] | None = Field(
        None,
        description="'module.function' tools the model may call during an episode (TRL's tools): schemas from their signatures and docstrings.",
    )
    environment_factory: str | dict[str, str] | None = Field(
        None,
        description="'module.Class' environment (TRL's environment_factory): reset(**row) -> str | None, public methods are tools, optional get_reward(). "
        "A table of name = 'module.Class': several environments, each row naming its own in an 'environment' column (TRL's dict).",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        description="Tool-calling rounds per episode (TRL's meaning). Unset: until the model answers without a call or [episodes] max_turns.",
    )
    reward_timeout: float | None = Field(
        None, gt=0, description="Seconds a reward call may take before it counts as failed."
    )
    reward_error_policy: Literal["raise", "none"] = Field(
        "raise", description="On a failing reward call: stop the run ('raise') or score the batch None ('none')."
    )

    # --- generation
    temperature: float | None = Field(None, ge=0, description="Default 1.0.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0 or unset: no top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    generation_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    vllm_guided_decoding_regex: str | None = None

    # --- async pipeline
    use_data_producer: bool = False
    async_prefetch: bool = False
    prefetch_depth: int | None = Field(None, ge=1, description="Default 1.")
    vllm_sync_interval: int | None = Field(None, ge=1, description="Sync weights every N optimizer steps. Default 1.")
    vllm_lora_sync: bool = False
    streaming_partial_batch: bool | None = None
    streaming_min_groups: int | None = Field(None, ge=1)
    skip_zero_advantage_batches: bool = True
    reward_num_workers: int = Field(1, ge=1)
    vllm_enable_sleep_mode: bool | None = None

    # --- importance sampling
    vllm_importance_sampling_correction: bool | None = None
    importance_sampling_level: Literal["token", "sequence"] | None = None
    vllm_importance_sampling_mode: (
        Literal["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"] | None
    ) = None
    vllm_importance_sampling_cap: float | None = Field(None, gt=0)
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    use_bias_correction_kl: bool | None = None

    # --- replay and re-roll
    replay_buffer_size: int = Field(0, ge=0)
    replay_recompute_logps: bool = True
    reroll_start_fraction: float = Field(1.0, ge=0, le=1)
    reroll_max_groups: int = Field(1, ge=0)

    # --- reference model
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = Field(0.9, ge=0, le=1)
    ref_model_sync_steps: int = Field(64, ge=1)

    # --- logging
    log_completions: bool = False
    num_completions_to_print: int | None = Field(None, ge=0)
    use_liger_loss: bool | None = None

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_words(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


class GRPOConfig(_Table):
    """A whole run: the top-level TOML table."""

    base_model: str = Field(description="Local HF directory, hub id, or a .gguf file (dequantised once and cached).")
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped with the model, tokenizer or reward model (their own modelling files). Off: such models are refused.",
    )
    rl: Literal["grpo", "gdpo"] = Field(
        "grpo",
        description="'gdpo' (Axolotl's name) is GRPO with trl.multi_objective_aggregation = 'normalize_then_sum'.",
    )
    model_type: str | None = Field(
        None, description="Axolotl's model class (e.g. 'AutoModelForCausalLM'): every model loads as a causal LM here."
    )
    tokenizer_type: str | None = Field(
        None,
        description="Axolotl's tokenizer class (e.g. 'AutoTokenizer'): the tokenizer always loads with AutoTokenizer.",
    )
    chat_template: str | None = Field(
        "tokenizer_default",
        description="'tokenizer_default', a template name known to transformers, or an inline Jinja template.",
    )
    tokenizer_config: str | None = None

    adapter: Literal["lora"] | None = None
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_linear: bool | None = None
    lora_target_modules: list[str] | None = None
    load_in_8bit: bool = Field(
        False, description="Load the frozen base weights in 8 bits (bitsandbytes); needs adapter = 'lora'."
    )
    load_in_4bit: bool = Field(
        False, description="Load the frozen base weights in 4 bits, NF4 (bitsandbytes): QLoRA; needs adapter = 'lora'."
    )
    bnb_config_kwargs: dict[str, Any] | None = Field(
        None, description="Extra transformers BitsAndBytesConfig arguments (e.g. bnb_4bit_quant_type)."
    )

    datasets: list[DatasetSpec] = Field(default_factory=list)
    skip_prepare_dataset: bool = False
    dataset_prepared_path: str | None = Field(
        None, description="Axolotl's prepared-dataset cache: accepted, no effect (prompts are prepared at start)."
    )
    strict: bool | None = Field(
        None, description="Axolotl's strict mode: accepted, no effect (grpo's validation is always strict)."
    )
    hf_use_auth_token: bool | None = Field(
        None, description="Accepted, no effect: Hugging Face credentials are read the standard way (HF_TOKEN)."
    )
    val_set_size: float = Field(
        0.0,
        ge=0,
        description="Held-out prompts for evaluation during training: a fraction (< 1) or a count (>= 1) of the dataset, split off with `seed`.",
    )
    test_datasets: list[DatasetSpec] = Field(
        default_factory=list,
        description="A separate evaluation dataset (same entry format as [[datasets]]); used instead of val_set_size.",
    )
    shuffle_dataset: bool = True
    dataset_num_proc: int | None = Field(None, ge=1)

    sequence_len: int = Field(1024, ge=8)
    sample_packing: bool | None = Field(
        None, description="Axolotl's SFT packing: only false is accepted (completions are padded per micro-batch)."
    )
    pad_to_sequence_len: bool | None = Field(
        None,
        description="Axolotl's padding choice: accepted, no effect (each micro-batch is padded to its longest sequence).",
    )
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Completions per forward/backward pass. With a token-sum loss (dapo, cispo) a step's micro-batches are cut where they pad least: as many passes, none larger in padded tokens than the largest of micro_batch_size rows each.",
    )
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_steps: int = Field(
        100, ge=1, description="Optimizer steps. Takes precedence over num_epochs when both are set (as in Axolotl)."
    )
    num_epochs: float | None = Field(
        None,
        gt=0,
        description="Passes over the prompts; used when max_steps is not set: max_steps = ceil(num_epochs x prompts / prompts per step) x num_iterations.",
    )
    learning_rate: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    optimizer: str = "adamw_torch"
    adam_beta1: float | None = Field(None, ge=0, lt=1, description="AdamW beta1 (default 0.9).")
    adam_beta2: float | None = Field(None, ge=0, lt=1, description="AdamW beta2 (default 0.999).")
    adam_epsilon: float | None = Field(None, gt=0, description="AdamW epsilon (default 1e-8).")
    optim_args: dict[str, Any] | None = Field(
        None, description="Extra keyword arguments for the optimizer's constructor."
    )
    lr_scheduler: Literal[
        "cosine",
        "linear",
        "constant",
        "constant_with_warmup",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "cosine_with_min_lr",
        "warmup_stable_decay",
    ] = "cosine"
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the transformers schedule (e.g. num_cycles, power, min_lr_rate)."
    )
    cosine_min_lr_ratio: float | None = Field(
        None, ge=0, le=1, description="Cosine decays to this fraction of learning_rate instead of 0."
    )
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    seed: int = 42

    bf16: bool | Literal["auto"] = False
    fp16: bool = False
    tf32: bool | None = None
    fp8: bool = Field(
        False,
        description="FP8 matmuls (torchao through accelerate); needs a CUDA GPU of compute capability >= 8.9 and torchao, refused elsewhere.",
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile the decoder body for the training forward/backward and log-prob passes (CPU and GPU; the model, its state-dict keys and checkpoints are unchanged).",
    )
    torch_compile_backend: str | None = Field(
        None, description="torch.compile backend (default inductor; e.g. aot_eager, cudagraphs)."
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = (
        Field(None, description="torch.compile mode (default 'default').")
    )
    flash_attention: bool = False
    sdp_attention: bool | None = None
    attn_implementation: str | None = Field(
        None,
        description="transformers' attn_implementation (eager, sdpa, flash_attention_2, ...) or grpo's sdpa_float32 (sdpa on float32 q/k/v inside a bf16 pass); flash kernels fall back to sdpa without CUDA. Unset: sdpa_float32 for bf16 compute on a CPU, transformers' default (sdpa) elsewhere.",
    )
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    share_prompt_prefix: bool = Field(
        True,
        description="Run each distinct prompt of a micro-batch through the trainer's model once and reuse its keys/values "
        "for all its completions (a group's completions share their prompt): the same log-probs and gradients to float "
        "rounding for fewer tokens. Not applied with gradient_checkpointing, torch_compile, active dropout, or models "
        "whose cache is not a plain per-layer key/value cache.",
    )
    verify_weight_sync: Literal["every", "every_probe", "first", "never"] = Field(
        "every",
        description="After a weight sync, check that the inference engine serves the weights just synced: each server "
        "scores a fixed 48-token probe and its log-probs must match the trainer's within what both precisions explain; "
        "a sync that fails is repeated once, then the run stops with a checkpoint. 'every' sync (default: after the "
        "first syncs, a single-process run with plain sampling compares the engine's log-probs of the tokens it sampled "
        "with the next step's training forward instead, at no cost, before that step's optimizer step), 'every_probe' "
        "(the probe right after every sync), the 'first' only, or 'never'. Engines that cannot score tokens are not "
        "checked (an error only when this key is set).",
    )
    reuse_freed_memory: bool | Literal["auto"] = Field(
        "auto",
        description="Keep the memory a step frees for the next step instead of returning it to the operating system "
        "(glibc's mmap and trim thresholds, raised for the run): a CPU step's large buffers then stop costing page "
        "faults, at the price of the process keeping its peak heap. 'auto' (default): when the trainer runs on a CPU. "
        "No effect where the C library is not glibc.",
    )
    special_tokens: dict[str, str] | None = None

    fsdp: list[str] | None = None
    fsdp_config: dict[str, Any] | None = None
    deepspeed: str | None = Field(
        None,
        description="A DeepSpeed JSON, ZeRO stage 2 or 3; its 'auto' values come from this config (see Scaling out).",
    )

    output_dir: Path = Path("./grpo-output")
    logging_steps: int = Field(1, ge=1)
    save_steps: int | None = Field(
        None, ge=1, description="Checkpoint every N steps; also at the end and on interruption."
    )
    save_total_limit: int | None = Field(None, ge=1)
    save_safetensors: bool = Field(True, description="Save weights as safetensors (false: PyTorch .bin files).")
    resume_from_checkpoint: str | None = Field(
        None, description="A checkpoint directory, or 'latest' for the newest in output_dir."
    )
    use_wandb: bool = Field(False, description="Same as adding 'wandb' to report_to.")
    report_to: list[str] | None = Field(
        None,
        description="Trackers besides output_dir/metrics.jsonl: a list of tensorboard, wandb, mlflow, trackio (or any grpo.tracker plugin), 'all' (every installed one) or 'none'.",
    )
    eval_strategy: Literal["no", "steps"] | None = Field(
        None,
        description="'steps': evaluate every eval_steps and at the end. Default: 'steps' when there is evaluation data, else 'no'.",
    )
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N optimizer steps. Default: logging_steps.")
    eval_temperature: float = Field(0.0, ge=0, description="Sampling temperature of evaluation; 0 is greedy.")
    alerts: AlertSettings = Field(default_factory=AlertSettings)

    vllm: VllmSettings = Field(default_factory=VllmSettings)
    episodes: EpisodeSettings = Field(default_factory=EpisodeSettings)
    trl: TrlSettings = Field(default_factory=TrlSettings)
    plugins: PluginSettings = Field(default_factory=PluginSettings)  # type: ignore[valid-type]

    _notes: list[str] = PrivateAttr(default_factory=list)  # what the loader adapted from a foreign layout

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        """HF convention: a single name, a list, or 'none'."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            names = [str(v).strip().lower() for v in value]
            return [] if names in (["none"], []) else names
        return value

    @model_validator(mode="after")
    def _lora_targets(self) -> GRPOConfig:
        if self.adapter == "lora" and self.lora_target_modules is None and self.lora_target_linear is None:
            self.lora_target_linear = True
        return self


# Concrete values behind the reference's ``null`` defaults (TRL 1.16's,
# unless noted). Filled in after validation so every consumer reads a value.
EFFECTIVE_DEFAULTS: dict[str, Any] = {
    "num_generations": 8,
    "max_completion_length": 256,
    "beta": 0.0,
    "num_iterations": 1,
    "epsilon": 0.2,
    "loss_type": "dapo",
    "multi_objective_aggregation": "sum_then_normalize",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "vllm_server_timeout": 240,
    "prefetch_depth": 1,
    "vllm_sync_interval": 1,
    "streaming_partial_batch": False,
    "streaming_min_groups": 1,
    "importance_sampling_level": "token",
    "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_cap": 3.0,
    "use_bias_correction_kl": True,
    "num_completions_to_print": 0,
    "use_liger_loss": False,
    "vllm_enable_sleep_mode": False,
}

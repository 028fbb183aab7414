"""The config schema: one pydantic model per TOML table.

Names, types and defaults follow the reference feature list
(``shared/reference/grpo-training-seed.md``): training keys at the top
level, a ``[trl]`` table for every GRPO option, ``[[datasets]]`` entries.
A plugin may own a top-level table of its own (``[vllm]``, the vLLM
plugin's): :mod:`grpo_core.config.plugin_tables` finds its model, and
:func:`config_model` is the schema with those tables in. Where the reference's default is
``null`` ("use TRL's default"), the field's default stays ``None`` in the
schema and :data:`EFFECTIVE_DEFAULTS` fills the concrete value after
validation, so ``grpo config check`` shows what will actually run.

``[plugins]`` is grpo's own: it picks an implementation per extension point
by name and restricts which plugin distributions may load.
"""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from grpo_core.config import plugin_tables
from grpo_core.contract.errors import ConfigError
from grpo_core.contract.extension_points import EXTENSION_POINTS

DEFAULT_SAVE_STEPS = 50
"""``save_steps`` unless the config says otherwise (why: its description)."""


class _Table(BaseModel):
    # extra="forbid" is what turns a typo into an error naming the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetSpec(_Table):
    """One ``[[datasets]]`` entry."""

    path: str = Field(description="Hub id, local directory, or a .json/.jsonl/.csv/.parquet file.")
    name: str | None = Field(None, description="Dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = Field("train", description="Split to read: 'train', or a slice such as 'train[:100]'.")
    type: str | None = Field(
        None, description="'module.function' transform: fn(cfg) -> map_fn or (map_fn, {'remove_columns': [...]})."
    )
    data_files: str | list[str] | None = Field(
        None, description="Files of a directory or hub dataset to read (datasets' data_files)."
    )


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
                + ". Unset: decided by the [trl] options (grpo_core/config/implementations.py).",
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

    enabled: bool = Field(True, description="Run the health alerts at all; false mutes every one.")
    silence: list[str] = Field(
        default_factory=list,
        description="Alert names never to print: reward_zero, no_signal, entropy_collapse, entropy_explosion, "
        "grad_norm_high, grad_norm_zero, is_ratio.",
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
        description="Mean |trainer - sampler| log-prob gap above this (IS ratio beyond ~2x): stale or broken weight "
        "sync.",
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
        description="Tokens one model turn may sample. Unset: what is left of trl.max_completion_length, which bounds "
        "the whole episode.",
    )
    step_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one environment step may take; a step still running then ends its episode (ended_by = "
        "'timeout').",
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
    use_vllm: bool = Field(
        False,
        description="Generate with vLLM (a server, or in-process with vllm_mode = 'colocate'); false: the trained "
        "model generates.",
    )
    vllm_mode: Literal["server", "colocate"] | None = Field(
        None,
        description="'server' (vLLM in its own process) or 'colocate' (inside the trainer's). Default 'server' with "
        "use_vllm.",
    )
    vllm_server_host: str = Field(
        "0.0.0.0", description="Host of the vLLM server reached over TCP (0.0.0.0: this machine's loopback)."
    )
    vllm_server_port: int = Field(
        8000, description="Port of the vLLM server reached over TCP (a server already answering there may be adopted)."
    )
    vllm_server_timeout: int | None = Field(
        None, gt=0, description="Seconds to wait for a vLLM response (and for it to come up). Default 240."
    )
    vllm_server_base_url: str | None = Field(
        None,
        description="Full base URL of an external server (http://host:port, or unix:/path/to/socket); overrides "
        "host/port.",
    )
    vllm_server_base_urls: list[str] | None = Field(
        None,
        description="Several external servers (base URLs as in vllm_server_base_url): prompt groups are spread across "
        "them, weights are synced to all.",
    )
    vllm_managed: bool | None = Field(
        None,
        description="Start and own the vLLM server as a subprocess. Default: true unless a server already answers at "
        "host:port.",
    )
    num_generations: int | None = Field(None, ge=1, description="Completions per prompt. Default 8.")
    generation_batch_size: int | None = Field(
        None,
        ge=1,
        description="Completions per generation (TRL's meaning): a multiple of micro_batch_size x "
        "gradient_accumulation_steps; each multiple is one optimizer step fed by the same generation. Default "
        "micro_batch_size x gradient_accumulation_steps.",
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per generation (TRL's meaning; generation_batch_size = micro_batch_size x this). "
        "Exclusive with generation_batch_size. Default gradient_accumulation_steps.",
    )
    max_completion_length: int | None = Field(
        None,
        ge=1,
        description="Tokens a completion may sample (a whole episode with tools or an environment). Default 256.",
    )
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
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] | None = Field(
        None,
        description="Policy loss: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo (how tokens are weighted "
        "and normalised). Default dapo. 'luspo' (length-unbiased GSPO: each sequence's loss times its length) wants "
        "importance_sampling_level = 'sequence'; 'vespo' (gamma-weighted sequence ratio) takes a token-level "
        "vllm_importance_sampling_mode.",
    )
    scale_rewards: ScaleRewards | bool = Field(
        True,
        validate_default=True,
        description="Divide advantages by the reward std of the group (true/'group'), of the batch ('batch'), or not "
        "(false/'none').",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut off at max_completion_length out of the loss."
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Train only on the tokens whose entropy is in this top fraction of the micro-batch's; 1.0: all.",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="SAPO's gate temperature for positive advantages (loss_type = 'sapo')."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="SAPO's gate temperature for negative advantages (loss_type = 'sapo')."
    )
    vespo_k_pos: float = Field(2.0, description="VESPO: power k of the weight for advantages >= 0 (TRL 1.16).")
    vespo_lambda_pos: float = Field(3.0, description="VESPO: decay lambda of the weight for advantages >= 0.")
    vespo_k_neg: float = Field(3.0, description="VESPO: power k of the weight for negative advantages.")
    vespo_lambda_neg: float = Field(2.0, description="VESPO: decay lambda of the weight for negative advantages.")

    # --- rewards
    reward_funcs: list[str] | None = Field(
        None,
        description="Reward functions: 'module.function' import paths, names published under grpo.reward, or a "
        "sequence-classification reward model (directory or hub id).",
    )
    reward_weights: list[float] | None = Field(
        None, description="One weight per reward function, in order. Default 1.0 each."
    )
    multi_objective_aggregation: str | None = Field(
        None, description="'sum_then_normalize' (default) or 'normalize_then_sum' (GDPO), or a plugin's name."
    )
    rollout_func: str | None = Field(
        None,
        description="'module.function' custom rollout: f(prompts, trainer) -> dict with prompt_ids, completion_ids, "
        "logprobs.",
    )
    tools: list[str] | None = Field(
        None,
        description="'module.function' tools the model may call during an episode (TRL's tools): schemas from their "
        "signatures and docstrings.",
    )
    environment_factory: str | dict[str, str] | None = Field(
        None,
        description="'module.Class' environment (TRL's environment_factory): reset(**row) -> str | None, public "
        "methods are tools, optional get_reward(). A table of name = 'module.Class': several environments, each row "
        "naming its own in an 'environment' column (TRL's dict).",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        description="Tool-calling rounds per episode (TRL's meaning). Unset: until the model answers without a call "
        "or [episodes] max_turns.",
    )
    reward_timeout: float | None = Field(
        None, gt=0, description="Seconds a reward call may take before it counts as failed."
    )
    reward_error_policy: Literal["raise", "none"] = Field(
        "raise", description="On a failing reward call: stop the run ('raise') or score the batch None ('none')."
    )

    # --- generation
    temperature: float | None = Field(None, ge=0, description="Sampling temperature of training rollouts. Default 1.0.")
    top_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Nucleus sampling: sample from the most likely tokens up to this probability mass. Default 1.0 "
        "(off).",
    )
    top_k: int | None = Field(None, ge=0, description="0 or unset: no top-k.")
    min_p: float | None = Field(
        None, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one. Unset: off."
    )
    repetition_penalty: float | None = Field(
        None, gt=0, description="Penalty on tokens already in the prompt or completion; 1.0 is none. Default 1.0."
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None, description="Extra sampling parameters for the engine (vLLM SamplingParams, e.g. stop_token_ids)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra arguments of the chat template when prompts are rendered (e.g. enable_thinking = false).",
    )
    vllm_guided_decoding_regex: str | None = Field(
        None,
        description="Constrain vLLM's sampling to this regular expression (TRL's vllm_structured_outputs_regex); vLLM "
        "only.",
    )

    # --- async pipeline
    use_data_producer: bool = Field(
        False, description="Accepted, no effect: grpo always runs through its data producer."
    )
    async_prefetch: bool = Field(
        False,
        description="Generate the next batch in a background thread while the current one trains (one sync behind).",
    )
    prefetch_depth: int | None = Field(
        None, ge=1, description="Batches generated ahead with async_prefetch. Default 1."
    )
    in_flight_weight_updates: bool = Field(
        False,
        description="With async_prefetch on a vLLM server: a weight sync pauses the engine without waiting for the "
        "requests in flight, loads the new weights and resumes; every sampled token records the policy version "
        "that produced it (per-token staleness metrics; a sample with a token more than prefetch_depth versions "
        "behind the trainer is dropped from training and counted). Engines that cannot pause are refused by name.",
    )
    partial_rollout_token_budget: int | None = Field(
        None,
        ge=1,
        description="Partial rollouts: the most tokens each sample generates per generation batch. A sample not "
        "finished within it is carried over and continues in the next batch from its exact ids, under the newer "
        "weights (every token records its policy version); a prompt's group trains in the batch where its last "
        "member finishes. Unset: every sample generates to the end in its own batch. vLLM server rollout only.",
    )
    vllm_sync_interval: int | None = Field(None, ge=1, description="Sync weights every N optimizer steps. Default 1.")
    vllm_lora_sync: bool = Field(
        False,
        description="With adapter = 'lora': sync the adapter alone (lora_filesystem) instead of merged weights "
        "(full_filesystem).",
    )
    streaming_partial_batch: bool | None = Field(
        None,
        description="Score each chunk of prompt groups as soon as it is generated, not the whole batch at once. "
        "Default false.",
    )
    streaming_min_groups: int | None = Field(
        None, ge=1, description="Prompt groups per chunk with streaming_partial_batch. Default 1."
    )
    skip_zero_advantage_batches: bool = Field(
        True, description="Leave completions with advantage 0 out of the forward/backward where the loss allows it."
    )
    reward_num_workers: int = Field(
        1, ge=1, description="Subprocess workers that run the reward functions; 1: in the trainer's process."
    )
    vllm_enable_sleep_mode: bool | None = Field(
        None, description="Colocate mode: free vLLM's GPU memory between generations (CUDA only). Default false."
    )

    # --- importance sampling
    vllm_importance_sampling_correction: bool | None = Field(
        None,
        description="Weight the loss by sampler/trainer importance ratios (vllm_importance_sampling_mode). Default: "
        "use_vllm.",
    )
    importance_sampling_level: Literal["token", "sequence"] | None = Field(
        None, description="PPO ratio per token, or one per sequence (GSPO). Default 'token'."
    )
    vllm_importance_sampling_mode: (
        Literal["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"] | None
    ) = Field(
        None,
        description="How importance weights above the cap are handled: truncated or masked, per token or sequence.",
    )
    vllm_importance_sampling_cap: float | None = Field(
        None, gt=0, description="The cap of the importance weights. Default 3.0."
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0,
        description="OPSM: drop negative-advantage completions whose mean sampler-trainer log-prob drift exceeds this.",
    )
    use_bias_correction_kl: bool | None = Field(
        None, description="Weight the per-token KL term by the importance ratio too. Default true."
    )

    # --- replay and re-roll
    replay_buffer_size: int = Field(
        0, ge=0, description="Groups with learning signal kept to replace later groups without it; 0: no replay."
    )
    replay_recompute_logps: bool = Field(
        True, description="Recompute a replayed group's old log-probs with the current policy."
    )
    reroll_start_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="From this fraction of training on, prompts that scored 0 everywhere are retried later; 1.0: off.",
    )
    reroll_max_groups: int = Field(1, ge=0, description="Queued prompts swapped into one batch at most (re-rolling).")

    # --- reference model
    sync_ref_model: bool = Field(
        False, description="Move the reference model toward the policy every ref_model_sync_steps (used when beta > 0)."
    )
    ref_model_mixup_alpha: float = Field(
        0.9, ge=0, le=1, description="At each sync: ref = alpha x policy + (1 - alpha) x ref."
    )
    ref_model_sync_steps: int = Field(64, ge=1, description="Optimizer steps between reference-model syncs.")

    # --- logging
    log_completions: bool = Field(
        False,
        description="Append each logged step's prompts, completions, rewards and advantages to completions.jsonl and "
        "trackers.",
    )
    num_completions_to_print: int | None = Field(
        None,
        ge=0,
        description="Print this many samples at each logged step. Default 0 (all of them with log_completions).",
    )
    use_liger_loss: bool | None = Field(
        None,
        description="Liger-Kernel's fused-linear GRPO loss, never holding the [tokens, vocab] logits. Default false.",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_words(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


class GRPOConfig(_Table):
    """A whole run: the top-level TOML table."""

    # extra="allow" holds the tables plugins claim; any other unknown key is refused by _plugin_tables.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    base_model: str = Field(description="Local HF directory, hub id, or a .gguf file (dequantised once and cached).")
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped with the model, tokenizer or reward model (their own modelling files). "
        "Off: such models are refused.",
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
    tokenizer_config: str | None = Field(
        None, description="Load the tokenizer from this directory or hub id instead of base_model."
    )

    adapter: Literal["lora"] | None = Field(
        None, description="'lora': train a LoRA adapter on the frozen base model. Unset: full fine-tuning."
    )
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scale numerator: the update is scaled by lora_alpha / lora_r.")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the LoRA path; above 0 it turns share_prompt_prefix off."
    )
    lora_target_linear: bool | None = Field(
        None,
        description="Adapt every linear layer but the output head. Default true with adapter = 'lora' and no "
        "lora_target_modules.",
    )
    lora_target_modules: list[str] | None = Field(
        None,
        description="Module names to adapt (e.g. ['q_proj', 'v_proj']); added to the linear layers with "
        "lora_target_linear.",
    )
    load_in_8bit: bool = Field(
        False, description="Load the frozen base weights in 8 bits (bitsandbytes); needs adapter = 'lora'."
    )
    load_in_4bit: bool = Field(
        False, description="Load the frozen base weights in 4 bits, NF4 (bitsandbytes): QLoRA; needs adapter = 'lora'."
    )
    bnb_config_kwargs: dict[str, Any] | None = Field(
        None, description="Extra transformers BitsAndBytesConfig arguments (e.g. bnb_4bit_quant_type)."
    )

    datasets: list[DatasetSpec] = Field(
        default_factory=list,
        description="Training prompts: one [[datasets]] table per source; their rows are used together.",
    )
    skip_prepare_dataset: bool = Field(
        False, description="Axolotl's key: accepted, no effect (prompts are prepared once at start)."
    )
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
        description="Held-out prompts for evaluation during training: a fraction (< 1) or a count (>= 1) of the "
        "dataset, split off with `seed`.",
    )
    test_datasets: list[DatasetSpec] = Field(
        default_factory=list,
        description="A separate evaluation dataset (same entry format as [[datasets]]); used instead of val_set_size.",
    )
    shuffle_dataset: bool = Field(True, description="Shuffle the prompts with seed before training.")
    dataset_num_proc: int | None = Field(
        None, ge=1, description="Processes for the dataset transform (datasets' map num_proc)."
    )

    sequence_len: int = Field(
        1024,
        ge=8,
        description="Default trl.max_prompt_length, and the least context length of a vLLM engine grpo starts.",
    )
    sample_packing: bool | None = Field(
        None, description="Axolotl's SFT packing: only false is accepted (completions are padded per micro-batch)."
    )
    pad_to_sequence_len: bool | None = Field(
        None,
        description="Axolotl's padding choice: accepted, no effect (each micro-batch is padded to its longest "
        "sequence).",
    )
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Completions per forward/backward pass. With a token-sum loss (dapo, cispo, vespo) a step's "
        "micro-batches are cut where they pad least: as many passes, none larger in padded tokens than the "
        "largest of micro_batch_size rows each.",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step, per process.")
    max_steps: int = Field(
        100, ge=1, description="Optimizer steps. Takes precedence over num_epochs when both are set (as in Axolotl)."
    )
    num_epochs: float | None = Field(
        None,
        gt=0,
        description="Passes over the prompts; used when max_steps is not set: max_steps = ceil(num_epochs x prompts / "
        "prompts per step) x num_iterations.",
    )
    learning_rate: float = Field(
        1e-6, gt=0, description="Peak learning rate (after warmup) of the lr_scheduler schedule."
    )
    weight_decay: float = Field(0.0, ge=0, description="The optimizer's weight decay (decoupled in AdamW).")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this before each optimizer step; unset: no clipping."
    )
    optimizer: str = Field(
        "adamw_torch", description="adamw_torch, adamw_torch_fused, adamw_torch_foreach, sgd or adafactor."
    )
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
    ] = Field("cosine", description="Learning-rate schedule over max_steps (transformers' schedules by name).")
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the transformers schedule (e.g. num_cycles, power, min_lr_rate)."
    )
    cosine_min_lr_ratio: float | None = Field(
        None, ge=0, le=1, description="Cosine decays to this fraction of learning_rate instead of 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup to learning_rate.")
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="Warmup as a fraction of max_steps; used when warmup_steps is 0."
    )
    seed: int = Field(
        42, description="Seeds the prompt order, the val_set_size split and the random number generators."
    )

    bf16: bool | Literal["auto"] = Field(
        False,
        description="bf16 compute with float32 trained weights; 'auto': only where the hardware computes bf16 "
        "natively.",
    )
    fp16: bool = Field(False, description="float16 compute as bf16 does it, without loss scaling.")
    tf32: bool | None = Field(
        None, description="Allow TF32 matmuls on CUDA; no effect on a CPU. Unset: torch's default."
    )
    fp8: bool = Field(
        False,
        description="FP8 matmuls (torchao through accelerate); needs a CUDA GPU of compute capability >= 8.9 and "
        "torchao, refused elsewhere.",
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile the decoder body for the training forward/backward and log-prob passes (CPU and "
        "GPU; the model, its state-dict keys and checkpoints are unchanged).",
    )
    torch_compile_backend: str | None = Field(
        None, description="torch.compile backend (default inductor; e.g. aot_eager, cudagraphs)."
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = (
        Field(None, description="torch.compile mode (default 'default').")
    )
    flash_attention: bool = Field(
        False, description="Axolotl's flag for attn_implementation = 'flash_attention_2' (sdpa without CUDA)."
    )
    sdp_attention: bool | None = Field(
        None, description="Axolotl's flag: true is attn_implementation = 'sdpa', false is 'eager'."
    )
    attn_implementation: str | None = Field(
        None,
        description="transformers' attn_implementation (eager, sdpa, flash_attention_2, ...) or grpo's sdpa_float32 "
        "(sdpa on float32 q/k/v inside a bf16 pass); flash kernels fall back to sdpa without CUDA. Unset: "
        "sdpa_float32 for bf16 compute on a CPU, transformers' default (sdpa) elsewhere.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory (turns share_prompt_prefix off)."
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None,
        description="Gradient checkpointing's arguments; use_reentrant defaults to true under ZeRO-3, false elsewhere.",
    )
    share_prompt_prefix: bool = Field(
        True,
        description="Run each distinct prompt of a micro-batch through the trainer's model once and reuse its "
        "keys/values for all its completions (a group's completions share their prompt): the same log-probs and "
        "gradients to float rounding for fewer tokens. Not applied with gradient_checkpointing, torch_compile, "
        "active dropout, or models whose cache is not a plain per-layer key/value cache.",
    )
    verify_weight_sync: Literal["every", "every_probe", "first", "never"] = Field(
        "every",
        description="After a weight sync, check that the inference engine serves the weights just synced: each server "
        "scores a fixed 48-token probe and its log-probs must match the trainer's within what both precisions explain; "
        "a sync that fails is repeated once, then the run stops with a checkpoint. 'every' sync (default: after the "
        "first syncs, a single-process run with plain sampling compares the engine's log-probs of the tokens it "
        "sampled with the next step's training forward instead, at no cost, before that step's optimizer step), "
        "'every_probe' (the probe right after every sync), the 'first' only, or 'never'. Engines that cannot score "
        "tokens are not checked (an error only when this key is set).",
    )
    reuse_freed_memory: bool | Literal["auto"] = Field(
        "auto",
        description="Keep the memory a step frees for the next step instead of returning it to the operating system "
        "(glibc's mmap and trim thresholds, raised for the run): a CPU step's large buffers then stop costing page "
        "faults, at the price of the process keeping its peak heap. 'auto' (default): when the trainer runs on a CPU. "
        "No effect where the C library is not glibc.",
    )
    special_tokens: dict[str, str] | None = Field(
        None,
        description="Tokens set on the tokenizer (pad_token, eos_token, ...; other names become extra special tokens).",
    )

    fsdp: list[str] | None = Field(
        None,
        description="Shard the policy over the training processes (FSDP2): full_shard or shard_grad_op, auto_wrap, "
        "offload.",
    )
    fsdp_config: dict[str, Any] | None = Field(
        None, description="FSDP options: fsdp_version, fsdp_transformer_layer_cls_to_wrap, reshard_after_forward, ..."
    )
    deepspeed: str | None = Field(
        None,
        description=(
            "A DeepSpeed JSON, ZeRO stage 2 or 3; its 'auto' values come from this config (docs: multi-GPU, DeepSpeed)."
        ),
    )

    output_dir: Path = Field(
        Path("./grpo-output"), description="Where metrics, checkpoints, logs and the final model are written."
    )
    logging_steps: int = Field(1, ge=1, description="Log metrics every N optimizer steps, and at the last.")
    save_steps: int | None = Field(
        DEFAULT_SAVE_STEPS,
        ge=0,
        description="Checkpoint every N steps; also at the end and on interruption. Default "
        f"{DEFAULT_SAVE_STEPS}: a crash loses at most that many steps, while a run of the reference guide's length "
        "(100-200 steps) writes 2-4 checkpoints (TRL's 500 would write none before the end of such a run). A "
        "checkpoint holds the trained weights (the adapter alone with LoRA) and the optimizer state: bound the disk "
        "it takes with save_total_limit. 0 or null: only at the end and on interruption (`grpo config check` warns "
        f"for a run longer than {DEFAULT_SAVE_STEPS} steps).",
    )
    save_total_limit: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints.")
    save_safetensors: bool = Field(True, description="Save weights as safetensors (false: PyTorch .bin files).")
    resume_from_checkpoint: str | None = Field(
        None, description="A checkpoint directory, or 'latest' for the newest in output_dir."
    )
    start_over: bool = Field(
        False,
        description="Start from step 0 in an output_dir that holds checkpoints, which is refused otherwise: the "
        "earlier runs' checkpoints and step logs first move to output_dir/abandoned/<run id>/ (nothing is deleted). "
        "`grpo run --start-over` sets it for one launch; kept in a config, every launch starts over.",
    )
    use_wandb: bool = Field(False, description="Same as adding 'wandb' to report_to.")
    report_to: list[str] | None = Field(
        None,
        description="Trackers besides output_dir/metrics.jsonl: a list of tensorboard, wandb, mlflow, trackio (or any "
        "grpo.tracker plugin), 'all' (every installed one) or 'none'.",
    )
    eval_strategy: Literal["no", "steps"] | None = Field(
        None,
        description="'steps': evaluate every eval_steps and at the end. Default: 'steps' when there is evaluation "
        "data, else 'no'.",
    )
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N optimizer steps. Default: logging_steps.")
    eval_temperature: float = Field(0.0, ge=0, description="Sampling temperature of evaluation; 0 is greedy.")
    alerts: AlertSettings = Field(default_factory=AlertSettings)

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

    @model_validator(mode="wrap")
    @classmethod
    def _plugin_tables(cls, data: Any, handler: ModelWrapValidatorHandler[GRPOConfig]) -> GRPOConfig:
        """The top-level tables plugins claim (``[vllm]``) are validated by
        their own models, their problems listed with the core's; any other
        key the schema does not have is unknown, as ``extra="forbid"`` says."""
        if not isinstance(data, dict):  # an instance, or an assignment
            return handler(data)
        own = set(cls.model_fields)
        tables = set(plugin_tables.published_claims())  # usable or not: validate_tables says why not
        core = {key: value for key, value in data.items() if key in own}
        errors: list[dict[str, Any]] = [
            {"type": "extra_forbidden", "loc": (key,), "msg": "Extra inputs are not permitted", "input": value}
            for key, value in data.items()
            if key not in own and key not in tables
        ]
        cfg: GRPOConfig | None = None
        try:
            cfg = handler(core)
        except ValidationError as exc:
            if not errors and not (data.keys() & tables):
                raise
            errors = [*exc.errors(), *errors]
        values, table_errors = plugin_tables.validate_tables(data, cfg, own)
        errors += table_errors
        if errors or cfg is None:
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    {"type": PydanticCustomError(e["type"], e["msg"]), "loc": e["loc"], "input": e["input"]}
                    for e in errors
                ],
            )
        assert cfg.__pydantic_extra__ is not None  # extra="allow": the claimed tables live there
        cfg.__pydantic_extra__.update(values)
        cfg.__pydantic_fields_set__.update(data.keys() & values.keys())
        return cfg

    def table(self, name: str) -> BaseModel:
        """The validated top-level table ``[name]`` a plugin claims (its
        defaults when the config leaves it out): a plugin's narrow view of
        the config, e.g. ``config.table("vllm").port``."""
        found = (self.__pydantic_extra__ or {}).get(name)
        if not isinstance(found, BaseModel):
            claimed = ", ".join(sorted(self.__pydantic_extra__ or {})) or "none"
            raise ConfigError(
                f"no plugin claims a [{name}] table (claimed: {claimed}); a plugin claims one through the "
                f"'{plugin_tables.TABLE_GROUP}' entry point group (docs/plugins.md)."
            )
        return found


def config_model() -> type[GRPOConfig]:
    """The schema with the plugin tables installed now as fields, for what
    describes the config (``grpo config schema``, the configuration
    reference, the hints of an unknown key). Configs are validated by
    :class:`GRPOConfig` itself, which finds the same tables."""
    return _with_tables(tuple(plugin_tables.claimed_tables(None, GRPOConfig.model_fields).models.items()))


@cache
def _with_tables(tables: tuple[tuple[str, type[BaseModel]], ...]) -> type[GRPOConfig]:
    fields: dict[str, Any] = {
        name: (model, Field(default_factory=model, description=(model.__doc__ or "").strip().split("\n")[0]))
        for name, model in tables
    }
    return create_model("GRPOConfig", __base__=GRPOConfig, __doc__=GRPOConfig.__doc__, **fields)  # type: ignore[call-overload]


# Concrete values behind the reference's ``null`` defaults (TRL 1.16's,
# unless noted). Filled in after validation so every consumer reads a value.
EFFECTIVE_DEFAULTS: dict[str, Any] = {
    "num_generations": 8,
    "max_completion_length": 256,  # TRL 1.16's is 512 (docs/from-trl.md)
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
    "vllm_importance_sampling_mode": "token_truncate",  # TRL 1.16's is sequence_mask (docs/from-trl.md)
    "vllm_importance_sampling_cap": 3.0,
    "use_bias_correction_kl": True,
    "num_completions_to_print": 0,
    "use_liger_loss": False,
    "vllm_enable_sleep_mode": False,
}

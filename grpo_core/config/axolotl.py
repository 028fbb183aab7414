"""Configs written for Axolotl: what grpo makes of each key of Axolotl's schema.

Every key of Axolotl's config schema (``tests/data/axolotl/keys.json``, with
the Axolotl commit it was read from) is one of:

- **honoured**: a field of grpo's schema that does the same thing
  (``attn_implementation``, ``num_epochs``, ``load_in_4bit``, ...), or a key
  this module rewrites into one (``rl: gdpo``, ``adapter: qlora``,
  ``chat_template_jinja``);
- **accepted with a note**: a schema field listed in
  :data:`grpo_core.config.compat.COMPATIBILITY_ONLY` (``sample_packing:
  false``, ``pad_to_sequence_len``, ...);
- **refused with the reason** (:data:`REFUSED` below): a feature of
  Axolotl's other trainers or one grpo does not build. Set to ``null``,
  ``false`` or empty it turns nothing on, so it is accepted and named in one
  note; set to anything else it stops the config with the reason.

:func:`adapt` runs on the raw dict before pydantic sees it, so the user gets
the reason instead of "unknown key: remove it".
"""

from __future__ import annotations

from typing import Any, get_args

from grpo_core.config.compat import COMPATIBILITY_ONLY
from grpo_core.config.schema import DatasetSpec, config_model
from grpo_core.contract.errors import ConfigError

# ----------------------------------------------------------------- reasons

_SFT_DPO = (
    "a setting of Axolotl's preference / supervised trainers (DPO, KTO, ORPO, SimPO, reward models); grpo trains GRPO "
    "and GDPO only"
)
_PACKING = (
    "Axolotl packs or streams fixed training text; a GRPO batch is completions grpo generates itself, padded per "
    "micro-batch, so packing and pretraining streams do not apply"
)
_EVAL = (
    "grpo's evaluation is configured with val_set_size or test_datasets, eval_strategy, eval_steps and "
    "eval_temperature; this Axolotl evaluation key has no counterpart"
)
_TRACKERS = (
    "grpo chooses trackers with report_to (tensorboard, wandb, mlflow, trackio; see `grpo plugins`) and the "
    "tracker's own environment variables (WANDB_PROJECT, MLFLOW_TRACKING_URI, ...); this Axolotl key is not read"
)
_DISTRIBUTED = (
    "grpo trains in one process on one device (accelerate places the model); multi-GPU, sharding, device maps and "
    "Ray are not built"
)
_KERNELS = "one of Axolotl's GPU kernel patches or memory tweaks for its own trainer; grpo does not build it"
_QUANT = (
    "quantisation-aware training, post-training quantisation, GPTQ and Q-GaLore are not built; grpo loads a "
    "quantised base for LoRA with load_in_4bit / load_in_8bit (bitsandbytes)"
)
_OPTIM = (
    "an optimizer or schedule variant grpo does not build (it has optimizer = adamw_torch | adamw_torch_fused | "
    "adamw_torch_foreach | sgd | adafactor, adam_beta1/2, adam_epsilon, optim_args, lr_scheduler, "
    "lr_scheduler_kwargs, cosine_min_lr_ratio)"
)
_PEFT = (
    "grpo's LoRA takes adapter, lora_r, lora_alpha, lora_dropout, lora_target_modules and lora_target_linear; "
    "other PEFT options are not built"
)
_MODEL = (
    "a model-loading option grpo does not build: it loads base_model with AutoModelForCausalLM and AutoTokenizer as "
    "published"
)
_TOKENS = "vocabulary edits beyond special_tokens are not built (grpo never resizes embeddings for training)"
_MULTIMODAL = "vision and multimodal models are not supported (grpo trains text causal LMs)"
_DATA_PREP = (
    "Axolotl's dataset preprocessing and dataloader options; grpo loads the prompts once at start (options: path, "
    "name, split, type, data_files, shuffle_dataset, dataset_num_proc)"
)
_HUB = "grpo saves to output_dir; pushing to the Hugging Face Hub is not built"
_SAMPLES = "Axolotl's sample generation during SFT; a GRPO run generates every step (see trl.num_completions_to_print)"
_UI = "Axolotl's Gradio inference UI is not part of grpo"
_NOISE = "embedding noise (NEFTune) is an SFT technique; grpo does not build it"
_CHECKPOINTS = (
    "grpo checkpoints every save_steps steps, at the end and when interrupted; resume with resume_from_checkpoint = "
    "'latest'"
)
_INTERNAL = "set by Axolotl itself at run time (not a user option)"
_MODEL_FAMILY = "Axolotl's old model-family flags; grpo reads the architecture from the model's config.json"

REFUSED: dict[str, str] = {}


def _add(reason: str, keys: str) -> None:
    for key in keys.split():
        REFUSED[key] = reason


_add(
    _SFT_DPO,
    "center_rewards_coefficient cpo_alpha dpo_beta dpo_generate_during_eval dpo_label_smoothing dpo_loss_type "
    "dpo_loss_weights dpo_norm_loss dpo_padding_free dpo_use_liger_kernel dpo_use_logits_to_keep dpo_use_weighting "
    "kto_desirable_weight kto_undesirable_weight num_labels orpo_alpha precompute_ref_log_probs process_reward_model "
    "reward_model rl_beta rpo_alpha simpo_gamma ebft train_on_inputs role_boundaries trainer_cls",
)
_add(
    _PACKING,
    "batch_flattening curriculum_sampling eval_sample_packing excess_length_strategy group_by_length "
    "max_packed_sequence_len min_sample_len multipack_real_batches pad_to_multiple_of pose_max_context_len "
    "pose_num_chunks pose_split_on_token_ids pretrain_multipack_attn pretrain_multipack_buffer_size "
    "pretraining_dataset pretraining_sample_concatenation sample_packing_bin_size sample_packing_eff_est "
    "sample_packing_group_size sample_packing_mp_start_method sample_packing_sequentially streaming "
    "streaming_multipack_buffer_size use_pose total_num_tokens total_supervised_tokens",
)
_add(
    _EVAL,
    "bench_dataset bench_split do_bench_eval do_causal_lm_eval early_stopping_patience eval_batch_size "
    "eval_causal_lm_metrics eval_max_new_tokens eval_sequence_len eval_table_size "
    "evals_per_epoch evaluation_strategy greater_is_better load_best_model_at_end metric_for_best_model",
)
_add(
    _TRACKERS,
    "comet_api_key comet_experiment_config comet_experiment_key comet_mode comet_online comet_project_name "
    "comet_workspace hf_mlflow_log_artifacts include_tkps include_tokens_per_second mlflow_experiment_name "
    "mlflow_run_name mlflow_tracking_uri otel_metrics_host otel_metrics_port profiler_steps profiler_steps_start "
    "trackio_project_name trackio_run_name trackio_space_id use_comet use_mlflow use_otel_metrics use_tensorboard "
    "use_trackio wandb_entity wandb_log_model wandb_mode wandb_name wandb_project wandb_run_id wandb_watch",
)
_add(
    _DISTRIBUTED,
    "accelerator_config context_parallel_size ddp ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters "
    "ddp_timeout deepcompile device device_map dp_replicate_size dp_shard_size experimental_skip_move_to_device "
    "fp8_enable_fsdp_float8_all_gather fsdp_final_state_dict_type fsdp_version gpu_memory_limit heads_k_stride "
    "local_rank max_memory qlora_sharded_model_loading ray_num_workers ray_run_name resources_per_worker "
    "ring_attn_func sequence_parallel_degree tensor_parallel_size use_ray world_size",
)
_add(
    _KERNELS,
    "activation_offloading chunked_cross_entropy chunked_cross_entropy_num_chunks dynamic_checkpoint eaft_alpha "
    "eaft_k eager_attention experts_implementation flash_attn_cross_entropy flash_attn_d512 flash_attn_fuse_mlp "
    "flash_attn_rms_norm flash_optimum flex_attention flex_attn_compile_kwargs fp32_norm_classes fp32_norms "
    "fused_attn_kernel gc_collect_steps gc_steps gemma4_hybrid_attn_impl large_head_attention layer_offloading "
    "llama4_linearized_experts lora_embedding_kernel lora_mlp_kernel lora_o_kernel lora_qkv_kernel "
    "quantize_moe_experts s2_attention sage_attention scaling_softmax scaling_softmax_bias scaling_softmax_factor "
    "sdpa_varlen selective_checkpointing tiled_mlp tiled_mlp_num_shards tiled_mlp_use_original_mlp "
    "torch_compile_options torch_empty_cache_steps torchdistx_path "
    "use_eaft use_kernels use_onebitllms xformers_attention",
)
_add(
    _QUANT,
    "gptq model_quantization_config model_quantization_config_kwargs qat quantization qgalore_cos_threshold "
    "qgalore_gamma_proj qgalore_proj_bits qgalore_proj_group_size qgalore_proj_quant qgalore_proj_type "
    "qgalore_queue_size qgalore_rank qgalore_scale qgalore_update_proj_gap",
)
_add(
    _OPTIM,
    "adam_beta3 adam_epsilon2 cosine_constant_lr_ratio dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of "
    "embedding_lr embedding_lr_scale jagged_restart_anneal_steps jagged_restart_steps jagged_restart_warmup_steps "
    "lisa_layers_attribute lisa_n_layers lisa_step_interval loraplus_lr_embedding loraplus_lr_ratio lr_div_factor "
    "lr_groups lr_quadratic_warmup optim_target_modules relora relora_cpu_offload relora_prune_method "
    "relora_prune_ratio auto_find_batch_size batch_size loss_watchdog_patience loss_watchdog_threshold",
)
_add(
    _PEFT,
    "lora_alpha_pattern lora_fan_in_fan_out lora_model_dir lora_modules_to_save lora_on_cpu lora_rank_pattern "
    "lora_target_parameters merge_lora merge_method peft peft_autocast_adapter_dtype peft_ensure_weight_tying "
    "peft_init_lora_weights peft_layer_replication peft_layers_pattern peft_layers_to_transform "
    "peft_trainable_token_indices peft_use_dora peft_use_rslora unfrozen_parameters freeze_mm_modules",
)
_add(
    _MODEL,
    "base_model_config cls_model_config model_config model_kwargs model_revision tokenizer_legacy tokenizer_use_fast "
    "tokenizer_save_jinja_files tokenizer_use_mistral_common low_cpu_mem_usage reinit_weights "
    "rope_scaling embeddings_skip_upcast bfloat16 float16 float32",
)
_add(
    _TOKENS,
    "added_tokens_overrides tokens fix_untrained_tokens eot_tokens resize_token_embeddings_to_32x "
    "mean_resizing_embeddings shrink_embeddings",
)
_add(_MULTIMODAL, "image_resize_algorithm image_size processor_kwargs processor_type")
_add(
    _DATA_PREP,
    "dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor "
    "dataset_exact_deduplication dataset_keep_in_memory dataset_shard_idx dataset_shard_num num_dataset_shards_to_save "
    "preprocess_iterable push_dataset_to_hub remove_unused_columns shuffle_before_merging_datasets "
    "shuffle_merged_datasets",
)
_add(_HUB, "hub_model_id hub_revision hub_strategy")
_add(
    _SAMPLES,
    "generate_samples generation_do_sample generation_max_new_tokens generation_prompt_ratio generation_temperature "
    "generation_top_k generation_top_p num_generation_samples",
)
_add(_UI, "gradio_max_new_tokens gradio_server_name gradio_server_port gradio_share gradio_temperature gradio_title")
_add(_NOISE, "neftune_noise_alpha noisy_embedding_alpha")
_add(_CHECKPOINTS, "auto_resume_from_checkpoints save_first_step save_only_model save_strategy saves_per_epoch")
_add(_INTERNAL, "axolotl_config_path is_preprocess")
_add(_MODEL_FAMILY, "is_falcon_derived_model is_llama_derived_model is_mistral_derived_model is_qwen_derived_model")
REFUSED.update(
    {
        "default_system_message": (
            "grpo does not insert a system message: put it in the prompts your dataset transform builds"
        ),
        "chat_template_kwargs": (
            "at the top level it shapes Axolotl's SFT templating; for generation prompts write it as "
            "trl.chat_template_kwargs"
        ),
        "dataset_processes": "write dataset_num_proc (grpo's name for the same thing)",
    }
)

# ``vllm:`` keys Axolotl has and grpo does not.
REFUSED_VLLM: dict[str, str] = {
    "device": "grpo's managed server picks its device; pass vLLM's own flags through vllm.extra_args",
    "enable_reasoning": (
        "pass vLLM's reasoning flags through vllm.extra_args (e.g. ['--reasoning-parser', 'deepseek_r1'])"
    ),
    "reasoning_parser": (
        "pass vLLM's reasoning flags through vllm.extra_args (e.g. ['--reasoning-parser', 'deepseek_r1'])"
    ),
    "serve_module": "Axolotl's own serve module; grpo runs vLLM's OpenAI-compatible server (`grpo vllm-serve`)",
    "worker_extension_cls": (
        "Axolotl's NCCL weight-sync worker extension; grpo syncs weights through its weight_sync plugins"
    ),
}

# ``datasets:`` entry keys of Axolotl's SFT datasets.
_SFT_DATASET = (
    "one of Axolotl's SFT prompt-format options; a GRPO dataset becomes prompts through `type` (a transform that "
    "returns a 'prompt' column) or already has a 'prompt' column"
)
REFUSED_DATASET: dict[str, str] = {
    key: _SFT_DATASET
    for key in (
        "chat_template chat_template_jinja conversation drop_system_message ds_type field field_human field_messages "
        "field_model field_thinking field_tools input_format input_transform logprobs_field message_field_content "
        "message_field_role message_field_training message_field_training_detail message_property_mappings roles "
        "roles_to_train split_thinking temperature template_thinking_key train_on_eos train_on_eot"
    ).split()
}
REFUSED_DATASET.update(
    {
        "preprocess_shards": _DATA_PREP,
        "shards": _DATA_PREP,
        "shards_idx": _DATA_PREP,
        "revision": "pinning a hub dataset revision is not built; download that revision and give its local path",
        "trust_remote_code": "dataset loading scripts are not run (datasets 3+ dropped them); use a data-file dataset",
    }
)

# Keys :func:`adapt` turns into grpo's own.
REWRITTEN = {
    "plugins": "a list of Axolotl plugin classes is answered with how grpo plugins are installed and chosen",
    "chat_template_jinja": "becomes chat_template (grpo's chat_template takes an inline Jinja template)",
    "max_prompt_len": "becomes trl.max_prompt_length (longer prompts are dropped with a warning)",
}

RL_TYPES = {"grpo", "gdpo"}

PLUGINS_HELP = (
    "grpo does not load Axolotl plugins (Python classes that patch Axolotl's trainer). grpo plugins are Python "
    "packages that publish entry points: `pip install` one and `grpo plugins` lists what it adds; built-ins and "
    "installed plugins are chosen per extension point in a [plugins] table, e.g. plugins.advantage_aggregation = "
    '"normalize_then_sum", and reward functions are named in trl.reward_funcs. Remove the `plugins:` list'
)


def _harmless(value: Any) -> bool:
    """null, false and empty values turn nothing on."""
    return value is None or value is False or value == "" or value == [] or value == {}


def _drop_nulls(table: dict[str, Any], model: Any, dropped: list[str], prefix: str) -> None:
    """``key: null`` (Axolotl's "unset") for a grpo key that takes no null: the default applies."""
    for key in [k for k, v in table.items() if v is None]:
        field = model.model_fields.get(key)
        if field is not None and type(None) not in get_args(field.annotation):
            del table[key]
            dropped.append(prefix + key)


def _refusals(table: dict[str, Any], refused: dict[str, str], prefix: str, errors: list[str], unset: list[str]) -> None:
    for key in [k for k in table if k in refused]:
        value = table.pop(key)
        if _harmless(value):
            unset.append(prefix + key)
        else:
            errors.append(f"'{prefix}{key}' is not supported: {refused[key]}.")


def _rewrite(data: dict[str, Any], errors: list[str], notes: list[str]) -> None:
    plugins = data.get("plugins")
    if isinstance(plugins, list):
        del data["plugins"]
        if plugins:
            errors.append(f"'plugins' lists Axolotl plugin classes ({', '.join(map(str, plugins))}): {PLUGINS_HELP}.")
    rl = data.get("rl")
    if rl is not None and str(rl) not in RL_TYPES:
        errors.append(
            f"'rl: {rl}' is Axolotl's {rl} trainer; grpo trains rl = 'grpo' and 'gdpo' (GRPO with "
            "normalize_then_sum aggregation) only."
        )
    if data.get("adapter") == "qlora":
        data["adapter"] = "lora"
        notes.append("adapter = 'qlora' is LoRA on a base loaded with load_in_4bit.")
        if data.get("load_in_4bit") is not True:
            errors.append(
                "'adapter: qlora' trains LoRA on a 4-bit base: set load_in_4bit: true (or use adapter: lora)."
            )
    max_prompt = data.pop("max_prompt_len", None)
    if max_prompt is not None:
        trl = data.setdefault("trl", {}) if isinstance(data.get("trl", {}), dict) else {}
        if trl.get("max_prompt_length") not in (None, max_prompt):
            errors.append(
                f"max_prompt_len ({max_prompt}) and trl.max_prompt_length ({trl['max_prompt_length']}) "
                "differ: keep one."
            )
        trl["max_prompt_length"] = max_prompt
    jinja = data.pop("chat_template_jinja", None)
    if jinja:
        if data.get("chat_template") not in (None, "jinja"):
            errors.append(
                f"chat_template_jinja is set and chat_template is '{data['chat_template']}': keep one of them."
            )
        else:
            data["chat_template"] = jinja


def adapt(data: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """Rewrite Axolotl's spellings into grpo's, refuse what grpo will not do.

    Returns the dict to validate and the notes to show the user; raises
    :class:`ConfigError` naming every refused key with its reason.
    """
    errors: list[str] = []
    notes: list[str] = []
    unset: list[str] = []
    nulls: list[str] = []
    _rewrite(data, errors, notes)
    _refusals(data, REFUSED, "", errors, unset)
    schema = config_model()  # with the tables plugins claim: [vllm] is the vLLM plugin's
    _drop_nulls(data, schema, nulls, "")
    for table, refused in (("vllm", REFUSED_VLLM), ("trl", {})):
        if isinstance(data.get(table), dict) and table in schema.model_fields:
            _refusals(data[table], refused, f"{table}.", errors, unset)
            _drop_nulls(data[table], schema.model_fields[table].annotation, nulls, f"{table}.")
        elif table in data and data[table] is None:
            del data[table]
    datasets = data.get("datasets")
    for i, spec in enumerate(datasets if isinstance(datasets, list) else []):  # any other type: the schema names it
        if isinstance(spec, dict):
            _refusals(spec, REFUSED_DATASET, f"datasets[{i}].", errors, unset)
            _drop_nulls(spec, DatasetSpec, nulls, f"datasets[{i}].")
    if errors:
        head = f"{source}: {len(errors)} problem(s) in the config:" if len(errors) > 1 else f"{source}:"
        raise ConfigError(head + "\n" + "\n".join(f"  - {e}" for e in errors))
    if unset:
        notes.append(
            "set to null/false/empty, so they turn nothing on (grpo does not have these features): " + ", ".join(unset)
        )
    if nulls:
        notes.append("null in the config, so the default applies: " + ", ".join(nulls))
    return data, notes


# ------------------------------------------------------------- for convert

_NOTES_BY_KEY = {
    "rl": lambda v: "GRPO with trl.multi_objective_aggregation = 'normalize_then_sum'" if v == "gdpo" else None,
    "adapter": lambda v: "LoRA on a base loaded with load_in_4bit" if v == "qlora" else None,
    "num_epochs": lambda v: "used when max_steps is not set; max_steps wins when both are (as in Axolotl)",
    "attn_implementation": lambda v: (
        "flash kernels need CUDA and flash-attn; grpo uses sdpa (with a warning) elsewhere"
        if str(v).startswith("flash")
        else None
    ),
    "load_in_4bit": lambda v: "bitsandbytes NF4 base for LoRA (CUDA, or a CPU bitsandbytes supports)" if v else None,
    "load_in_8bit": lambda v: "bitsandbytes 8-bit base for LoRA (CUDA, or a CPU bitsandbytes supports)" if v else None,
    "chat_template_jinja": lambda v: "grpo reads it as chat_template (an inline Jinja template)",
    "max_prompt_len": lambda v: "grpo reads it as trl.max_prompt_length",
}


def explain(path: str, value: Any) -> tuple[str | None, bool]:
    """What grpo does with one key of a config being converted: a comment for
    it, and whether the key is written commented out (refused, so the TOML
    still runs and says what was left behind)."""
    table, _, key = path.rpartition(".")
    if table.startswith("datasets["):
        refused = REFUSED_DATASET
    else:
        refused = {"": REFUSED, "vllm": REFUSED_VLLM}.get(table, {})
    if path == "plugins" and isinstance(value, list):
        return (
            "Axolotl plugin classes: " + PLUGINS_HELP.split(". ", 1)[1].replace("Remove the `plugins:` list", "")
        ).strip(), True
    if key in refused:
        if _harmless(value):
            return f"no effect in grpo ({refused[key]})", False
        return f"not supported by grpo: {refused[key]}", True
    compat = {item.key: item.note for item in COMPATIBILITY_ONLY}
    if path in compat and value is not None:
        return f"accepted, no effect: {compat[path]}", False
    if path in _NOTES_BY_KEY:
        return _NOTES_BY_KEY[path](value), False
    return None, False

"""TRL's CLI YAML (``trl grpo --config x.yaml``) -> a grpo config, for ``grpo config convert``.

TRL's file is flat: the ``trl grpo`` script's arguments (``model_name_or_path``,
``dataset_name``, ``reward_funcs``, ...), ``ModelConfig``'s (``use_peft``,
``lora_r``, ...) and every ``GRPOConfig``/``TrainingArguments`` field side by
side. Each becomes its grpo key (:mod:`grpo_core.config.trl_names`): a
``GRPOConfig`` field under ``[trl]``, a training argument at the top level,
a vLLM one under ``[vllm]``. What grpo does not have is written commented
out with the reason, never dropped silently. Where the file relies on a
TRL default grpo sets otherwise (batch, epochs, scheduler, precision, ...),
TRL's value is written out with a comment, so the converted config trains
as the TRL run would (docs/from-trl.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_core.config.schema import config_model
from grpo_core.config.trl_names import RENAMES, grpo_key

TRL_REWARDS = {
    "accuracy_reward": "trl.rewards.accuracy_rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.accuracy_rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.format_rewards.think_format_reward",
}
"""``trl grpo``'s built-in reward names -> TRL's own functions by import path
(grpo calls them with TRL's convention; ``accuracy_reward`` needs ``math_verify``)."""

KEPT_DEFAULTS: tuple[tuple[str, str, Any], ...] = (
    ("micro_batch_size", "per_device_train_batch_size", 8),
    ("lr_scheduler", "lr_scheduler_type", "linear"),
    ("optimizer", "optim", "adamw_torch_fused"),
    ("bf16", "bf16", True),
    ("gradient_checkpointing", "gradient_checkpointing", True),
    ("logging_steps", "logging_steps", 10),
    ("save_steps", "save_steps", 500),
    ("trl.max_completion_length", "max_completion_length", 512),
    ("trl.vllm_importance_sampling_mode", "vllm_importance_sampling_mode", "sequence_mask"),
)
"""(grpo key, TRL field, TRL 1.16's default) for defaults grpo sets otherwise:
written into a converted config that leaves the TRL field unset."""

TRL_EPOCHS = 3
"""TRL's ``num_train_epochs`` default: a TRL run without ``max_steps`` trains 3 epochs."""

_NOT_BUILT = "not in grpo (docs/from-trl.md)"
_SCRIPT_ONLY = {
    "dataset_streaming": "streaming datasets are not built: grpo loads the prompts once at start",
    "ignore_bias_buffers": "a DDP setting of TRL's script; grpo's DDP needs none",
    "model_revision": "download that revision and give its local directory as model_name_or_path",
    "lora_task_type": "grpo's LoRA is always a causal-LM adapter",
    "lora_target_parameters": "grpo's LoRA targets modules (lora_target_modules), not parameters",
    "lora_modules_to_save": "training extra full modules beside LoRA is not built",
    "use_rslora": "rank-stabilised LoRA is not built",
    "use_dora": "DoRA is not built",
    "bnb_4bit_quant_storage": "grpo keeps bitsandbytes' default storage type",
    "get_soft_overlong_punishment": "a reward factory TRL's script configures itself; write a reward function",
}


@dataclass
class Converted:
    """A TRL CLI file in grpo's layout, with what to say about it."""

    data: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)  # grpo key path -> comment on its line
    left_out: list[tuple[str, Any, str]] = field(default_factory=list)  # (TRL key, value, why)


def looks_like_trl_cli(data: dict[str, Any]) -> bool:
    """A flat ``trl grpo`` config: no grpo/Axolotl ``base_model``, and TRL's model or dataset argument."""
    return "base_model" not in data and ("model_name_or_path" in data or "dataset_name" in data)


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    table, _, name = key.rpartition(".")
    (out.setdefault(table, {}) if table else out)[name] = value


def _rewards(raw: dict[str, Any], conv: Converted) -> None:
    funcs: list[str] = []
    model = raw.pop("reward_model_name_or_path", None)
    if model:
        funcs.append(str(model))
        conv.notes["trl.reward_funcs"] = "reward_model_name_or_path first, as TRL's script puts it"
    for name in raw.pop("reward_funcs", None) or []:
        name = str(name)
        if name in TRL_REWARDS:
            funcs.append(TRL_REWARDS[name])
            conv.notes["trl.reward_funcs"] = "TRL's built-in reward names become TRL's functions by import path"
        elif name in _SCRIPT_ONLY:
            conv.left_out.append(("reward_funcs", name, _SCRIPT_ONLY[name]))
        else:
            funcs.append(name)
    if funcs:
        _put(conv.data, "trl.reward_funcs", funcs)


def _datasets(raw: dict[str, Any], conv: Converted) -> None:
    name = raw.pop("dataset_name", None)
    config = raw.pop("dataset_config", None)
    train_split = raw.pop("dataset_train_split", "train")
    test_split = raw.pop("dataset_test_split", None)
    mixture = raw.pop("datasets", None)
    entries: list[dict[str, Any]] = []
    if isinstance(mixture, list) and mixture:
        for i, item in enumerate(mixture):
            if not isinstance(item, dict) or "path" not in item:
                conv.left_out.append((f"datasets[{i}]", item, "a TRL dataset mixture entry needs a path"))
                continue
            entry = {k: item[k] for k in ("path", "name", "split", "data_files") if item.get(k) is not None}
            entries.append(entry)
            for key in sorted(set(item) - {"path", "name", "split", "data_files"}):
                conv.left_out.append((f"datasets[{i}].{key}", item[key], "a mixture option grpo does not build"))
        if name:
            conv.left_out.append(("dataset_name", name, "TRL uses `datasets` when both are given"))
    elif name:
        entry = {"path": name, "split": train_split}
        if config:
            entry["name"] = config
        entries.append(entry)
    if entries:
        conv.data["datasets"] = entries
    eval_on = raw.get("eval_strategy", "no") not in (None, "no")
    if test_split is not None and name and not mixture and eval_on:
        test = {"path": name, "split": test_split, **({"name": config} if config else {})}
        conv.data["test_datasets"] = [test]
    elif test_split is not None and not eval_on:
        conv.left_out.append(("dataset_test_split", test_split, "TRL evaluates on it only with eval_strategy"))


def _model(raw: dict[str, Any], conv: Converted) -> None:
    model = raw.pop("model_name_or_path", None)
    if model is not None:
        conv.data["base_model"] = model
    if raw.pop("use_peft", False):
        conv.data["adapter"] = "lora"
        if "lora_dropout" not in raw:
            conv.data["lora_dropout"] = 0.05
            conv.notes["lora_dropout"] = "TRL's ModelConfig default (grpo's is 0.0)"
    else:
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
            if key in raw:
                conv.left_out.append((key, raw.pop(key), "TRL ignores LoRA options without use_peft"))
    targets = raw.pop("lora_target_modules", None)
    if targets == "all-linear" or targets == ["all-linear"]:
        conv.data["lora_target_linear"] = True
    elif targets:
        conv.data["lora_target_modules"] = [targets] if isinstance(targets, str) else list(targets)
    dtype = raw.pop("dtype", raw.pop("torch_dtype", None))
    if dtype in ("bfloat16", "bf16"):
        conv.data["bf16"] = True
        conv.notes["bf16"] = f"dtype: {dtype} (grpo computes in bf16 and keeps float32 master weights)"
    elif dtype in ("float16", "fp16"):
        conv.data["fp16"] = True
    elif dtype not in (None, "auto", "float32"):
        conv.left_out.append(("dtype", dtype, "grpo's precision keys are bf16 and fp16"))
    kwargs: dict[str, Any] = {}
    if "bnb_4bit_quant_type" in raw:
        kwargs["bnb_4bit_quant_type"] = raw.pop("bnb_4bit_quant_type")
    if raw.pop("use_bnb_nested_quant", False):
        kwargs["bnb_4bit_use_double_quant"] = True
    if kwargs and (raw.get("load_in_4bit") or raw.get("load_in_8bit")):
        conv.data["bnb_config_kwargs"] = kwargs


def _fields(raw: dict[str, Any], conv: Converted) -> None:
    """Every remaining key: a GRPOConfig/TrainingArguments field by its grpo name, or left out."""
    for name, value in raw.items():
        if name in _SCRIPT_ONLY:
            conv.left_out.append((name, value, _SCRIPT_ONLY[name]))
            continue
        key = grpo_key(name)
        if key is None or "[" in key:
            conv.left_out.append((name, value, _NOT_BUILT))
            continue
        if name == "save_steps" and isinstance(value, float) and value < 1:
            conv.left_out.append((name, value, "a fraction of the run is not built: give save_steps in steps"))
            continue
        _put(conv.data, key, value)
        if name in RENAMES:
            conv.notes[key] = f"TRL's {name}"
        elif name == "num_train_epochs":
            conv.notes[key] = "TRL's num_train_epochs"


def _kept_defaults(source: dict[str, Any], conv: Converted) -> None:
    """TRL's default where the file leaves a field unset and grpo's default differs."""
    data = conv.data
    for key, trl_field, value in KEPT_DEFAULTS:
        if trl_field in source:
            continue
        if key == "bf16" and (source.get("fp16") or "bf16" in data or "fp16" in data):
            continue
        if key == "trl.vllm_importance_sampling_mode" and not source.get("use_vllm"):
            continue
        _put(data, key, value)
        conv.notes[key] = "TRL's default, kept (grpo's own default differs: docs/from-trl.md)"
    if "max_steps" not in source and "num_train_epochs" not in source:
        data["num_epochs"] = TRL_EPOCHS
        conv.notes["num_epochs"] = "TRL's default num_train_epochs, kept (grpo's own default is max_steps = 100)"
    if source.get("use_vllm") and "vllm_mode" not in source:
        _put(data, "trl.vllm_mode", "colocate")
        conv.notes["trl.vllm_mode"] = "TRL's default, kept (grpo's own default is a managed server)"
    if source.get("max_steps", -1) in (-1, None) and "max_steps" in data:
        del data["max_steps"]  # TRL's -1: train num_train_epochs
        data.setdefault("num_epochs", source.get("num_train_epochs", TRL_EPOCHS))


def from_trl_cli(raw: dict[str, Any]) -> Converted:
    """Convert a ``trl grpo --config`` file (as read) into grpo's layout."""
    source = dict(raw)
    work = dict(raw)
    conv = Converted({})
    _model(work, conv)
    _datasets(work, conv)
    _rewards(work, conv)
    _fields(work, conv)
    _kept_defaults(source, conv)
    order = list(config_model().model_fields)  # [vllm], the vLLM plugin's table, included
    conv.data = dict(sorted(conv.data.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    return conv

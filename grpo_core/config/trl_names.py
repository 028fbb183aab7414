"""TRL's names for grpo's keys, and the defaults where the two differ.

A TRL user brings TRL's spellings: ``GRPOConfig``/``TrainingArguments``
fields (``per_device_train_batch_size``) and the ``trl grpo`` command's
script and model arguments (``model_name_or_path``, ``dataset_name``).
Most of ``GRPOConfig``'s own fields keep their name under ``[trl]``
(``trl.beta``); the others are listed here, so that an unknown key gets its
grpo name instead of the nearest spelling (``dataset_name`` is not
``dataset_num_proc``), ``grpo config convert`` can read TRL's CLI YAML
(:mod:`grpo_core.config.trl_cli`), and ``grpo config check`` can say which
of grpo's defaults are not TRL's. ``scripts/trl_mapping.py`` builds the
generated tables of docs/from-trl.md from the same tables;
``tests/test_trl_mapping.py`` holds them against the installed TRL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_core.config.schema import GRPOConfig, config_model

TRL_VERSION = "1.16"
"""The TRL release whose names and defaults these tables hold (tested against the installed one)."""

RENAMES: dict[str, str] = {
    "per_device_train_batch_size": "micro_batch_size",
    "num_train_epochs": "num_epochs",
    "lr_scheduler_type": "lr_scheduler",
    "optim": "optimizer",
    "vllm_structured_outputs_regex": "trl.vllm_guided_decoding_regex",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_max_model_length": "vllm.max_model_len",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "vllm_importance_sampling_clip_max": "trl.vllm_importance_sampling_cap",
}
"""``GRPOConfig`` / ``TrainingArguments`` fields whose grpo key has another name or table."""


@dataclass(frozen=True)
class ScriptKey:
    """A ``trl grpo`` command-line argument (``ScriptArguments``, ``ModelConfig``) and grpo's way to say it."""

    key: str | None  # the grpo key it becomes, None when there is none
    write: str  # how to write it in a grpo config


SCRIPT_KEYS: dict[str, ScriptKey] = {
    "model_name_or_path": ScriptKey("base_model", 'base_model = "..." (a hub id, a local directory or a .gguf file)'),
    "dataset_name": ScriptKey("datasets[0].path", '[[datasets]] with path = "..." (one table per dataset)'),
    "dataset_config": ScriptKey("datasets[0].name", "name = ... in the [[datasets]] entry"),
    "dataset_train_split": ScriptKey("datasets[0].split", "split = ... in the [[datasets]] entry"),
    "dataset_test_split": ScriptKey(
        "test_datasets[0].split", "a [[test_datasets]] entry with the same path and this split"
    ),
    "use_peft": ScriptKey("adapter", 'adapter = "lora"'),
    "dtype": ScriptKey("bf16", 'bf16 = true (or "auto") for bfloat16 compute; float32 weights are trained'),
    "torch_dtype": ScriptKey("bf16", 'bf16 = true (or "auto") for bfloat16 compute; float32 weights are trained'),
    "reward_model_name_or_path": ScriptKey("trl.reward_funcs", "its path or hub id as an entry of trl.reward_funcs"),
    "model_revision": ScriptKey(None, "download that revision and give its local directory as base_model"),
}
"""``trl grpo``'s own arguments (not ``GRPOConfig`` fields)."""


def schema_field(key: str) -> Any | None:
    """The schema's field at a dotted key (``trl.beta``), or None."""
    model: Any = config_model()  # [vllm] is the vLLM plugin's table
    field = None
    for part in key.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        field = fields[part]
        model = field.annotation
    return field


def grpo_key(trl_name: str) -> str | None:
    """The grpo key for one TRL ``GRPOConfig``/``TrainingArguments`` field or
    ``trl grpo`` argument, or None: a rename, a script argument, else the
    same name under ``[trl]``, at the top level, then under ``[vllm]``."""
    if trl_name in RENAMES:
        return RENAMES[trl_name]
    if trl_name in SCRIPT_KEYS:
        return SCRIPT_KEYS[trl_name].key
    for key in (f"trl.{trl_name}", trl_name, f"vllm.{trl_name}"):
        if schema_field(key) is not None:
            return key
    return None


def unknown_key_hint(table: str | None, key: str) -> str | None:
    """For an unknown ``key`` (in ``[table]``, or at the top level when
    None) that is TRL's name for a grpo key: what to write instead."""
    if key in SCRIPT_KEYS:
        script = SCRIPT_KEYS[key]
        return f"'{key}' is the `trl grpo` argument; grpo writes {script.write}."
    target = RENAMES.get(key)
    if target is None:
        return None
    owner, _, name = target.rpartition(".")
    where = f"{name} = ... in [{owner}]" if owner else f"{name} = ... at the top level (above the first [table])"
    return f"'{key}' is TRL's name for grpo's '{target}': write {where}."


@dataclass(frozen=True)
class DefaultDifference:
    """A default TRL users rely on that grpo (the reference guide) sets otherwise."""

    key: str  # grpo's key
    trl_field: str  # TRL's field
    trl_default: Any  # its default (bf16: None, which TRL makes true unless fp16)
    applies: Any  # (cfg) -> bool: the difference matters for this config and the user left it unset
    grpo: Any  # (cfg) -> str: grpo's value for this config

    @property
    def trl(self) -> str:
        """TRL's name and default, as a TRL user would write it."""
        if self.trl_field == "bf16":
            return "bf16 = true unless fp16"
        value = repr(self.trl_default) if isinstance(self.trl_default, str) else str(self.trl_default).lower()
        return f"{self.trl_field} = {value}"


def _unset(cfg: GRPOConfig, *keys: str) -> bool:
    for key in keys:
        table, _, name = key.rpartition(".")
        owner = getattr(cfg, table) if table else cfg
        if name in owner.model_fields_set:
            return False
    return True


DEFAULT_DIFFERENCES: tuple[DefaultDifference, ...] = (
    DefaultDifference(
        "micro_batch_size",
        "per_device_train_batch_size",
        8,
        lambda c: _unset(c, "micro_batch_size"),
        lambda c: str(c.micro_batch_size),
    ),
    DefaultDifference(
        "max_steps",
        "num_train_epochs",
        3,
        lambda c: _unset(c, "max_steps", "num_epochs"),
        lambda c: str(c.max_steps),
    ),
    DefaultDifference(
        "lr_scheduler",
        "lr_scheduler_type",
        "linear",
        lambda c: _unset(c, "lr_scheduler"),
        lambda c: repr(c.lr_scheduler),
    ),
    DefaultDifference(
        "bf16",
        "bf16",
        None,
        lambda c: _unset(c, "bf16") and not c.fp16,
        lambda c: str(c.bf16).lower(),
    ),
    DefaultDifference(
        "trl.max_completion_length",
        "max_completion_length",
        512,
        lambda c: _unset(c, "trl.max_completion_length"),
        lambda c: str(c.trl.max_completion_length),
    ),
    DefaultDifference(
        "trl.vllm_mode",
        "vllm_mode",
        "colocate",
        lambda c: bool(c.trl.use_vllm) and _unset(c, "trl.vllm_mode"),
        lambda c: repr(c.trl.vllm_mode),
    ),
    DefaultDifference(
        "save_steps",
        "save_steps",
        500,
        lambda c: _unset(c, "save_steps"),
        lambda c: str(c.save_steps),
    ),
    DefaultDifference(
        "gradient_checkpointing",
        "gradient_checkpointing",
        True,
        lambda c: _unset(c, "gradient_checkpointing"),
        lambda c: str(c.gradient_checkpointing).lower(),
    ),
)
"""What ``grpo config check`` names for a config that leaves these keys unset
(``vllm.gpu_memory_utilization`` is not among them: in colocate mode grpo's
default is TRL's 0.3). Every difference, with the reasons:
docs/from-trl.md."""


def default_differences(cfg: GRPOConfig) -> list[str]:
    """``key grpo_value (TRL: name = default)`` for each unset key whose grpo default is not TRL's."""
    return [f"{d.key} {d.grpo(cfg)} (TRL: {d.trl})" for d in DEFAULT_DIFFERENCES if d.applies(cfg)]

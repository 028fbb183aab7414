"""The TRL -> grpo table of docs/from-trl.md, and docs/trl-differences.md (every
default grpo sets otherwise than TRL, with why).

Generated from both schemas so they stay true: the rows are TRL's own
``GRPOConfig`` fields (read from the installed ``trl``) and the
``TrainingArguments`` fields grpo has a key for; the grpo column is checked
against grpo's schema (a renamed or removed key fails here, not in a user's
script). The names TRL and grpo spell differently live in
``grpo_core/config/trl_names.py``, which the config loader also uses to
answer a TRL name with its grpo key. ``tests/unit/test_trl_mapping.py`` fails
when docs/from-trl.md's table or docs/trl-differences.md is out of date, or when a
default differs without a word about why.

    python scripts/trl_mapping.py          # print the table
    python scripts/trl_mapping.py --write  # rewrite it in docs/from-trl.md, and docs/trl-differences.md
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from grpo_core.config.trl_names import RENAMES, SCRIPT_KEYS, grpo_key

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "docs" / "from-trl.md"  # the mapping table's page (the name is the script's history)
DIFFERENCES = ROOT / "docs" / "trl-differences.md"
START, END = "<!-- trl-mapping:start -->", "<!-- trl-mapping:end -->"

# Fields whose grpo counterpart is not a key of the same shape.
ELSEWHERE = {
    "model_init_kwargs": "`base_model`, `bf16`, `attn_implementation`, `load_in_4bit` (no free-form kwargs)",
    "report_to": "`report_to` (a list; trackers are `grpo.tracker` plugins; metrics.jsonl always)",
    "reward_funcs": "a GRPOTrainer argument in TRL; names or import paths here, or callables passed to `grpo.train`",
}

# grpo's None where it means the same as TRL's value: not a difference.
SAME_WHEN_UNSET = {
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "report_to": "none",  # unset: metrics.jsonl only, no tracker
    "eval_strategy": "no",  # unset: 'no' without evaluation data
}
EQUIVALENT = {
    "epsilon_high",  # TRL's None and grpo's filled-in value both mean epsilon's value
    "num_completions_to_print",  # TRL's None and grpo's 0 both print every completion with log_completions
}

# Why each default differs, and what a TRL user writes to keep TRL's.
WHY = {
    "output_dir": "a folder named for grpo; TRL's `None` means `trainer_output`",
    "per_device_train_batch_size": (
        "the reference guide's default. A generation batch must hold whole groups of `trl.num_generations`, so "
        "`grpo config check` refuses 1 with the default 8 generations and says so; write `micro_batch_size = 8` for "
        "TRL's batch"
    ),
    "num_train_epochs": (
        "grpo trains `max_steps` optimizer steps unless `num_epochs` (TRL's `num_train_epochs`) is set; write "
        "`num_epochs = 3` for TRL's length"
    ),
    "max_steps": "the reference guide's 100 steps; `num_epochs` counts steps from the dataset instead",
    "lr_scheduler_type": "the reference guide's cosine; write `lr_scheduler = \"linear\"` for TRL's",
    "optim": ("the reference guide's key with PyTorch's plain AdamW; `optimizer = \"adamw_torch_fused\"` is TRL's"),
    "bf16": (
        'float32 unless asked: `bf16 = true` computes in bf16 everywhere, `"auto"` only where the hardware has '
        "native bf16 (an AVX2 CPU emulates it, several times slower than float32); TRL's `None` means true unless "
        "`fp16`"
    ),
    "gradient_checkpointing": (
        "off: recomputing activations costs time (TRL's own estimate: ~20% of a step) and turns off grpo's shared "
        "prompt prefix (`share_prompt_prefix`); turn it on when memory is short"
    ),
    "logging_steps": "every step: a GRPO step is slow enough that each one's reward is worth a line",
    "save_steps": (
        "a GRPO run is often shorter than 500 steps (the reference guide's are 100-200), so TRL's interval would "
        "write no checkpoint before the end; 50 loses at most 50 steps to a crash"
    ),
    "max_completion_length": (
        'the reference guide leaves it unset ("TRL\'s default"); grpo fills in 256, TRL 1.16 uses 512: write '
        "`trl.max_completion_length = 512` for TRL's"
    ),
    "vllm_mode": (
        "grpo starts and owns a vLLM server by default (one command, the trainer's GPU left to training); "
        '`trl.vllm_mode = "colocate"` runs vLLM in the trainer\'s process as TRL does'
    ),
    "vllm_gpu_memory_utilization": (
        "the same 0.3 as TRL's in colocate mode; a server grpo starts has its GPU to itself and takes 0.85 "
        "(TRL's `trl vllm-serve` takes 0.9)"
    ),
    "ref_model_mixup_alpha": "the reference guide's 0.9",
    "ref_model_sync_steps": "the reference guide's 64",
    "vllm_importance_sampling_mode": (
        "the reference guide leaves it unset; grpo fills in per-token truncation (TIS), TRL 1.16 masks whole "
        'sequences: `trl.vllm_importance_sampling_mode = "sequence_mask"` for TRL\'s'
    ),
}

GRPO_TRAINER_ARGUMENTS = [
    ("model", "`base_model` in the config (a hub id, a local directory or a .gguf file)"),
    ("reward_funcs", "`reward_funcs=` of `grpo.train` (callables or names), or `trl.reward_funcs`"),
    ("args", "the config: a TOML/YAML file, a dict or a `GRPOConfig` (`grpo.train(config, ...)`)"),
    (
        "train_dataset",
        "`train_dataset=` of `grpo.train` (a `datasets.Dataset` with a `prompt` column), or `[[datasets]]`",
    ),
    ("eval_dataset", "`eval_dataset=` of `grpo.train` (saved and used as `[[test_datasets]]`), or `[[test_datasets]]`"),
    (
        "processing_class",
        "`processing_class=` of `grpo.train` (a tokenizer: saved and used as `tokenizer_config`), or "
        "`tokenizer_config`; a multimodal processor is refused",
    ),
    (
        "peft_config",
        "`peft_config=` of `grpo.train` (a `peft.LoraConfig`: its r, lora_alpha, lora_dropout and target_modules "
        'become `adapter = "lora"`, `lora_r`, ...; options grpo does not build are refused by name)',
    ),
    ("rollout_func", "`rollout_func=` of `grpo.train`, or `trl.rollout_func`"),
    ("tools", "`tools=` of `grpo.train`, or `trl.tools`"),
    ("environment_factory", "`environment_factory=` of `grpo.train`, or `trl.environment_factory`"),
    ("callbacks", "not taken: grpo plugins observe a run through hooks (`grpo_step_end`, ...; CONTRIBUTING.md)"),
    ("optimizers", "not taken: `optimizer`, `learning_rate`, `lr_scheduler` and friends in the config"),
    ("reward_processing_classes", "not taken: a reward model loads its own tokenizer from its folder or hub id"),
]


def rows() -> list[tuple[str, str, str]]:
    import trl
    from transformers import TrainingArguments
    from trl import GRPOConfig as TrlGRPOConfig

    from grpo_core.config.trl_names import schema_field

    for name, key in RENAMES.items():
        if schema_field(key) is None:
            raise SystemExit(f"RENAMES maps {name} to {key}, which grpo's schema does not have")
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(TrlGRPOConfig) if f.name not in inherited]
    base = [f.name for f in dataclasses.fields(TrainingArguments) if grpo_key(f.name) is not None]
    out = []
    for name in [*own, *base, "reward_funcs"]:
        key = grpo_key(name)
        if name in ELSEWHERE:
            out.append((name, f"`{key}`" if key else "—", ELSEWHERE[name]))
        elif key is not None:
            description = getattr(schema_field(key), "description", None) or ""
            out.append((name, f"`{key}`", re.split(r"\.\s+(?=[A-Z])", description)[0].rstrip(".")))
        else:
            out.append((name, "—", "not in grpo"))
    del trl
    return out


def render() -> str:
    import trl

    lines = [
        f"| TRL {trl.__version__} `GRPOConfig` field | grpo key | note |",
        "| --- | --- | --- |",
        *(f"| `{name}` | {key} | {note.replace('|', '/')} |" for name, key, note in rows()),
    ]
    return "\n".join(lines)


def readme_with_table(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{README} has no {START} marker")
    return f"{head}{START}\n{render()}\n{END}{tail}"


# ------------------------------------------------------------ differences


def _trl_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def _grpo_default(key: str) -> Any:
    """grpo's value for ``key`` in a config that sets nothing else (vLLM
    options judged with ``trl.use_vllm = true``, in colocate mode for the
    colocated engine's memory)."""
    from grpo_core.config.loader import validate

    trl = {"use_vllm": True, **({"vllm_mode": "colocate"} if key == "vllm.gpu_memory_utilization" else {})}
    cfg: Any = validate({"base_model": "org/model", "trl": trl})
    for part in re.sub(r"\[\d+\]", "", key).split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def _same(trl_value: Any, grpo_value: Any, name: str) -> bool:
    if grpo_value is None and name in SAME_WHEN_UNSET:
        return True
    if isinstance(grpo_value, Path):
        grpo_value = str(grpo_value)
    if isinstance(trl_value, (int, float)) and isinstance(grpo_value, (int, float)) and not isinstance(trl_value, bool):
        return float(trl_value) == float(grpo_value)
    return trl_value == grpo_value or str(trl_value) == str(grpo_value)


def differences() -> list[tuple[str, Any, str, Any]]:
    """(TRL field, TRL default, grpo key, grpo default) for every field whose defaults differ."""
    from trl import GRPOConfig as TrlGRPOConfig

    out = []
    for field in dataclasses.fields(TrlGRPOConfig):
        key = grpo_key(field.name)
        if key is None or field.name in ("use_vllm", "vllm_importance_sampling_cap", "reward_funcs", *EQUIVALENT):
            continue  # use_vllm: set for the comparison; cap: TRL's deprecated alias of clip_max
        trl_value, grpo_value = _trl_default(field), _grpo_default(key)
        if field.name == "bf16" and trl_value is None:
            trl_value = "None (true unless fp16)"
        if not _same(trl_value, grpo_value, field.name):
            out.append((field.name, trl_value, key, grpo_value))
    return out


def _code(value: Any) -> str:
    if isinstance(value, Path):
        value = str(value)
    return f"`{value!r}`" if isinstance(value, str) and not value.startswith("None (") else f"`{value}`"


def render_differences() -> str:
    import trl

    missing = [name for name, *_ in differences() if name not in WHY]
    if missing:
        raise SystemExit(f"defaults differ without a reason in WHY: {missing}")
    lines = [
        "# grpo for TRL users: where the defaults differ",
        "",
        "<!-- Generated by `python scripts/trl_mapping.py --write`;",
        "tests/test_trl_mapping.py fails when it is stale. -->",
        "",
        "grpo keeps the option names and defaults of the reference GRPO guide",
        "(`shared/reference/grpo-training-seed.md`), which mostly follow TRL's `GRPOConfig`. Where a default",
        f"is not TRL {trl.__version__}'s, it is listed here with why and what to write to keep TRL's value.",
        "`grpo config check` prints the differences that matter for a run in its summary (`vs TRL:`: batch,",
        "steps, scheduler, precision, completion length, vLLM mode, checkpoints, gradient checkpointing)",
        "for the keys a config leaves unset, and `grpo config convert` writes TRL's values into the TOML it",
        "makes from a `trl grpo --config` YAML, so a converted config trains as TRL would.",
        "",
        f"| TRL {trl.__version__} field and default | grpo key | grpo default | why, and TRL's value in grpo |",
        "| --- | --- | --- | --- |",
    ]
    for name, trl_value, key, grpo_value in differences():
        lines.append(f"| `{name}` = {_code(trl_value)} | `{key}` | {_code(grpo_value)} | {WHY[name]} |")
    lines += [
        "",
        "Every other `GRPOConfig` field grpo has takes TRL's default (docs/from-trl.md maps every name).",
        "`vllm_gpu_memory_utilization` (grpo: `vllm.gpu_memory_utilization`) is among them:",
        f"{WHY['vllm_gpu_memory_utilization']}.",
        "",
        "## Names",
        "",
        "A TRL name in a grpo config is answered with its grpo key (`grpo config check`:",
        "\"'per_device_train_batch_size' is TRL's name for grpo's 'micro_batch_size'\"). The renamed fields:",
        "",
        "| TRL | grpo |",
        "| --- | --- |",
        *(f"| `{name}` | `{key}` |" for name, key in RENAMES.items()),
        "",
        "The `trl grpo` command's own arguments (`ScriptArguments`, `ModelConfig`), as `grpo config convert`",
        "reads them from a `trl grpo --config` YAML:",
        "",
        "| `trl grpo` argument | in grpo |",
        "| --- | --- |",
        *(f"| `{name}` | {script.write} |" for name, script in SCRIPT_KEYS.items()),
        "",
        "## `GRPOTrainer` arguments and `grpo.train`",
        "",
        "| `GRPOTrainer(...)` argument | in grpo |",
        "| --- | --- |",
        *(f"| `{name}` | {where} |" for name, where in GRPO_TRAINER_ARGUMENTS),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
        DIFFERENCES.write_text(render_differences(), encoding="utf-8")
        print(f"wrote the TRL mapping table into {README} and the defaults into {DIFFERENCES}")
    else:
        print(render())

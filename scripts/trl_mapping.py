"""The generated tables of docs/from-trl.md: TRL's fields -> grpo keys, every
default grpo sets otherwise than TRL (with why), the `trl grpo` command's
arguments and `GRPOTrainer`'s. One page holds them, each between its markers.

Generated from both schemas so they stay true: the rows are TRL's own
``GRPOConfig`` fields (read from the installed ``trl``) and the
``TrainingArguments`` fields grpo has a key for; the grpo column is checked
against grpo's schema (a renamed or removed key fails here, not in a user's
script). The names TRL and grpo spell differently live in
``grpo_core/config/trl_names.py``, which the config loader also uses to
answer a TRL name with its grpo key. ``tests/unit/test_trl_mapping.py`` fails
when a table of docs/from-trl.md is out of date, or when a default differs
without a word about why.

    python scripts/trl_mapping.py          # print the mapping table
    python scripts/trl_mapping.py --write  # rewrite every generated table in docs/from-trl.md
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from grpo_core.config.trl_names import RENAMES, SCRIPT_KEYS, grpo_key

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "docs" / "from-trl.md"  # the generated tables' page (the name is the script's history)
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
        "the reference guide's default: one completion per forward/backward pass per process. A step trains "
        "`micro_batch_size x gradient_accumulation_steps x processes` completions, which must be whole groups of "
        "`trl.num_generations` (8 by default) unless `trl.generation_batch_size` says otherwise, so `grpo config "
        "check` refuses 1 with the default 8 generations, naming the keys; write `micro_batch_size = 8` for TRL's "
        "batch"
    ),
    "num_train_epochs": (
        "grpo trains `max_steps` optimizer steps unless `num_epochs` (TRL's `num_train_epochs`) is set and "
        "`max_steps` is not (then `max_steps = ceil(num_epochs x prompts / prompts per step) x num_iterations`, as "
        "in Axolotl); write `num_epochs = 3` and leave `max_steps` out for TRL's length"
    ),
    "max_steps": "the reference guide's 100 steps; `num_epochs` counts steps from the dataset instead",
    "lr_scheduler_type": (
        "the reference guide's cosine decay to 0 over `max_steps` after `warmup_steps`; write "
        '`lr_scheduler = "linear"` for TRL\'s'
    ),
    "optim": (
        "the reference guide's key with PyTorch's plain AdamW, which runs on CPUs as well (the same update); "
        '`optimizer = "adamw_torch_fused"` is TRL\'s'
    ),
    "bf16": (
        'float32 unless asked: `bf16 = true` computes in bf16 (float32 trained weights and optimizer state), `"auto"` '
        "only where the hardware has native bf16 (an AVX2 CPU emulates it, several times slower than float32); "
        "TRL's `None` means true unless `fp16`"
    ),
    "gradient_checkpointing": (
        "off: recomputing activations costs time (TRL's own estimate: ~20% of a step) and turns off grpo's shared "
        "prompt prefix (`share_prompt_prefix`, each prompt of a group through the model once); turn it on when "
        "memory is short"
    ),
    "logging_steps": "every step: a GRPO step is slow enough that each one's reward is worth a `metrics.jsonl` line",
    "save_steps": (
        "a GRPO run is often shorter than 500 steps (the reference guide's are 100-200), so TRL's interval would "
        "write no checkpoint before the end; 50 loses at most 50 steps to a crash. `save_steps = 0` keeps only the "
        "checkpoints at the end and on a fault or signal (`grpo config check` warns for a run longer than 50 steps)"
    ),
    "max_completion_length": (
        'the reference guide leaves it unset ("TRL\'s default"); grpo fills in 256, sized for one machine, often a '
        "CPU, where sampling time grows with every token a completion may run to; write "
        "`trl.max_completion_length = 512` for TRL's"
    ),
    "vllm_mode": (
        "grpo starts and owns a vLLM server by default and talks to it over HTTP (one command; the trainer process "
        'needs no vLLM and keeps its GPU to itself); `trl.vllm_mode = "colocate"` runs vLLM in the trainer\'s '
        "process as TRL does"
    ),
    "vllm_gpu_memory_utilization": (
        "the same 0.3 as TRL's in colocate mode, where the key is the share of the trainer's own GPU vLLM takes "
        "(`grpo config check` warns above 0.5); a server grpo starts has its GPU to itself and takes 0.85, the "
        "reference guide's (TRL's `trl vllm-serve` takes 0.9), and a managed server placed on the trainer's GPU "
        "above 0.5 is refused"
    ),
    "ref_model_mixup_alpha": "the reference guide's 0.9 (used only with `sync_ref_model`)",
    "ref_model_sync_steps": "the reference guide's 64 (used only with `sync_ref_model`)",
    "vllm_importance_sampling_mode": (
        "the reference guide leaves it unset; grpo fills in per-token truncation (TIS): a sequence mask drops a "
        "whole completion when the product of its per-token ratios passes the cap, which a product over hundreds "
        "of tokens does easily, losing learning signal in groups of a few completions. "
        '`trl.vllm_importance_sampling_mode = "sequence_mask"` for TRL\'s'
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


def _marked(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def readme_with_table(text: str) -> str:
    """docs/from-trl.md's text with every generated table (between its
    markers) rendered anew."""
    for name, body in SECTIONS.items():
        start, end = _marked(name)
        head, _, rest = text.partition(start)
        _, found, tail = rest.partition(end)
        if not rest or not found:
            raise SystemExit(f"{README} has no {start} ... {end} markers")
        text = f"{head}{start}\n{body()}\n{end}{tail}"
    return text


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


# Defaults that differ only in some configs (the table compares a config that sets nothing), said after it.
ALSO = {
    "eval_strategy": (
        "`eval_strategy` (TRL: `'no'`) is `'steps'` once there is evaluation data (`val_set_size`, "
        "`[[test_datasets]]`): held-out prompts are evaluated every `eval_steps` (default `logging_steps`) and at the "
        "end, and `'no'` without them"
    ),
    "vllm_importance_sampling_correction": (
        "`trl.vllm_importance_sampling_correction` (TRL: `True`) follows `trl.use_vllm`: without vLLM the trained "
        "model samples its own completions, so there is no sampler mismatch to correct; with vLLM it is on, as in TRL"
    ),
}


def render_differences() -> str:
    """The table of every default that differs from TRL's, with why."""
    import trl

    missing = [name for name, *_ in differences() if name not in WHY]
    if missing:
        raise SystemExit(f"defaults differ without a reason in WHY: {missing}")
    lines = [
        f"| TRL {trl.__version__} field and default | grpo key | grpo default | why, and TRL's value in grpo |",
        "| --- | --- | --- | --- |",
    ]
    for name, trl_value, key, grpo_value in differences():
        lines.append(f"| `{name}` = {_code(trl_value)} | `{key}` | {_code(grpo_value)} | {WHY[name]} |")
    lines += [
        "",
        "Every other `GRPOConfig` field grpo has takes TRL's default. `vllm_gpu_memory_utilization` (grpo:",
        f"`vllm.gpu_memory_utilization`) is among them: {WHY['vllm_gpu_memory_utilization']}.",
        *(f"{sentence[0].upper()}{sentence[1:]}." for sentence in ALSO.values()),
    ]
    return "\n".join(lines)


def render_script_arguments() -> str:
    """The `trl grpo` command's own arguments, as `grpo config convert` reads them."""
    return "\n".join(
        [
            "| `trl grpo` argument | in grpo |",
            "| --- | --- |",
            *(f"| `{name}` | {script.write} |" for name, script in SCRIPT_KEYS.items()),
        ]
    )


def render_trainer_arguments() -> str:
    """`GRPOTrainer`'s arguments and where each goes in grpo."""
    return "\n".join(
        [
            "| `GRPOTrainer(...)` argument | in grpo |",
            "| --- | --- |",
            *(f"| `{name}` | {where} |" for name, where in GRPO_TRAINER_ARGUMENTS),
        ]
    )


SECTIONS = {
    "trl-differences": render_differences,
    "trl-script-arguments": render_script_arguments,
    "trl-trainer-arguments": render_trainer_arguments,
    "trl-mapping": render,
}


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote the generated TRL tables into {README}")
    else:
        print(render())

"""The DeepSpeed JSON that ``deepspeed`` names, read, and what in it grpo
cannot run as it says: judged by the config checks before anything starts,
filled by the ZeRO backend (:mod:`grpo_core.parallel.zero`) when it builds
accelerate's plugin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError
from grpo_core.modeling.precision import resolve_precision

SUPPORTED_STAGES = (2, 3)
KEY = "deepspeed"


def read_config(path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f'{KEY} = "{path}": cannot read the DeepSpeed config ({exc.strerror}). Point `{KEY}` at a JSON file.'
        ) from None
    except ValueError as exc:
        raise ConfigError(f'{KEY} = "{path}" is not valid JSON ({exc}). Fix the file.') from None
    if not isinstance(raw, dict):
        raise ConfigError(f'{KEY} = "{path}" must hold a JSON object.')
    return raw


def is_auto(value: Any) -> bool:
    return value == "auto"


def precision_flags(cfg: GRPOConfig) -> tuple[bool, bool]:
    """(bf16, fp16) compute as grpo resolves it on this machine."""
    dtype = resolve_precision(cfg).compute_dtype
    return dtype == torch.bfloat16, dtype == torch.float16


INTEGER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
NUMBER_KEYS = ("gradient_clipping",)
SECTIONS = ("zero_optimization", "bf16", "fp16")


def _is_count(value: Any, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0 and (value == int(value) if integer else value == value and value != float("inf"))


def shape_problems(where: str, raw: dict[str, Any]) -> list[str]:
    """Values of the wrong kind: a section that is not an object, a count or
    a number that is neither a number nor "auto" (DeepSpeed would fail on
    them later, or grpo's own comparisons would)."""
    problems = []
    for section in SECTIONS:
        if section in raw and not isinstance(raw[section], dict):
            problems.append(f'{where}: "{section}" must be an object ({{...}}), not {json.dumps(raw[section])}.')
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    for offload in ("offload_optimizer", "offload_param"):
        if offload in zero and zero[offload] is not None and not isinstance(zero[offload], dict):
            problems.append(f'{where}: zero_optimization.{offload} must be an object ({{"device": ...}}).')
    checks = [(key, raw.get(key), key in INTEGER_KEYS) for key in (*INTEGER_KEYS, *NUMBER_KEYS)]
    checks += [(f"zero_optimization.{key}", zero.get(key), True) for key in ("stage", *HIDDEN_SIZE_AUTOS)]
    for key, value, integer in checks:
        if value is not None and not is_auto(value) and not _is_count(value, integer):
            kind = "a whole number" if integer else "a number"
            problems.append(f'{where}: {key} = {json.dumps(value)} must be {kind} (>= 0) or "auto".')
    return problems


def config_problems(cfg: GRPOConfig, raw: dict[str, Any]) -> list[str]:
    """What in the DeepSpeed JSON grpo cannot run as it says, each with its fix."""
    where = f'{KEY} = "{cfg.deepspeed}"'
    problems = shape_problems(where, raw)
    if problems:  # the rules below read these values
        return problems
    zero = raw.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage not in SUPPORTED_STAGES:
        problems.append(
            f"{where}: zero_optimization.stage is {stage!r}; grpo runs DeepSpeed ZeRO stage 2 or 3 (set "
            '"zero_optimization": {"stage": 2} or 3; for plain data parallelism leave `deepspeed` unset).'
        )
    for section, fix in (("optimizer", "grpo's `optimizer` / `learning_rate`"), ("scheduler", "grpo's `lr_scheduler`")):
        if section in raw:
            problems.append(
                f'{where}: remove its "{section}" section; grpo builds the {section} ({fix}) and '
                "DeepSpeed must not step a second one."
            )
    if isinstance(zero, dict):
        for offload in ("offload_optimizer", "offload_param"):
            device = (zero.get(offload) or {}).get("device", "none")
            if device not in (None, "none"):
                problems.append(
                    f'{where}: zero_optimization.{offload}.device = "{device}" is not supported (DeepSpeed\'s '
                    "CPU-offload optimizer is a compiled extension grpo has not run); remove the offload, or use "
                    'fsdp = ["full_shard", "auto_wrap", "offload"].'
                )
    micro = raw.get("train_micro_batch_size_per_gpu")
    if micro is not None and not is_auto(micro) and int(micro) != cfg.micro_batch_size:
        problems.append(
            f"{where}: train_micro_batch_size_per_gpu = {micro} but micro_batch_size = {cfg.micro_batch_size}: "
            'set it to "auto" (grpo fills it in).'
        )
    gas = raw.get("gradient_accumulation_steps")
    if gas is not None and not is_auto(gas) and int(gas) != cfg.gradient_accumulation_steps:
        problems.append(
            f"{where}: gradient_accumulation_steps = {gas} but grpo's is {cfg.gradient_accumulation_steps}: "
            'set it to "auto" (grpo drives the accumulation).'
        )
    if raw.get("train_batch_size") not in (None, "auto"):
        problems.append(f'{where}: set train_batch_size to "auto" (grpo\'s micro_batch_size x processes fills it).')
    clip = raw.get("gradient_clipping")
    if clip is not None and not is_auto(clip) and float(clip) != float(cfg.max_grad_norm or 0.0):
        problems.append(
            f'{where}: gradient_clipping = {clip} but max_grad_norm = {cfg.max_grad_norm}: set it to "auto" '
            "(grpo fills in max_grad_norm)."
        )
    fillable = {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "bf16.enabled",
        "fp16.enabled",
        *(f"zero_optimization.{k}" for k in HIDDEN_SIZE_AUTOS),
    }
    unfillable = [key for key in autos(raw) if key not in fillable]
    if unfillable:
        problems.append(f'{where}: grpo cannot fill {", ".join(unfillable)} = "auto": replace them with numbers.')
    bf16, fp16 = precision_flags(cfg)
    for name, wanted in (("bf16", bf16), ("fp16", fp16)):
        enabled = (raw.get(name) or {}).get("enabled")
        if enabled is not None and not is_auto(enabled) and bool(enabled) != wanted:
            problems.append(
                f"{where}: {name}.enabled = {str(enabled).lower()} but grpo's precision computes in "
                f'{"bf16" if bf16 else "fp16" if fp16 else "float32"}: set it to "auto" (or set grpo\'s {name}).'
            )
    return problems


HIDDEN_SIZE_AUTOS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in autos(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if is_auto(node) else []

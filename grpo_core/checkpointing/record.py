"""How a checkpoint was made, and whether this config can resume it.

Every checkpoint records the settings its weights depend on (``made_with`` in
``manifest.json``): the base model (as configured, and its architecture from
its ``config.json``), full fine-tuning or LoRA with its rank, alpha and
target modules, the vocabulary size (embedding rows), the precision and the
number of training processes. :func:`check_resume` compares them with the
config before the model loads, so a resume with ``lora_r = 16`` of a
checkpoint saved with ``lora_r = 8`` is one message naming each difference
and what to do, not a ``state_dict`` size mismatch minutes later.

A checkpoint written before the record existed is compared on what its files
say themselves (``model/adapter_config.json``: LoRA or not, rank, alpha,
target modules named explicitly), and resumes when those agree.

Differences that make the saved weights unusable or change what they mean
(base model architecture, full vs LoRA, rank, alpha, target modules,
vocabulary size, DeepSpeed partitions over another process count) refuse the
resume; precision and another process count otherwise (both resume
correctly) are warnings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core import __version__
from grpo_core.checkpointing.integrity import read_manifest
from grpo_core.contract.errors import GrpoError
from grpo_core.modeling.precision import resolve_precision

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

RECORD_KEY = "made_with"
"""The name under which the run's :class:`RunRecord` travels with the
plugins' state to :func:`~grpo_core.checkpointing.checkpoint.save_checkpoint`,
which writes it into ``manifest.json`` (not ``extra_state.pt``)."""

FACT_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def base_model_facts(model_dir: str | Path) -> dict[str, Any] | None:
    """The architecture of the model in ``model_dir`` from its ``config.json``
    (``None`` when it is not a local directory with one)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return {key: config.get(key, text.get(key)) for key in FACT_KEYS}


def _lora_targets(cfg: GRPOConfig) -> dict[str, Any]:
    return {
        "lora_target_linear": bool(cfg.lora_target_linear),
        "lora_target_modules": sorted(cfg.lora_target_modules) if cfg.lora_target_modules else None,
    }


def describe(cfg: GRPOConfig, model_dir: str | Path, world: int) -> dict[str, Any]:
    """What ``cfg`` trains, as a checkpoint records it (the vocabulary size
    comes from the loaded model, :class:`RunRecord`)."""
    precision = resolve_precision(cfg)
    record: dict[str, Any] = {
        "grpo_version": __version__,
        "base_model": cfg.base_model,
        "base_model_facts": base_model_facts(model_dir),
        "adapter": "lora" if cfg.adapter == "lora" else "full",
        "precision": {
            "load": str(precision.load_dtype).removeprefix("torch."),
            "compute": str(precision.compute_dtype or "torch.float32").removeprefix("torch."),
            "reason": precision.reason,
        },
        "world_size": int(world),
        "deepspeed": bool(cfg.deepspeed),
    }
    if cfg.adapter == "lora":
        record.update(lora_r=int(cfg.lora_r), lora_alpha=int(cfg.lora_alpha), **_lora_targets(cfg))
    return record


def embedding_rows(model: Any) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, ValueError):
        return None


class RunRecord:
    """The record as a checkpointed state (:class:`~grpo_core.contract.types.Checkpointable`):
    the loop saves it with the plugins' state, so it needs no change of its own."""

    def __init__(self, described: dict[str, Any], model: Any) -> None:
        self.described = described
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {**self.described, "vocab_size": embedding_rows(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: :func:`check_resume` compared it before the model loaded."""


def recorded(path: Path) -> dict[str, Any] | None:
    """Checkpoint ``path``'s record, or ``None`` (written before grpo kept one)."""
    manifest = read_manifest(path)
    made = manifest.get(RECORD_KEY) if manifest else None
    return made if isinstance(made, dict) else None


def _from_files(path: Path) -> dict[str, Any]:
    """What an older checkpoint's files say about how it was made."""
    adapter = path / "model" / "adapter_config.json"
    if not adapter.is_file():
        weights = list((path / "model").glob("*.safetensors")) if (path / "model").is_dir() else []
        return {"adapter": "full"} if weights else {}
    try:
        config = json.loads(adapter.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {"adapter": "lora"}
    found: dict[str, Any] = {"adapter": "lora"}
    if isinstance(config.get("r"), int):
        found["lora_r"] = config["r"]
    if isinstance(config.get("lora_alpha"), int | float):
        found["lora_alpha"] = int(config["lora_alpha"])
    targets = config.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        found["resolved_targets"] = sorted(targets)
    return found


def differences(
    made: dict[str, Any],
    cfg: GRPOConfig,
    model_dir: str | Path,
    vocab_rows: int | None,
    world: int,
) -> tuple[list[str], list[str]]:
    """(refusals, warnings): each difference between how a checkpoint was
    made and what ``cfg`` trains, with what to do."""
    now = describe(cfg, model_dir, world)
    refuse: list[str] = []
    warn: list[str] = []
    if "base_model" in made and made["base_model"] != cfg.base_model:
        then_facts, now_facts = made.get("base_model_facts"), now["base_model_facts"]
        if then_facts and now_facts and then_facts == now_facts:
            warn.append(
                f"base_model was '{made['base_model']}' when the checkpoint was saved and is '{cfg.base_model}' now; "
                "their architecture and vocabulary match, so resuming (make sure it holds the same weights)"
            )
        else:
            shown = f" ({then_facts} then, {now_facts} now)" if then_facts and now_facts else ""
            refuse.append(
                f"base_model: the checkpoint was trained from '{made['base_model']}', this config names "
                f"'{cfg.base_model}'{shown}. Set base_model = \"{made['base_model']}\""
            )
    if made.get("adapter") and made["adapter"] != now["adapter"]:
        if made["adapter"] == "lora":
            refuse.append(
                'adapter: the checkpoint holds a LoRA adapter, this config trains the full model. Set adapter = "lora" '
                "with the checkpoint's lora_r, lora_alpha and target modules"
            )
        else:
            refuse.append(
                "adapter: the checkpoint holds full model weights, this config trains a LoRA adapter. Remove `adapter` "
                "to resume it (or start a new LoRA run with base_model = the checkpoint's model/ folder)"
            )
    elif made.get("adapter") == "lora" and now["adapter"] == "lora":
        for key in ("lora_r", "lora_alpha"):
            if key in made and made[key] != now[key]:
                refuse.append(
                    f"{key}: the checkpoint was saved with {key} = {made[key]}, this config has {now[key]}. "
                    f"Set {key} = {made[key]} to resume it"
                )
        if "lora_target_linear" in made:
            then = {k: made.get(k) for k in ("lora_target_linear", "lora_target_modules")}
            here = {k: now[k] for k in ("lora_target_linear", "lora_target_modules")}
            if then != here:
                refuse.append(
                    f"LoRA target modules: the checkpoint was saved with lora_target_linear = "
                    f"{str(then['lora_target_linear']).lower()}, lora_target_modules = {then['lora_target_modules']}; "
                    f"this config has {str(here['lora_target_linear']).lower()}, {here['lora_target_modules']}. Set "
                    "them as they were"
                )
        elif "resolved_targets" in made and cfg.lora_target_modules and not cfg.lora_target_linear:
            if sorted(made["resolved_targets"]) != sorted(cfg.lora_target_modules):
                refuse.append(
                    f"lora_target_modules: the checkpoint's adapter targets {made['resolved_targets']}, this config "
                    f"{sorted(cfg.lora_target_modules)}. Set lora_target_modules = {made['resolved_targets']}"
                )
    if isinstance(made.get("vocab_size"), int) and vocab_rows is not None and made["vocab_size"] != vocab_rows:
        refuse.append(
            f"vocabulary: the checkpoint's model has {made['vocab_size']} embedding rows, this config's tokenizer and "
            f"base model give {vocab_rows}. Use the tokenizer (tokenizer_config) and special_tokens it was saved with"
        )
    if made.get("deepspeed") and isinstance(made.get("world_size"), int) and made["world_size"] != world:
        refuse.append(
            f"processes: the checkpoint holds DeepSpeed ZeRO partitions of {made['world_size']} process(es), this run "
            f"has {world}. Resume with --num-processes {made['world_size']}"
        )
    elif isinstance(made.get("world_size"), int) and made["world_size"] != world:
        warn.append(
            f"the checkpoint was saved by {made['world_size']} process(es), this run has {world}: the weights and "
            "optimizer state load into the new layout (keep the global batch: gradient_accumulation_steps x processes)"
        )
    then_precision, now_precision = made.get("precision"), now["precision"]
    if isinstance(then_precision, dict) and any(then_precision.get(k) != now_precision[k] for k in ("load", "compute")):
        warn.append(
            f"precision: the checkpoint was trained with {then_precision.get('reason', then_precision)}; this run "
            f"uses {now_precision['reason']}. The weights load either way; set bf16/fp16 as they were for the same "
            "numerics"
        )
    return refuse, warn


def expected_rows(model_dir: str | Path, tokenizer: Any) -> int | None:
    """The embedding rows the policy will have: the base model's vocabulary,
    grown to the tokenizer's length when special tokens were added."""
    facts = base_model_facts(model_dir)
    base = facts.get("vocab_size") if facts else None
    size = len(tokenizer) if tokenizer is not None else None
    if isinstance(base, int) and size is not None:
        return max(base, size)
    return None


def check_resume(path: Path, cfg: GRPOConfig, model_dir: str | Path, tokenizer: Any, world: int) -> list[str]:
    """Refuse to resume checkpoint ``path`` with a config that does not match
    how it was made, naming every difference; return the warnings."""
    made = recorded(path) or _from_files(path)
    refuse, warn = differences(made, cfg, model_dir, expected_rows(model_dir, tokenizer), world)
    if refuse:
        raise GrpoError(
            f'resume_from_checkpoint = "{path}" does not match this config: '
            + "; ".join(f"({i}) {line}" for i, line in enumerate(refuse, 1))
            + ". Or start without resume_from_checkpoint to train from the base model with these settings."
        )
    return warn

"""``fsdp`` / ``fsdp_config`` as the config spells them (Axolotl's and the HF
Trainer's names), and what in them cannot run: judged by the config checks
before anything starts, read by the FSDP backend
(:mod:`grpo_core.parallel.sharding`) when it builds accelerate's plugin.
"""

from __future__ import annotations

from typing import Any

from grpo_core.config.schema import GRPOConfig

FSDP_OPTIONS = {"full_shard", "shard_grad_op", "auto_wrap", "offload"}
FSDP_REFUSED = {
    "hybrid_shard": (
        "hybrid sharding needs a 2-D device mesh (shard within a node, replicate across nodes), which is not wired"
    ),
    "hybrid_shard_zero2": "hybrid sharding needs a 2-D device mesh, which is not wired",
    "no_shard": "FSDP without sharding is DDP: leave `fsdp` unset",
}
FSDP_CONFIG_KEYS = {
    "fsdp_version",
    "version",
    "fsdp_transformer_layer_cls_to_wrap",
    "transformer_layer_cls_to_wrap",
    "fsdp_offload_params",
    "offload_params",
    "fsdp_reshard_after_forward",
    "reshard_after_forward",
    "fsdp_activation_checkpointing",
    "activation_checkpointing",
    "fsdp_cpu_ram_efficient_loading",
    "cpu_ram_efficient_loading",
    "fsdp_state_dict_type",
    "state_dict_type",
    "fsdp_auto_wrap_policy",
    "auto_wrap_policy",
    "fsdp_sync_module_states",
    "sync_module_states",
    "fsdp_use_orig_params",
    "use_orig_params",
}


BOOLEAN_KEYS = (
    "offload_params",
    "reshard_after_forward",
    "activation_checkpointing",
    "cpu_ram_efficient_loading",
    "sync_module_states",
    "use_orig_params",
)
TEXT_KEYS = ("state_dict_type", "auto_wrap_policy")


def _kind_problems(options: dict[str, Any]) -> list[str]:
    """``fsdp_config`` values of the wrong kind: a string where true/false
    is meant (``bool("false")`` is true), a class list that is not text."""
    problems = []
    for key, value in options.items():
        name = key.removeprefix("fsdp_")
        if name in BOOLEAN_KEYS and not isinstance(value, bool):
            problems.append(f"fsdp_config.{key} = {value!r}: write true or false.")
        elif name in TEXT_KEYS and not isinstance(value, str):
            problems.append(f"fsdp_config.{key} = {value!r}: it must be a string.")
        elif name == "transformer_layer_cls_to_wrap" and not (
            isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        ):
            problems.append(f"fsdp_config.{key} = {value!r}: name the layer classes as a string or a list of strings.")
    return problems


def fsdp_value(cfg: GRPOConfig, name: str, default: Any = None) -> Any:
    """``fsdp_config.fsdp_<name>`` or ``fsdp_config.<name>`` (both spellings exist in the wild)."""
    options = cfg.fsdp_config or {}
    return options.get(f"fsdp_{name}", options.get(name, default))


def fsdp_problems(cfg: GRPOConfig) -> list[str]:
    """What in ``fsdp`` / ``fsdp_config`` cannot run, each with its fix."""
    problems = []
    for option in cfg.fsdp or []:
        if option in FSDP_REFUSED:
            problems.append(f"fsdp option '{option}': {FSDP_REFUSED[option]}.")
        elif option not in FSDP_OPTIONS:
            problems.append(f"fsdp option '{option}' is unknown: use {', '.join(sorted(FSDP_OPTIONS))}.")
    unknown = sorted(set(cfg.fsdp_config or {}) - FSDP_CONFIG_KEYS)
    if unknown:
        problems.append(
            f"fsdp_config keys {unknown} are not supported; known: "
            f"{', '.join(sorted(k for k in FSDP_CONFIG_KEYS if k.startswith('fsdp_')))}."
        )
    problems += _kind_problems(cfg.fsdp_config or {})
    if cfg.fsdp_config and not cfg.fsdp:
        problems.append(
            'fsdp_config is set but fsdp is not: set fsdp = ["full_shard", "auto_wrap"] to shard the model.'
        )
    raw_version = fsdp_value(cfg, "version", 2) or 2
    version = raw_version if isinstance(raw_version, int) and not isinstance(raw_version, bool) else None
    if isinstance(raw_version, str) and raw_version.strip().isdigit():
        version = int(raw_version)
    if version not in (1, 2):
        problems.append(f"fsdp_config.fsdp_version = {raw_version!r}: use 2 (torch's fully_shard) or 1.")
    policy = str(fsdp_value(cfg, "auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
        problems.append(f"fsdp_config.fsdp_auto_wrap_policy = {policy}: use TRANSFORMER_BASED_WRAP.")
    if cfg.fsdp and cfg.deepspeed:
        problems.append("fsdp and deepspeed are both set: choose one way of sharding the model.")
    return problems

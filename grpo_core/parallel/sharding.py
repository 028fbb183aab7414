"""``fsdp`` / ``fsdp_config`` / ``deepspeed``: accelerate's plugins from the config.

FSDP goes through accelerate's :class:`~accelerate.utils.FullyShardedDataParallelPlugin`
(FSDP2, torch's ``fully_shard``, unless ``fsdp_config.fsdp_version = 1``),
with the options the reference (Axolotl / HF Trainer) spells:

* ``fsdp = ["full_shard", "auto_wrap"]``: shard parameters, gradients and
  optimizer state; wrap each transformer layer (``shard_grad_op`` keeps the
  parameters gathered between forward and backward; ``offload`` puts the
  shards in CPU memory).
* ``fsdp_config``: ``fsdp_transformer_layer_cls_to_wrap`` (default: the
  model's own ``_no_split_modules``), ``fsdp_version``,
  ``fsdp_offload_params``, ``fsdp_reshard_after_forward``,
  ``fsdp_activation_checkpointing``, ``fsdp_cpu_ram_efficient_loading``,
  ``fsdp_state_dict_type`` (checkpoints are always written as full weights),
  ``fsdp_auto_wrap_policy`` (``TRANSFORMER_BASED_WRAP``). Any other key is
  refused by name.

accelerate turns FSDP on only for GPU-type backends; on CPU (gloo) grpo
marks the accelerator's state as FSDP itself so accelerate's own FSDP2 path
runs there too (torch's ``fully_shard`` supports gloo): that is how the
2-process CPU tests run it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Protocol

from grpo_core.config.fsdp_options import fsdp_problems, fsdp_value
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError, GrpoError


def fsdp_plugin(cfg: GRPOConfig) -> Any:
    """accelerate's FSDP plugin for ``cfg.fsdp`` / ``cfg.fsdp_config``."""
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate.utils import FullyShardedDataParallelPlugin

    problems = fsdp_problems(cfg)
    if problems:
        raise ConfigError(" ".join(problems))
    options = set(cfg.fsdp or [])
    version = int(fsdp_value(cfg, "version", 2) or 2)
    layers = fsdp_value(cfg, "transformer_layer_cls_to_wrap")
    if isinstance(layers, str):
        layers = [name.strip() for name in layers.split(",") if name.strip()]
    reshard = fsdp_value(cfg, "reshard_after_forward", "shard_grad_op" not in options)
    kwargs: dict[str, Any] = {
        "fsdp_version": version,
        "cpu_offload": bool(fsdp_value(cfg, "offload_params", "offload" in options)),
        "activation_checkpointing": bool(fsdp_value(cfg, "activation_checkpointing", False)),
        "cpu_ram_efficient_loading": bool(fsdp_value(cfg, "cpu_ram_efficient_loading", False)),
        "state_dict_type": "FULL_STATE_DICT",
    }
    if "auto_wrap" in options:
        kwargs["auto_wrap_policy"] = "transformer_based_wrap"
        if layers:
            kwargs["transformer_cls_names_to_wrap"] = list(layers)
    if version == 2:
        kwargs["reshard_after_forward"] = bool(reshard)
    else:
        kwargs["sharding_strategy"] = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        kwargs["use_orig_params"] = True  # LoRA: frozen and trained parameters share flat parameters
        kwargs["sync_module_states"] = True
    return FullyShardedDataParallelPlugin(**kwargs)


def enable_fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """accelerate enables FSDP only for GPU-type backends: on CPU (gloo) mark
    its state FSDP with ``plugin`` so ``prepare`` takes accelerate's own FSDP path."""
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate.utils import DistributedType

    if plugin is not None and accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin


class FullCopy(Protocol):
    """Rank 0's unsharded copy of a sharded policy (FSDP's :class:`FullWeights`,
    ZeRO-3's ``Zero3FullWeights``): what syncs, checkpoints and, for a
    rollout that samples the trainer's model, generation use."""

    copy: Any  # the full model on rank 0; None on the other ranks

    def refresh(self, accelerator: Any, forward: Any, version: int) -> Any:
        """Gather policy ``version`` into the copy (a collective: every rank calls it); return the copy."""


class FullWeights:
    """Rank 0's unsharded copy of the policy, refreshed from the shards on
    demand: what weight syncs and checkpoints see under FSDP/ZeRO-3.

    Made before the model is sharded (a CPU copy on rank 0 only); each
    refresh gathers the full state dict once (a collective: every rank
    calls :meth:`refresh`) and loads it into the copy on rank 0."""

    def __init__(self, policy: Any, main: bool) -> None:
        self.main = main
        self.copy = copy.deepcopy(policy).to("cpu") if main else None
        self.version = -1

    def refresh(self, accelerator: Any, forward: Any, version: int) -> Any:
        if version == self.version:
            return self.copy
        # heavy (torch): loaded on first use, not with this module
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # a collective: full tensors on rank 0 (what accelerate's get_state_dict does for FSDP2)
        state = get_model_state_dict(forward, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.main:
            inner = {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
            missing, unexpected = self.copy.load_state_dict(inner, strict=False)
            if unexpected or [k for k in missing if "lm_head" not in k]:
                raise RuntimeError(
                    f"gathered weights do not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
        self.version = version
        return self.copy


def sampling_copy(full: FullCopy, device: Any) -> Any:
    """Rank 0's full copy (:class:`FullWeights` or ZeRO-3's) as the model a
    rollout samples under FSDP/ZeRO-3, where the shards cannot generate on
    one rank: placed on ``device`` (generation on a GPU needs the weights
    there: one whole model beside rank 0's shard, as TRL's unwrapping for
    generation costs) and refreshed by every weight sync, so it holds the
    policy the sync reported. ``None`` on the other ranks (they never sample)."""
    if full.copy is not None:
        full.copy.to(device)
    return full.copy


@contextlib.contextmanager
def unsharded(forward: Any, policy: Any) -> Iterator[Any]:
    """*Collective.* Every FSDP2 unit of ``forward`` unsharded for the block,
    yielding ``policy`` (whose weights are then whole on this rank).

    Each unit is all-gathered once on entry (every rank, in the same module
    order) and kept whole through any number of forwards: FSDP2 otherwise
    reshards a unit after its forward and all-gathers it again at the next,
    which would hold every rank in lock-step for every generated token (and
    hang when ranks generate different numbers of steps). ``generate`` runs
    the policy, not the root module, so the root's own parameters (embedding,
    final norm) are unsharded here too. Resharding on exit is local. The
    "no reshard after forward" switch is set on FSDP2's parameter groups and
    put back as it was (``post_forward_mesh_info``: torch's internal; the
    public ``set_reshard_after_forward`` cannot restore the root's default),
    and the root is marked as such first (``_lazy_init``, also internal)."""
    # heavy (torch.distributed.fsdp): loaded on first use, not with this module
    from torch.distributed.fsdp import FSDPModule

    units, seen = [], set()
    for module in forward.modules():
        if isinstance(module, FSDPModule) and id(state := module._get_fsdp_state()) not in seen:
            seen.add(id(state))
            units.append((module, list(state._fsdp_param_groups)))
    saved = [(group, group.post_forward_mesh_info) for _, groups in units for group in groups]
    # Before any training forward, FSDP2 has not yet marked its root: a unit's own forward would then
    # take itself for the root and break the next real one. The root's lazy init (idempotent) marks it.
    if units:
        units[0][0]._get_fsdp_state()._lazy_init()
    try:
        for module, _ in units:
            module.unshard()
        for group, _ in saved:
            group.post_forward_mesh_info = None
        yield policy
    finally:
        for group, info in saved:
            group.post_forward_mesh_info = info
        for module, _ in units:
            module.reshard()


# ----------------------------------------------------------------------------- sharded checkpoints


def full_optimizer_state(forward: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer state with full (unsharded) tensors keyed by parameter
    name, on rank 0 (a collective: every rank calls it). Full tensors load
    onto any process count: into another FSDP run as they are, into an
    unsharded one (one process, DDP) through :func:`optimizer_state_by_index`."""
    # heavy (torch): loaded on first use, not with this module
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(forward, getattr(optimizer, "optimizer", optimizer), options=options)


def load_full_optimizer_state(forward: Any, optimizer: Any, state: dict[str, Any]) -> None:
    # heavy (torch): loaded on first use, not with this module
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(
        forward, getattr(optimizer, "optimizer", optimizer), optim_state_dict=state, options=options
    )


_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _optimized_parameter_names(forward: Any, optimizer: Any) -> list[list[str]]:
    """The name of each parameter ``optimizer`` updates, group by group in
    its ``param_groups`` order (the position an index-keyed state uses), as
    torch's distributed state dicts name it: DDP's leading ``module.`` and
    compile/FSDP1/checkpointing wrapper parts dropped."""
    names: dict[int, str] = {}
    for name, param in forward.named_parameters():
        name = name[len("module.") :] if name.startswith("module.") else name
        names[id(param)] = ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)
    inner = getattr(optimizer, "optimizer", optimizer)
    return [[names[id(p)] for p in group["params"]] for group in inner.param_groups]


def _keyed_by_name(state: dict[str, Any]) -> bool:
    return any(isinstance(p, str) for group in state.get("param_groups", []) for p in group["params"])


def _another_model(detail: str) -> GrpoError:
    return GrpoError(
        f"the checkpoint's optimizer state does not fit this run's trained parameters ({detail}): it was saved by a "
        "run of another model or adapter (resume with the config that wrote it)."
    )


def optimizer_state_by_name(forward: Any, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` keyed by parameter name, for a sharded run: an unsharded
    checkpoint (one process, DDP) keys it by position in ``param_groups``
    (``Optimizer.state_dict``), the position this run's optimizer has too
    (the same model built the same way)."""
    if _keyed_by_name(state):
        return state
    groups = _optimized_parameter_names(forward, optimizer)
    saved = [len(group["params"]) for group in state["param_groups"]]
    if saved != [len(names) for names in groups]:
        raise _another_model(f"parameters per group: {saved} saved, {[len(n) for n in groups]} here")
    names = [name for group in groups for name in group]
    return {
        "state": {names[k]: v for k, v in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def optimizer_state_by_index(forward: Any, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` keyed by position in ``param_groups``, for an unsharded run
    (one process, DDP): a sharded checkpoint (FSDP) keys it by parameter
    name. Matched by name; ``Optimizer.load_state_dict`` then pairs
    parameters by position, so each group lists this optimizer's own order."""
    if not _keyed_by_name(state):
        return state
    groups = _optimized_parameter_names(forward, optimizer)
    if [set(g["params"]) for g in state["param_groups"]] != [set(names) for names in groups]:
        unknown = sorted(
            {p for g in state["param_groups"] for p in g["params"]} - {n for names in groups for n in names}
        )
        raise _another_model(f"e.g. {unknown[:2]}" if unknown else "the groups differ")
    position = {name: i for i, name in enumerate(name for names in groups for name in names)}
    return {
        "state": {position[k]: v for k, v in state["state"].items()},
        "param_groups": [
            {**saved, "params": [position[n] for n in names]} for saved, names in zip(state["param_groups"], groups)
        ],
    }


def load_full_model_state(forward: Any, state: dict[str, Any] | None) -> None:
    """Rank 0's full weights (as the policy names them; None on the other
    ranks) into the shards of every rank."""
    # heavy (torch): loaded on first use, not with this module
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    full = {f"policy.{k}": v for k, v in (state or {}).items()}
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=True)
    set_model_state_dict(forward, full, options=options)

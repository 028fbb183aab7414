"""``deepspeed``: DeepSpeed ZeRO-2 / ZeRO-3 through accelerate, with grpo's step.

The user's DeepSpeed JSON goes to accelerate's ``DeepSpeedPlugin`` (accelerate
imports deepspeed when it prepares the model; grpo_core never does). Its
``"auto"`` values are filled from grpo's config, as the HF Trainer does:
``train_micro_batch_size_per_gpu`` = ``micro_batch_size``, ``gradient_clipping``
= ``max_grad_norm``, ``bf16.enabled`` / ``fp16.enabled`` from grpo's precision.

grpo, not DeepSpeed, decides what a step is. All ranks agree which micro-batches
have no learning signal and skip them together, and the ``policy_loss``
implementation already divides each micro-batch's loss by the global token
count (or the accumulation count). DeepSpeed's own gradient accumulation
would divide the loss again by its ``gradient_accumulation_steps`` and step
on its own micro-step counter, so the engine is configured with
``gradient_accumulation_steps = 1`` and :class:`DeepSpeedStep` drives it:

* before each trained micro-batch's backward, the accumulation boundary is
  set explicitly (``set_gradient_accumulation_boundary``): true only on the
  step's last *trained* micro-batch, so the reduction happens once, after it;
* ``engine.backward(loss, scale_wrt_gas=False)``: the loss is not rescaled;
* ``engine.step()`` once per optimizer step, only when a micro-batch was
  trained (a step that trained nothing leaves the engine alone);
* the engine clips (``gradient_clipping``) and reports the pre-clip global
  norm (``get_global_grad_norm``), logged as ``grad_norm``;
* the learning rate stays grpo's schedule (:func:`~grpo_core.optimization.optimizer.advance_schedule`
  over the optimizer's parameter groups); a DeepSpeed ``scheduler`` or
  ``optimizer`` section is refused, so nothing steps the rate twice.

ZeRO-3 partitions the parameters: weight syncs and checkpoints read rank 0's
full copy (:class:`Zero3FullWeights`), gathered once per policy version with
DeepSpeed's consolidated state dict (a collective every rank joins; with LoRA
only the trainable adapter is gathered, the frozen base never changes).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from grpo_core.checkpointing.safe_load import safe_load
from grpo_core.config.schema import GRPOConfig
from grpo_core.config.zero_stage import (
    zero_stage as zero_stage,  # re-exported: read in the config layer, below the checks
)
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.parallel.build_lock import remove_stale_lock
from grpo_core.parallel.deepspeed_file import (
    HIDDEN_SIZE_AUTOS,
    KEY,
    autos,
    config_problems,
    is_auto,
    precision_flags,
    read_config,
)


def engine_config(cfg: GRPOConfig, world: int) -> dict[str, Any]:
    """The JSON with every grpo-owned value filled (see the module docstring)."""
    raw = read_config(str(cfg.deepspeed))
    problems = config_problems(cfg, raw)
    if problems:
        raise ConfigError(" ".join(problems))
    out = copy.deepcopy(raw)
    out["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    out["gradient_accumulation_steps"] = 1  # grpo sets the boundary itself (DeepSpeedStep)
    out["train_batch_size"] = cfg.micro_batch_size * world
    out["gradient_clipping"] = float(cfg.max_grad_norm or 0.0)  # 0: DeepSpeed does not clip
    bf16, fp16 = precision_flags(cfg)
    out["bf16"] = {**(raw.get("bf16") or {}), "enabled": bf16}
    out["fp16"] = {**(raw.get("fp16") or {}), "enabled": fp16}
    out.setdefault("steps_per_print", 10**9)  # DeepSpeed's own step log: grpo logs the steps
    out.setdefault("wall_clock_breakdown", False)
    return out


def fill_model_autos(config: dict[str, Any], model_config: Any) -> None:
    """Fill the ``"auto"`` bucket sizes from the model's hidden size (accelerate
    would, but it reads them from the prepared module, grpo's log-prob
    wrapper, which has no ``config``); refuse any ``"auto"`` left."""
    zero = config.get("zero_optimization") or {}
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    for key, value in HIDDEN_SIZE_AUTOS.items():
        if is_auto(zero.get(key)) and hidden:
            zero[key] = value(hidden)
    left = autos(config)
    if left:
        raise ConfigError(
            f'`{KEY}`: grpo cannot fill {", ".join(left)} = "auto" in the DeepSpeed config: replace them with numbers.'
        )


def deepspeed_plugin(cfg: GRPOConfig, world: int) -> Any:
    """accelerate's ``DeepSpeedPlugin`` over the filled config. ``zero3_init_flag``
    stays off: each process loads the model whole and the engine partitions
    it (rank 0 first keeps a CPU copy for syncs and checkpoints)."""
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=engine_config(cfg, world), zero3_init_flag=False)


def accelerator_kwargs(world: int) -> dict[str, Any]:
    """What accelerate needs besides the plugin to run DeepSpeed without GPUs.

    accelerate drops the DeepSpeed plugin when told ``cpu=True``, and without
    it picks no backend on a machine without GPUs (each process would then
    think it is alone). So on CPU it is given gloo explicitly and DeepSpeed
    joins the launcher's processes with it. A single process (no launcher)
    joins a process group of one here: DeepSpeed needs one and would
    otherwise look for MPI."""
    cuda = torch.cuda.is_available()
    if not cuda:  # DeepSpeed compiles its CPU collective when the group starts: a dead build's lock would hang it
        remove_stale_lock()
    if world == 1 and not torch.distributed.is_initialized():
        with socket.socket() as sock:  # a free port for the group of one
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
        os.environ.setdefault("LOCAL_RANK", "0")  # the engine asserts a launcher set it
        return {}  # accelerate then sees one process (its own rank bookkeeping), DeepSpeed finds the group
    if cuda:
        return {}
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate.utils import InitProcessGroupKwargs

    return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


# ----------------------------------------------------------------------------- the step


class DeepSpeedStep:
    """Backward and optimizer step through the DeepSpeed engine, on grpo's terms."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: Any, last: bool) -> None:
        """``last``: this is the step's last trained micro-batch (the
        accumulation boundary, where ZeRO reduces the gradients)."""
        self.engine.set_gradient_accumulation_boundary(bool(last))
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip (``gradient_clipping``), step and zero the gradients; the pre-clip global norm."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm.item() if hasattr(norm, "item") else (norm or 0.0))

    # checkpoints: DeepSpeed's own files (each rank's partition of the fp32
    # weights and optimizer state), inside grpo's atomic checkpoint directory

    def save(self, directory: Path, trainable_only: bool) -> None:
        """Every rank writes its partition into ``directory`` (a collective)."""
        self.engine.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            client_state={},
            save_latest=False,
            exclude_frozen_parameters=trainable_only,
        )

    def load(self, directory: Path) -> None:
        """Every rank reads its partition back (weights, fp32 masters, optimizer state)."""
        check_files(directory)
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise GrpoError(f"DeepSpeed found no checkpoint in {directory}: resume from another checkpoint.")


CHECKPOINT_DIR = "deepspeed"
CHECKPOINT_TAG = "zero"


def check_files(directory: Path) -> None:
    """DeepSpeed reads its files with the full unpickler (code could run):
    each is first read with grpo's restricted one (:mod:`grpo_core.checkpointing.safe_load`),
    which admits tensors, plain data and DeepSpeed's own few plain records."""
    files = sorted((directory / CHECKPOINT_TAG).glob("*.pt"))
    if not files:
        raise GrpoError(f"{directory} holds no DeepSpeed checkpoint files: resume from another checkpoint.")
    for file in files:
        safe_load(file, allow=deepspeed_record_types())


DEEPSPEED_RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""What DeepSpeed's ZeRO-2/3 checkpoint files hold besides tensors and plain
data: plain classes rebuilt from their attributes (no custom unpickling) and
an int enum."""


def deepspeed_record_types() -> list[Any]:
    """The classes of :data:`DEEPSPEED_RECORDS`, taken from the modules the
    running engine already imported (grpo_core imports no deepspeed)."""
    found = []
    for name in DEEPSPEED_RECORDS:
        module, _, attr = name.rpartition(".")
        obj = getattr(sys.modules.get(module), attr, None)
        if obj is not None:
            found.append(obj)
    return found


@contextlib.contextmanager
def gathered_for_generation(engine: Any, policy: Any) -> Iterator[Any]:
    """*Collective.* Every ZeRO-3 parameter of ``engine`` gathered whole on
    this rank for the block, yielding ``policy``: what TRL's
    ``unwrap_model_for_generation`` does with DeepSpeed's ``GatheredParameters``.

    The engine's own fetch/release hooks are taken off meanwhile (each
    module's forward would otherwise release its parameters after it ran
    and all-gather them at the next, holding every rank in lock-step per
    generated token), then put back, and the parameters partitioned again.
    grpo_core never imports deepspeed, so this calls the objects' own
    methods (``param.all_gather``/``partition``, the parameter offload's
    hook registration), as DeepSpeed's context and TRL's
    ``remove_hooks``/``add_hooks`` do."""
    params = sorted(
        {id(p): p for p in engine.module.parameters() if hasattr(p, "ds_id")}.values(), key=lambda p: p.ds_id
    )
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    if params:
        params[0].all_gather(param_list=params)  # the same order on every rank: by ds_id
    for param in params:
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield policy
    finally:
        coordinator = getattr(offload, "param_coordinator", None)
        if coordinator is not None and not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()  # the generation's module order is not training's
        offload._register_deepspeed_module(offload.module)
        if params:
            params[0].partition(param_list=params, has_been_updated=False)


class Zero3FullWeights:
    """Rank 0's full copy of the policy under ZeRO-3 (the parameters are
    partitioned over the ranks): the same role as :class:`~grpo_core.parallel.sharding.FullWeights`
    under FSDP. Made before the engine partitions the model."""

    def __init__(self, policy: Any, main: bool, trainable_only: bool) -> None:
        self.main = main
        self.copy = copy.deepcopy(policy).to("cpu") if main else None
        self.trainable_only = trainable_only  # LoRA: the frozen base never changes; gather the adapter only
        self.version = -1

    def refresh(self, accelerator: Any, forward: Any, version: int) -> Any:
        if version == self.version:
            return self.copy
        # a collective: every rank gathers each layer's partitions; rank 0 receives the full tensors
        state = forward._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=self.trainable_only)
        if self.main:
            inner = {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
            if not inner:
                raise RuntimeError("ZeRO-3 gathered no weights of the policy")
            missing, unexpected = self.copy.load_state_dict(inner, strict=False)
            if unexpected or (not self.trainable_only and [k for k in missing if "lm_head" not in k]):
                raise RuntimeError(
                    f"gathered weights do not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
        self.version = version
        return self.copy

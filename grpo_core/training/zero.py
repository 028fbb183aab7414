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
* the learning rate stays grpo's schedule (:func:`~grpo_core.training.optim.advance_schedule`
  over the optimizer's parameter groups); a DeepSpeed ``scheduler`` or
  ``optimizer`` section is refused, so nothing steps the rate twice.

ZeRO-3 partitions the parameters: weight syncs and checkpoints read rank 0's
full copy (:class:`Zero3FullWeights`), gathered once per policy version with
DeepSpeed's consolidated state dict (a collective every rank joins; with LoRA
only the trainable adapter is gathered, the frozen base never changes).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from grpo_core.config.schema import GRPOConfig
from grpo_core.config.zero_stage import zero_stage as zero_stage  # re-exported: read in the config layer, below the checks
from grpo_core.errors import ConfigError, GrpoError

SUPPORTED_STAGES = (2, 3)
KEY = "deepspeed"


def read_config(path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{KEY} = \"{path}\": cannot read the DeepSpeed config ({exc.strerror}). Point `{KEY}` at a JSON file.") from None
    except ValueError as exc:
        raise ConfigError(f"{KEY} = \"{path}\" is not valid JSON ({exc}). Fix the file.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{KEY} = \"{path}\" must hold a JSON object.")
    return raw


def _is_auto(value: Any) -> bool:
    return value == "auto"


def _precision_flags(cfg: GRPOConfig) -> tuple[bool, bool]:
    """(bf16, fp16) compute as grpo resolves it on this machine."""
    import torch

    from grpo_core.precision import resolve_precision

    dtype = resolve_precision(cfg).compute_dtype
    return dtype == torch.bfloat16, dtype == torch.float16


def config_problems(cfg: GRPOConfig, raw: dict[str, Any]) -> list[str]:
    """What in the DeepSpeed JSON grpo cannot run as it says, each with its fix."""
    problems = []
    where = f"{KEY} = \"{cfg.deepspeed}\""
    zero = raw.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage not in SUPPORTED_STAGES:
        problems.append(f"{where}: zero_optimization.stage is {stage!r}; grpo runs DeepSpeed ZeRO stage 2 or 3 (set "
                        "\"zero_optimization\": {\"stage\": 2} or 3; for plain data parallelism leave `deepspeed` unset).")  # fmt: skip
    for section, fix in (("optimizer", "grpo's `optimizer` / `learning_rate`"), ("scheduler", "grpo's `lr_scheduler`")):
        if section in raw:
            problems.append(f"{where}: remove its \"{section}\" section; grpo builds the {section} ({fix}) and "
                            "DeepSpeed must not step a second one.")  # fmt: skip
    if isinstance(zero, dict):
        for offload in ("offload_optimizer", "offload_param"):
            device = (zero.get(offload) or {}).get("device", "none")
            if device not in (None, "none"):
                problems.append(f"{where}: zero_optimization.{offload}.device = \"{device}\" is not supported (DeepSpeed's "
                                "CPU-offload optimizer is a compiled extension grpo has not run); remove the offload, or use "
                                "fsdp = [\"full_shard\", \"auto_wrap\", \"offload\"].")  # fmt: skip
    micro = raw.get("train_micro_batch_size_per_gpu")
    if micro is not None and not _is_auto(micro) and int(micro) != cfg.micro_batch_size:
        problems.append(f"{where}: train_micro_batch_size_per_gpu = {micro} but micro_batch_size = {cfg.micro_batch_size}: "
                        "set it to \"auto\" (grpo fills it in).")  # fmt: skip
    gas = raw.get("gradient_accumulation_steps")
    if gas is not None and not _is_auto(gas) and int(gas) != cfg.gradient_accumulation_steps:
        problems.append(f"{where}: gradient_accumulation_steps = {gas} but grpo's is {cfg.gradient_accumulation_steps}: "
                        "set it to \"auto\" (grpo drives the accumulation).")  # fmt: skip
    if raw.get("train_batch_size") not in (None, "auto"):
        problems.append(f"{where}: set train_batch_size to \"auto\" (grpo's micro_batch_size x processes fills it).")
    clip = raw.get("gradient_clipping")
    if clip is not None and not _is_auto(clip) and float(clip) != float(cfg.max_grad_norm or 0.0):
        problems.append(f"{where}: gradient_clipping = {clip} but max_grad_norm = {cfg.max_grad_norm}: set it to \"auto\" "
                        "(grpo fills in max_grad_norm).")  # fmt: skip
    fillable = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
                "bf16.enabled", "fp16.enabled", *(f"zero_optimization.{k}" for k in HIDDEN_SIZE_AUTOS)}  # fmt: skip
    unfillable = [key for key in _autos(raw) if key not in fillable]
    if unfillable:
        problems.append(f"{where}: grpo cannot fill {', '.join(unfillable)} = \"auto\": replace them with numbers.")
    bf16, fp16 = _precision_flags(cfg)
    for name, wanted in (("bf16", bf16), ("fp16", fp16)):
        enabled = (raw.get(name) or {}).get("enabled")
        if enabled is not None and not _is_auto(enabled) and bool(enabled) != wanted:
            problems.append(f"{where}: {name}.enabled = {str(enabled).lower()} but grpo's precision computes in "
                            f"{'bf16' if bf16 else 'fp16' if fp16 else 'float32'}: set it to \"auto\" (or set grpo's {name}).")  # fmt: skip
    return problems


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
    bf16, fp16 = _precision_flags(cfg)
    out["bf16"] = {**(raw.get("bf16") or {}), "enabled": bf16}
    out["fp16"] = {**(raw.get("fp16") or {}), "enabled": fp16}
    out.setdefault("steps_per_print", 10**9)  # DeepSpeed's own step log: grpo logs the steps
    out.setdefault("wall_clock_breakdown", False)
    return out


HIDDEN_SIZE_AUTOS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def fill_model_autos(config: dict[str, Any], model_config: Any) -> None:
    """Fill the ``"auto"`` bucket sizes from the model's hidden size (accelerate
    would, but it reads them from the prepared module, grpo's log-prob
    wrapper, which has no ``config``); refuse any ``"auto"`` left."""
    zero = config.get("zero_optimization") or {}
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    for key, value in HIDDEN_SIZE_AUTOS.items():
        if _is_auto(zero.get(key)) and hidden:
            zero[key] = value(hidden)
    left = _autos(config)
    if left:
        raise ConfigError(f"`{KEY}`: grpo cannot fill {', '.join(left)} = \"auto\" in the DeepSpeed config: "
                          "replace them with numbers.")  # fmt: skip


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _autos(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if _is_auto(node) else []


def deepspeed_plugin(cfg: GRPOConfig, world: int) -> Any:
    """accelerate's ``DeepSpeedPlugin`` over the filled config. ``zero3_init_flag``
    stays off: each process loads the model whole and the engine partitions
    it (rank 0 first keeps a CPU copy for syncs and checkpoints)."""
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
    import torch

    cuda = torch.cuda.is_available()
    if world == 1 and not torch.distributed.is_initialized():
        import socket

        with socket.socket() as sock:  # a free port for the group of one
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                             world_size=1)  # fmt: skip
        os.environ.setdefault("LOCAL_RANK", "0")  # the engine asserts a launcher set it
        return {}  # accelerate then sees one process (its own rank bookkeeping), DeepSpeed finds the group
    if cuda:
        return {}
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
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={}, save_latest=False,
                                    exclude_frozen_parameters=trainable_only)  # fmt: skip

    def load(self, directory: Path) -> None:
        """Every rank reads its partition back (weights, fp32 masters, optimizer state)."""
        check_files(directory)
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_module_strict=False,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)  # fmt: skip
        if path is None:
            raise GrpoError(f"DeepSpeed found no checkpoint in {directory}: resume from another checkpoint.")


CHECKPOINT_DIR = "deepspeed"
CHECKPOINT_TAG = "zero"


def check_files(directory: Path) -> None:
    """DeepSpeed reads its files with the full unpickler (code could run):
    each is first read with grpo's restricted one (:mod:`grpo_core.training.safe_load`),
    which admits tensors, plain data and DeepSpeed's own few plain records."""
    from grpo_core.training.safe_load import safe_load

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
    import sys

    found = []
    for name in DEEPSPEED_RECORDS:
        module, _, attr = name.rpartition(".")
        obj = getattr(sys.modules.get(module), attr, None)
        if obj is not None:
            found.append(obj)
    return found


def engine_of(accelerator: Any, forward: Any) -> Any | None:
    """The DeepSpeed engine when this run uses one (the prepared module), else None."""
    kind = getattr(accelerator, "distributed_type", None)
    return forward if getattr(kind, "value", kind) == "DEEPSPEED" else None


class Zero3FullWeights:
    """Rank 0's full copy of the policy under ZeRO-3 (the parameters are
    partitioned over the ranks): the same role as :class:`~grpo_core.training.sharding.FullWeights`
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
            inner = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
            if not inner:
                raise RuntimeError("ZeRO-3 gathered no weights of the policy")
            missing, unexpected = self.copy.load_state_dict(inner, strict=False)
            if unexpected or (not self.trainable_only and [k for k in missing if "lm_head" not in k]):
                raise RuntimeError(f"gathered weights do not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.version = version
        return self.copy

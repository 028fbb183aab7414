"""DeepSpeed ZeRO-2 / ZeRO-3 through accelerate, stepped on grpo's terms
(:mod:`grpo_core.parallel.zero` says how the engine is configured and why it
never accumulates or schedules on its own).

The engine owns backward, clipping and the step. ZeRO-3 partitions the
parameters, so rank 0 keeps a full copy (:class:`~grpo_core.parallel.zero.Zero3FullWeights`)
for syncs, saves and sampling on rank 0 alone (evaluation); a rollout that
generates on every rank samples with the parameters gathered for the call
(:func:`~grpo_core.parallel.zero.gathered_for_generation`). Under ZeRO-2
every rank holds them whole. A
checkpoint holds DeepSpeed's own per-rank partitions (weights, fp32 masters,
optimizer state) beside grpo's full ``model/``: it resumes onto the same
process count only, which :data:`~grpo_core.parallel.base.PARTITIONED_KEY`
records.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar

import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.host.traits import ChosenTraits
from grpo_core.optimization.policy_forward import inner_policy
from grpo_core.parallel import zero
from grpo_core.parallel.base import (
    PARTITIONED_KEY,
    CheckpointParts,
    StateOf,
    prepare_with_accelerate,
)
from grpo_core.parallel.deepspeed_file import config_problems, read_config
from grpo_core.parallel.sharding import sampling_copy


class DeepSpeedBackend:
    name: ClassVar[str] = "deepspeed"

    @classmethod
    def applies(cls, cfg: GRPOConfig, world: int) -> bool:
        return bool(cfg.deepspeed)

    @classmethod
    def describe(cls, cfg: GRPOConfig, world: int) -> str:
        stage = zero.zero_stage(cfg)
        return f"DeepSpeed ZeRO-{stage if stage is not None else '?'} ({cfg.deepspeed})"

    @classmethod
    def config_problems(cls, cfg: GRPOConfig, traits: ChosenTraits) -> list[str]:
        """What in the DeepSpeed JSON grpo cannot run as written, and, under
        ZeRO-3 (partitioned parameters), what needs the whole model in one process."""
        if not cfg.deepspeed:
            return []
        try:
            problems = config_problems(cfg, read_config(cfg.deepspeed))
        except ConfigError as exc:
            return [str(exc)]
        if traits.loss_uses_hidden_states:
            problems.append(
                f"policy_loss '{traits.names['policy_loss']}' with deepspeed: a loss that fuses the LM head "
                "runs the decoder outside the DeepSpeed engine's forward, which is not wired; use the built-in "
                "loss (trl.use_liger_loss = false), or fsdp."
            )
        if cfg.fp8:
            problems.append(
                "fp8 with deepspeed: accelerate's fp8 path under DeepSpeed (MS-AMP / Transformer Engine) is "
                "not wired; set fp8 = false, or use fp8 without deepspeed."
            )
        if zero.zero_stage(cfg) != 3:
            return problems
        if float(cfg.trl.beta or 0) > 0:
            problems.append(
                "deepspeed ZeRO-3 with trl.beta > 0: the KL reference model is not partitioned (not "
                "implemented); set trl.beta = 0, or use ZeRO stage 2."
            )
        if (cfg.gradient_checkpointing_kwargs or {}).get("use_reentrant") is False:
            problems.append(
                "DeepSpeed ZeRO-3 with gradient_checkpointing_kwargs.use_reentrant = false fails during "
                "recomputation (CheckpointError): set use_reentrant = true."
            )
        return problems

    @classmethod
    def accelerator_kwargs(cls, cfg: GRPOConfig, world: int) -> dict[str, Any]:
        # accelerate ignores the plugin when told cpu=True: without GPUs it joins the processes over gloo itself
        return {"deepspeed_plugin": zero.deepspeed_plugin(cfg, world), **zero.accelerator_kwargs(world)}

    def __init__(self, cfg: GRPOConfig, accelerator: Any) -> None:
        # Under ZeRO-3 accelerate leaves transformers believing it should load the model already
        # partitioned (zero.Init); grpo loads it whole (rank 0 copies it first) and the engine partitions it.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        self.accelerator = accelerator
        self.stage3 = zero.zero_stage(cfg) == 3
        self.trainable_only = cfg.adapter == "lora"  # LoRA: the frozen base never changes
        self.world = int(accelerator.num_processes)
        self.full: zero.Zero3FullWeights | None = None
        self.policy: Any = None
        self.step_driver: zero.DeepSpeedStep | None = None

    def prepare(self, policy: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        zero.fill_model_autos(self.accelerator.state.deepspeed_plugin.deepspeed_config, policy.config)
        if self.stage3:  # partitioned parameters: rank 0 keeps a full copy for syncs and saves
            self.full = zero.Zero3FullWeights(
                policy, self.accelerator.is_main_process, trainable_only=self.trainable_only
            )
        forward, optimizer = prepare_with_accelerate(self.accelerator, policy, optimizer)
        self.policy = inner_policy(forward)
        self.step_driver = zero.DeepSpeedStep(forward)  # the prepared module is the engine
        return forward, optimizer

    @property
    def _engine(self) -> zero.DeepSpeedStep:
        assert self.step_driver is not None, "prepare() first"
        return self.step_driver

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self._engine.backward(loss, last)

    def optimizer_step(self, max_grad_norm: float | None) -> float:
        return self._engine.step()  # the engine clips with its gradient_clipping (= max_grad_norm)

    def full_model(self, version: int) -> Any:
        if self.full is None:  # ZeRO-2: every rank holds the parameters whole
            return self.policy
        return self.full.refresh(self.accelerator, self._engine.engine, version)

    def sampling_model(self, device: Any) -> Any:
        return self.policy if self.full is None else sampling_copy(self.full, device)

    @classmethod
    def gathers_for_generation(cls, cfg: GRPOConfig) -> bool:
        return True

    def generation_model(self) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-2: every rank holds the parameters whole; ZeRO-3: gathered for the block."""
        if not self.stage3:
            return contextlib.nullcontext(self.policy)
        return zero.gathered_for_generation(self._engine.engine, self.policy)

    def checkpoint_parts(self, staging: Path, version: int) -> CheckpointParts:
        """Every rank writes its partition under ``staging`` (moved into the
        checkpoint by rank 0), then rank 0 takes the full weights."""
        self._engine.save(staging, trainable_only=self.trainable_only)
        if self.world > 1:
            torch.distributed.barrier()  # every partition is on disk before rank 0 moves the folder
        return CheckpointParts(
            model=self.full_model(version),
            optimizer=StateOf({"deepspeed": f"{zero.CHECKPOINT_DIR}/ (per-rank ZeRO partitions)"}),
            staged={zero.CHECKPOINT_DIR: staging},
            extra={PARTITIONED_KEY: self.world},
        )

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint) -> None:
        """Each rank reads its ZeRO partition back; the optimizer state is
        there, not in optimizer.pt (only the same process count fits)."""
        saved = loaded.extra.get(PARTITIONED_KEY)
        if saved is None or not (path / zero.CHECKPOINT_DIR).is_dir():
            raise GrpoError(
                f'resume_from_checkpoint = "{path}" was not written with `deepspeed`: its weights and '
                "optimizer state are not in DeepSpeed's layout. Resume it without `deepspeed` (same sharding "
                "as when it was written), or start this DeepSpeed run without resume_from_checkpoint."
            )
        if int(saved) != self.world:
            raise GrpoError(
                f'resume_from_checkpoint = "{path}" holds DeepSpeed ZeRO partitions of {saved} process(es) '
                f"and this run has {self.world}: resume with --num-processes {saved}. (Its model/ "
                "folder holds the full weights: start a new run from them as base_model to change the count.)"
            )
        self._engine.load(path / zero.CHECKPOINT_DIR)
        loaded.optimizer = None  # restored with the partitions

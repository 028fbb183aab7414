"""``grpo run``: build every part of a run from the config, then train.

Order matters for the user: everything cheap that can fail (config checks,
plugin resolution, dataset loading, reward columns) happens before the model
loads or a server starts, so a typo costs seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.config.schema import GRPOConfig
from grpo_core.context import RunContext
from grpo_core.errors import StorageError, TrainingInterrupted
from grpo_core.plugin_host import PluginHost
from grpo_core.training import checkpoint as ckpt
from grpo_core.training.producer import PrefetchingProducer, PromptStream, RolloutProducer, sampling_from_config
from grpo_core.training.selection import chosen_implementations
from grpo_core.types import TrainingProgress


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def apply_precision_flags(cfg: GRPOConfig) -> None:
    """``tf32``: TensorFloat-32 matmuls on Ampere+ GPUs (no effect on CPU)."""
    if cfg.tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
        torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)


def prompts_per_batch(cfg: GRPOConfig) -> int:
    generation_batch = cfg.trl.generation_batch_size or cfg.micro_batch_size * cfg.gradient_accumulation_steps
    return max(1, generation_batch // int(cfg.trl.num_generations))  # type: ignore[arg-type]


OUTPUT_PROBE_BYTES = 1 << 20
"""What :func:`check_output_dir` writes: less than the smallest checkpoint
(a small LoRA adapter, a tokenizer.json), so a disk without that much room
fails at start instead of at the first save, hours later."""


def check_output_dir(output_dir: Path) -> None:
    """Fail before training, not at the first checkpoint, if output_dir is unusable."""
    probe = output_dir / ".grpo-write-test"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(bytes(OUTPUT_PROBE_BYTES))
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise StorageError(
            f"output_dir {output_dir} is not writable: {exc}. Choose another `output_dir`, or make room there "
            f"(a run writes checkpoints; the check writes {OUTPUT_PROBE_BYTES >> 20} MiB)."
        ) from None


def run_training(cfg: GRPOConfig, host: PluginHost | None = None) -> str:
    """Train per ``cfg``; return the final status (``completed``)."""
    from grpo_core.data import common_columns, load_prompts
    from grpo_core.model_files import resolve_model_dir
    from grpo_core.models import load_policy, load_tokenizer, reference_model, save_final
    from grpo_core.rewards import RewardScorer
    from grpo_core.training.optim import build_optimizer, build_scheduler
    from grpo_core.training.trainer import GRPOTrainer, TrainerParts

    host = host or PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None)
    host.load_always_on()
    output_dir = Path(cfg.output_dir)
    check_output_dir(output_dir)
    seed_everything(cfg.seed)
    apply_precision_flags(cfg)

    context = RunContext(config=cfg, output_dir=output_dir)
    for action in ckpt.recover_interrupted_saves(output_dir):
        context.log(action)
    model_dir = resolve_model_dir(cfg.base_model)
    context.services["model_dir"] = model_dir
    tokenizer = load_tokenizer(cfg, model_dir)
    context.tokenizer = tokenizer

    scorer = RewardScorer(cfg, host, context)
    prompts = load_prompts(cfg, tokenizer)
    if not cfg.trl.rollout_func:  # a rollout_func may add per-completion fields
        scorer.check_columns(common_columns(prompts))

    # Engines start before the model loads: a managed vLLM server boots while
    # the trainer's model is read from disk.
    chosen = chosen_implementations(cfg)
    implementations: dict[str, Any] = {}
    model_holder: dict[str, Any] = {}
    context.get_model = lambda: model_holder.get("model")
    status = "failed"
    try:
        for point in ("rollout", "weight_sync", "advantage_aggregation", "is_correction", "replay"):
            implementations[point] = host.load_implementation(point, chosen[point], context)

        # accelerate places the model and optimizer on the run's device (GPU
        # where there is one) and owns backward / gradient clipping.
        from accelerate import Accelerator

        accelerator = Accelerator()
        # Everything above fails in seconds; from here on a fault costs a model load.
        context.log(f"loading model from {model_dir}")
        model = load_policy(cfg, model_dir, tokenizer)
        optimizer = build_optimizer(cfg, model)
        model, optimizer = accelerator.prepare(model, optimizer)
        model_holder["model"] = model
        reference = reference_model(cfg, model_dir, model)  # None unless beta > 0
        if reference is not None and hasattr(reference, "model"):
            reference.model.to(accelerator.device)
        scheduler = build_scheduler(cfg, optimizer)

        stream = PromptStream(prompts, cfg.seed, cfg.shuffle_dataset)
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        producer: Any = RolloutProducer(
            cfg,
            host.hook,
            scorer,
            stream,
            prompts_per_batch(cfg),
            sampling_from_config(cfg, stop_ids),
            policy_version=lambda: int(context.services.get("policy_version", 0)),
            concurrent_rollout=bool(getattr(implementations["rollout"], "thread_safe", False)),
        )
        if cfg.trl.async_prefetch:
            producer = PrefetchingProducer(
                producer,
                int(cfg.trl.prefetch_depth or 1),
                # batch k is consumed at optimizer step k * num_iterations
                progress_of=lambda k: TrainingProgress(step=k * int(cfg.trl.num_iterations), max_steps=cfg.max_steps),
            )
        stateful = {name: obj for name, obj in implementations.items() if hasattr(obj, "state_dict")}
        parts = TrainerParts(
            cfg=cfg,
            context=context,
            hook=host.hook,
            model=model,
            accelerator=accelerator,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            producer=producer,
            scorer=scorer,
            stream=stream,
            reference=reference,
            stateful=stateful,
        )
        trainer = GRPOTrainer(parts)
        resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, output_dir)
        if resume is not None:
            trainer.resume(resume)
            context.log(f"resumed from {resume} at step {trainer.step}")
        host.hook.grpo_train_start(context=context)
        status = trainer.train()
        save_final(model, tokenizer, output_dir)
        context.log(f"training {status}: {trainer.step} steps; model saved to {output_dir}")
        return status
    except (KeyboardInterrupt, TrainingInterrupted):
        status = "interrupted"
        raise
    finally:
        host.hook.grpo_train_end(context=context, status=status)
        scorer.close()

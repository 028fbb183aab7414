"""``grpo run``: build every part of a run from the config, then train.

Order matters for the user: everything cheap that can fail (config checks,
plugin resolution, dataset loading, reward columns) happens before the model
loads or a server starts, so a typo costs seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.checkpointing import lineage
from grpo_core.checkpointing.record import RECORD_KEY, RunRecord, check_resume, describe
from grpo_core.config.environment_names import check_rows, route_table
from grpo_core.config.implementations import chosen_implementations, environment_implementations
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, PluginError, StorageError, TrainingInterrupted
from grpo_core.contract.extension_points import BY_NAME, EXTENSION_POINTS, declared
from grpo_core.contract.types import (
    SAMPLES_TRAINER_MODEL,
    Checkpointable,
    InferenceEngine,
    Prompt,
    engine_cpu_cores,
)
from grpo_core.data.prompts import common_columns, load_prompts
from grpo_core.generation.environment_routes import EnvironmentRouter
from grpo_core.generation.episodes import EpisodeDriver, RolloutDriver
from grpo_core.generation.evaluation import load_eval_prompts
from grpo_core.generation.producer import (
    PrefetchingProducer,
    ProducerOptions,
    PromptStream,
    RolloutProducer,
    ScatteringProducer,
    sampling_from_config,
)
from grpo_core.generation.spread import SampledModel, SpreadGeneration
from grpo_core.generation.user_rollout import RolloutFunctionDriver
from grpo_core.host.plugin_host import ERROR_LOG, PluginHost
from grpo_core.modeling.fp8 import accelerator_kwargs
from grpo_core.modeling.model_files import resolve_model_dir
from grpo_core.modeling.models import load_policy, load_tokenizer, reference_model
from grpo_core.optimization.batch import generation_batch_size, steps_per_batch
from grpo_core.optimization.optimizer import build_optimizer, build_scheduler
from grpo_core.optimization.policy_forward import inner_policy
from grpo_core.parallel import TrainingBackend, backend_for
from grpo_core.parallel.generation_placement import generation_spreads
from grpo_core.runtime.collector import StartupCollector
from grpo_core.runtime.cpu_affinity import format_cpu_list, keep_off_engine_cores
from grpo_core.runtime.distributed import Distributed, process_rank, world_size
from grpo_core.runtime.heap import RetainedHeap
from grpo_core.runtime.output_lock import OutputLock, new_run_id
from grpo_core.scoring.rewards import RewardScorer
from grpo_core.training.observe import RunObserver
from grpo_core.training.safety_net import SafetyNet
from grpo_core.training.state_guard import GuardedState
from grpo_core.training.trainer import GRPOTrainer, TrainerParts
from grpo_core.validation.checks import chosen_environment_classes, environment_is_episodic
from grpo_core.validation.run_check import check_run_config


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
    generation_batch = generation_batch_size(cfg)
    return max(1, generation_batch // int(cfg.trl.num_generations))  # type: ignore[arg-type]


MAX_STEPS = 2**53  # steps are counted in floats along the way (schedules, progress): beyond this they are not exact

OUTPUT_PROBE_BYTES = 1 << 20
"""What :func:`check_output_dir` writes: less than the smallest checkpoint
(a small LoRA adapter, a tokenizer.json), so a disk without that much room
fails at start instead of at the first save, hours later."""


def check_output_dir(output_dir: Path) -> None:
    """Fail before training, not at the first checkpoint, if output_dir is
    unusable. Each caller writes its own probe file: every process of a
    multi-process run checks at once."""
    probe: Path | None = None
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".grpo-write-test-", dir=output_dir)
        probe = Path(name)
        with os.fdopen(fd, "wb") as handle:
            handle.write(bytes(OUTPUT_PROBE_BYTES))
        probe.unlink()
    except OSError as exc:
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
        raise StorageError(
            f"output_dir {output_dir} is not writable: {exc}. Choose another `output_dir`, or make room there "
            f"(a run writes checkpoints; the check writes {OUTPUT_PROBE_BYTES >> 20} MiB)."
        ) from None


def steps_for_epochs(cfg: GRPOConfig, num_prompts: int) -> int:
    """``num_epochs`` in optimizer steps: each generation batch takes
    prompts_per_batch prompts and num_iterations optimizer steps."""
    batches = float(cfg.num_epochs or 0) * num_prompts / prompts_per_batch(cfg)
    steps = batches * int(cfg.trl.num_iterations or 1)
    if not math.isfinite(steps) or steps > MAX_STEPS:
        raise ConfigError(
            f"num_epochs = {cfg.num_epochs:g} over {num_prompts} prompts is {steps:.3g} optimizer steps, more than a "
            f"run can count: lower num_epochs, or set max_steps."
        )
    return max(1, math.ceil(batches) * int(cfg.trl.num_iterations or 1))


@dataclass
class Implementations:
    """The run's chosen implementation of every extension point, built."""

    objects: dict[str, Any]
    engine: InferenceEngine | None
    environments: dict[str, Any] | None = None
    """Every environment implementation by name, when ``[plugins] environment`` lists several."""

    @property
    def concurrent_generate(self) -> bool:
        rollout = self.objects.get("rollout")
        return rollout is not None and bool(declared(rollout, BY_NAME["rollout"], "concurrent_generate"))

    @property
    def samples_trainer_model(self) -> bool:
        """The rollout (or the user's rollout_func through it) samples the trainer's model."""
        rollout = self.objects.get("rollout")
        return rollout is not None and SAMPLES_TRAINER_MODEL in declared(
            rollout, BY_NAME["rollout"], "engine_capabilities"
        )

    def checkpointable(self) -> dict[str, Checkpointable]:
        """Implementations with state to save (``state_dict``/``load_state_dict``)."""
        return {name: obj for name, obj in self.objects.items() if isinstance(obj, Checkpointable)}


TRAINER_SIDE_POINTS = frozenset({"is_correction", "policy_loss"})
"""Extension points the training loop itself calls (on every rank); the
others (rollout, weight sync, advantages, replay) run on rank 0 only."""


def build_implementations(
    host: PluginHost, cfg: GRPOConfig, context: RunContext, main: bool = True, spread: bool = False
) -> Implementations:
    """Build each extension point's implementation in the table's order (the
    rollout first, so a managed engine starts before the model loads), then
    take the rollout's engine handle for the weight sync. On ranks other
    than 0 (``main`` false) only the trainer-side points are built, and the
    rollout when generation is ``spread`` over every rank (it then samples
    the trainer's model: no engine starts there)."""
    chosen = chosen_implementations(cfg)
    objects = {
        point.name: host.load_implementation(point.name, chosen[point.name], context)
        for point in EXTENSION_POINTS
        if main or point.name in TRAINER_SIDE_POINTS or (spread and point.name == "rollout")
    }
    if not main:
        return Implementations(objects, None)
    environments = None
    extra = environment_implementations(cfg)[1:]
    if extra and "environment" in objects:  # several environments: each built like the first
        primary = host.chosen["environment"]
        environments = {primary: objects["environment"]}
        for name in extra:
            environments[name] = host.load_implementation("environment", name, context)
        host.chosen["environment"] = primary
    engine = host.hook.grpo_inference_engine()
    if engine is not None and not isinstance(engine, InferenceEngine):
        raise PluginError(
            f"rollout '{chosen['rollout']}' returned {type(engine).__name__} from grpo_inference_engine, which is not "
            "an InferenceEngine (grpo_core.contract.types)"
        )
    return Implementations(objects, engine, environments)


def _rollout_driver(
    cfg: GRPOConfig, host: PluginHost, context: RunContext, impls: Implementations
) -> RolloutDriver | None:
    """What drives the rollout turn by turn, if anything: ``trl.rollout_func``
    over an engine rollout (one that does not run it itself), or the
    episodes of an ``episodic`` environment; ``None`` for single-turn runs."""
    rollout = impls.objects.get("rollout")
    if cfg.trl.rollout_func and rollout is not None and not declared(rollout, BY_NAME["rollout"], "runs_rollout_func"):
        return RolloutFunctionDriver(cfg.trl.rollout_func, context)
    environment = impls.objects.get("environment")
    point = BY_NAME["environment"]
    environments = impls.environments or ({host.chosen.get("environment", "environment"): environment})
    if environment is None or not any(declared(e, point, "episodic") for e in environments.values()):
        return None
    tokenizer, log = context.tokenizer, context.log
    table = route_table(cfg, [(name, type(obj)) for name, obj in environments.items()])
    if table.routed:  # rows choose their environment
        router = EnvironmentRouter(table, environments)
        return EpisodeDriver(
            router.new_episode,
            tokenizer,
            cfg,
            "+".join(environments),
            log,
            concurrent_turns=impls.concurrent_generate,
            name_of=router.name_of,
        )

    def new_episode(prompt: Prompt, sample: int) -> Any:
        return host.hook.grpo_environment_episode(prompt=prompt, sample=sample)

    name = host.chosen.get("environment", "environment")
    return EpisodeDriver(new_episode, tokenizer, cfg, name, log, concurrent_turns=impls.concurrent_generate)


def _make_producer(
    cfg: GRPOConfig,
    host: PluginHost,
    scorer: Any,
    stream: PromptStream,
    tokenizer: Any,
    impls: Implementations,
    dist: Distributed,
    episodes: RolloutDriver | None = None,
    spread: SpreadGeneration | None = None,
) -> Any:
    """Rank 0's producer (prefetching in a thread with ``async_prefetch``);
    with several processes wrapped so the main thread scatters its batches
    (and, with ``spread``, spreads its generation calls over every rank)."""
    if not dist.is_main:
        return ScatteringProducer(None, dist, spread)
    stop_ids = _stop_ids(tokenizer)
    producer: Any = RolloutProducer(
        ProducerOptions.of(cfg),
        spread if spread is not None else host.hook,
        scorer,
        stream,
        prompts_per_batch(cfg),
        sampling_from_config(cfg, stop_ids),
        concurrent_rollout=impls.concurrent_generate,
        episodes=episodes,
    )
    if cfg.trl.async_prefetch:
        producer = PrefetchingProducer(
            producer,
            int(cfg.trl.prefetch_depth or 1),
            steps_per_batch=steps_per_batch(cfg),
            max_steps=cfg.max_steps,
        )
    return ScatteringProducer(producer, dist, spread) if dist.active else producer


def make_accelerator(cfg: GRPOConfig, backend: type[TrainingBackend] | None = None) -> Any:
    """accelerate's Accelerator for this process, configured by the run's
    training backend (:mod:`grpo_core.parallel`). Under a launcher
    (``accelerate launch``, ``torchrun``, ``grpo run --num-processes``) it
    joins the other processes: NCCL on GPUs, gloo without them."""
    # heavy (accelerate): loaded on first use, not with this module
    from accelerate import Accelerator

    world = world_size()
    backend = backend or backend_for(cfg, world)
    kwargs: dict[str, Any] = backend.accelerator_kwargs(cfg, world)
    for key, value in accelerator_kwargs(cfg.fp8).items():  # fp8: torchao Float8Linear at prepare
        kwargs[key] = kwargs.get(key, []) + value if key == "kwargs_handlers" else value
    return Accelerator(**kwargs)


@dataclass
class ModelParts:
    """The policy and what trains it, placed by accelerate (GPU where there is one)."""

    accelerator: Any
    backend: TrainingBackend  # how the policy is spread over the processes: backward, step, full weights, checkpoints
    model: torch.nn.Module  # the policy (under FSDP/ZeRO-3 holding this rank's shards)
    forward: Any  # the prepared log-prob module the loop calls (grpo_core.optimization.policy_forward)
    optimizer: Any
    scheduler: Any
    reference: Any  # grpo_core.modeling.models reference handle when beta > 0, else None


def _load_model_parts(cfg: GRPOConfig, context: RunContext, model_dir: str) -> ModelParts:
    """Model, optimizer and schedule through the run's training backend
    (it owns backward, clipping and, with several processes, the DDP/FSDP/
    DeepSpeed wrapping), and the reference."""
    world = world_size()
    backend_cls = backend_for(cfg, world)
    context.log(f"training: {backend_cls.describe(cfg, world)}")
    accelerator = make_accelerator(cfg, backend_cls)
    backend = backend_cls(cfg, accelerator)
    context.log(f"loading model from {model_dir}")
    model = load_policy(cfg, model_dir, context.tokenizer)
    forward, optimizer = backend.prepare(model, build_optimizer(cfg, model))
    model = inner_policy(forward)
    reference = reference_model(cfg, model_dir, model)  # None unless beta > 0
    if reference is not None and hasattr(reference, "model"):
        reference.model.to(accelerator.device)
    return ModelParts(accelerator, backend, model, forward, optimizer, build_scheduler(cfg, optimizer), reference)


def _checked_plugins(cfg: GRPOConfig, host: PluginHost | None, warn: Callable[[str], None] | None) -> PluginHost:
    """The plugin host with its always-on plugins, after ``cfg`` passed every
    check ``grpo run`` makes (its warnings to ``warn``, else printed)."""
    host = host or PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None)
    host.load_always_on()
    for warning in check_run_config(cfg, host):
        (warn or (lambda message: print(f"warning: {message}")))(warning)
    return host


def _prepared_output(cfg: GRPOConfig, host: PluginHost) -> Path:
    """``output_dir``, writable (checked now, not at the first save), with the
    plugins' error log in it; seeds and precision flags set."""
    output_dir = Path(cfg.output_dir)
    check_output_dir(output_dir)
    host.error_log = output_dir / ERROR_LOG
    seed_everything(cfg.seed)
    apply_precision_flags(cfg)
    return output_dir


def _resume_point(cfg: GRPOConfig, context: RunContext) -> tuple[Path | None, ckpt.LoadedCheckpoint | None]:
    """The checkpoint to resume from and its contents, read (and refused, if
    it would run code) before anything slow starts; saves an interrupted
    run left half done are finished or removed first."""
    for action in ckpt.recover_interrupted_saves(context.output_dir):
        context.log(action)
    resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, context.output_dir)
    if resume is None:
        return None, None
    loaded = ckpt.read_checkpoint(resume)
    for note in loaded.notes:
        context.log(f"warning: {note}")
    return resume, loaded


def _check_resume_matches(cfg: GRPOConfig, context: RunContext, resume: Path, model_dir: str) -> None:
    """The checkpoint's record of how it was made against this config, before
    the model loads (:mod:`grpo_core.checkpointing.record`)."""
    for warning in check_resume(resume, cfg, model_dir, context.tokenizer, world_size()):
        context.log(f"warning: {warning}")


def _prompts(
    cfg: GRPOConfig, host: PluginHost, context: RunContext, scorer: RewardScorer | None
) -> tuple[list[Prompt], list[Prompt]]:
    """Training and evaluation prompts, with the reward columns checked
    against the data; ``num_epochs`` turned into ``max_steps`` now that the
    dataset's size is known."""
    prompts = load_prompts(cfg, context.tokenizer)
    # A rollout_func, and an environment (its reward, environments=, its replies' info), add
    # per-completion fields that exist only once completions do.
    if scorer is not None and not cfg.trl.rollout_func and not environment_is_episodic(cfg, host):
        scorer.check_columns(common_columns(prompts))
    prompts, eval_prompts = load_eval_prompts(cfg, context.tokenizer, prompts)
    table = route_table(cfg, chosen_environment_classes(cfg, host))  # several environments: rows name theirs
    check_rows(prompts, table)
    check_rows(eval_prompts, table, "evaluation dataset")
    if cfg.num_epochs is not None and "max_steps" not in cfg.model_fields_set:  # max_steps wins, as in Axolotl
        cfg.max_steps = steps_for_epochs(cfg, len(prompts))
        context.log(f"num_epochs = {cfg.num_epochs:g} over {len(prompts)} prompts: max_steps = {cfg.max_steps}")
    return prompts, eval_prompts


def _stop_ids(tokenizer: Any) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _keep_trainer_off_engine_cores(context: RunContext, impls: Implementations) -> None:
    """Before the model loads (its threads, and every later one, stay on these
    cores): the trainer leaves the cores a CPU engine computes on."""
    engine_cores = engine_cpu_cores(impls.engine)
    trainer_cores = keep_off_engine_cores(engine_cores)
    if trainer_cores:
        context.log(
            f"CPU split: the inference engine computes on cores {format_cpu_list(engine_cores)}, "
            f"the trainer on {format_cpu_list(trainer_cores)} ([vllm] engine_cpus)"
        )


def _joined_processes(cfg: GRPOConfig, context: RunContext, loaded: ModelParts) -> Distributed:
    """This process's place among the training processes (logged when there are several)."""
    dist = Distributed.from_accelerator(loaded.accelerator)
    if dist.active:
        context.log(
            f"process {dist.rank} of {dist.world} ({loaded.backend.describe(cfg, dist.world)}, "
            f"{loaded.accelerator.device})"
        )
    return dist


def _trainer_parts(
    cfg: GRPOConfig,
    host: PluginHost,
    context: RunContext,
    loaded: ModelParts,
    impls: Implementations,
    dist: Distributed,
    scorer: RewardScorer | None,
    observer: RunObserver | None,
    prompts: list[Prompt],
    spread: SpreadGeneration | None = None,
    made_with: dict[str, Any] | None = None,
) -> TrainerParts:
    """Everything the trainer drives, wired: the prompt stream, the producer
    (with the episode driver, if the run has episodes, and generation spread
    over the ranks, if it is) and the loaded model."""
    stream = PromptStream(prompts, cfg.seed, cfg.shuffle_dataset)
    episodes = _rollout_driver(cfg, host, context, impls) if dist.is_main else None
    if observer is not None:
        observer.episodes = episodes
    return TrainerParts(
        cfg=cfg,
        context=context,
        hook=host.hook,
        model=loaded.model,
        accelerator=loaded.accelerator,
        tokenizer=context.tokenizer,
        optimizer=loaded.optimizer,
        scheduler=loaded.scheduler,
        producer=_make_producer(cfg, host, scorer, stream, context.tokenizer, impls, dist, episodes, spread),
        scorer=scorer,
        stream=stream,
        reference=loaded.reference,
        engine=impls.engine,
        stateful=_checkpointed_state(impls, loaded, made_with or {}),
        observer=observer,
        forward=loaded.forward,
        dist=dist,
        backend=loaded.backend,
    )


def _checkpointed_state(impls: Implementations, loaded: ModelParts, made_with: dict[str, Any]) -> dict[str, Any]:
    """What each checkpoint saves beside the weights: every implementation's
    state (a failing ``state_dict`` named as that plugin's error) and the
    record of how the run was made (:mod:`grpo_core.checkpointing.record`)."""
    state: dict[str, Any] = {name: GuardedState(name, obj) for name, obj in impls.checkpointable().items()}
    state[RECORD_KEY] = RunRecord(made_with, loaded.model)
    return state


def _alone_sampler(loaded: ModelParts, impls: Implementations) -> Callable[[], Any]:
    """What rank 0 samples with when it generates alone (evaluation, and every
    call when generation is not spread): for a rollout that samples the
    trainer's model under FSDP/ZeRO-3, where no rank holds it whole, the
    backend's full copy that every weight sync refreshes (placed on the
    device only once something asks for it); else the policy."""
    if impls.samples_trainer_model:
        return lambda: loaded.backend.sampling_model(loaded.accelerator.device)
    return lambda: loaded.model


def _spread_generation(
    spread: bool, host: PluginHost, context: RunContext, loaded: ModelParts, dist: Distributed, sampled: SampledModel
) -> SpreadGeneration | None:
    """Generation calls spread over every rank, each sampling its share with
    the policy the backend makes whole for the call (when :func:`generation_spreads`)."""
    if not spread:
        return None
    if dist.is_main:
        context.log(
            f"generation: every process samples its share of each call's prompts ({dist.world} processes, "
            "the policy made whole on each for the call); evaluation samples on rank 0"
        )
    return SpreadGeneration(host.hook, dist, loaded.backend.generation_model, sampled, context.log)


def run_training(
    cfg: GRPOConfig,
    host: PluginHost | None = None,
    warn: Callable[[str], None] | None = None,
    config_path: str | None = None,
) -> str:
    """Check ``cfg`` exactly as ``grpo run`` does (warnings go to ``warn``),
    train, and return the final status (``completed``). ``output_dir`` is
    this run's alone while it trains (its lock names ``config_path``), and
    holds one history (:mod:`grpo_core.checkpointing.lineage`). Everything cheap that
    can fail (checks, plugins, data, reward columns) happens before a model
    loads or a server starts. No automatic garbage collection while the run
    starts (:mod:`grpo_core.runtime.collector`); freed memory kept for reuse
    (``reuse_freed_memory``, :mod:`grpo_core.runtime.heap`).

    Whatever escapes the run ends as one :class:`GrpoError` line naming the
    phase, with the traceback in ``output_dir/grpo-error.log`` and a
    checkpoint where the phase allows (:mod:`grpo_core.training.safety_net`)."""
    net = SafetyNet(Path(cfg.output_dir))
    try:
        with RetainedHeap(retains_freed_memory(cfg)), StartupCollector() as collector:
            return _run_training(cfg, host, warn, collector, net, config_path)
    except Exception as exc:
        report = net.report(exc)
        if report is exc:
            raise
        raise report from None


def retains_freed_memory(cfg: GRPOConfig) -> bool:
    """``reuse_freed_memory``: 'auto' keeps freed memory where the trainer
    computes on a CPU, the case measured (no CUDA device)."""
    if cfg.reuse_freed_memory == "auto":
        return not torch.cuda.is_available()
    return cfg.reuse_freed_memory


def _run_training(
    cfg: GRPOConfig,
    host: PluginHost | None,
    warn: Callable[[str], None] | None,
    collector: StartupCollector,
    net: SafetyNet,
    config_path: str | None = None,
) -> str:
    with net.phase("checking the config"):
        host = _checked_plugins(cfg, host, warn)
    with net.phase("preparing output_dir"):
        output_dir = _prepared_output(cfg, host)
    context = RunContext(config=cfg, output_dir=output_dir, engine_requirements=host.engine_requirements(cfg))
    with net.phase("taking output_dir's lock"):
        lock = _lock_output(context, config_path)  # the writing process alone; None on the others
    try:
        return _train_locked(cfg, host, context, collector, lock, config_path, net)
    finally:
        if lock is not None:
            lock.release()


def _lock_output(context: RunContext, config_path: str | None) -> OutputLock | None:
    """``output_dir`` for this run alone (:mod:`grpo_core.runtime.output_lock`),
    taken by the process that writes it: rank 0 of a multi-process or
    multi-host run, which the others run beside."""
    if process_rank() != 0:
        return None
    lock = OutputLock(context.output_dir, new_run_id(), config_path, context.log)
    lock.acquire()
    return lock


def _one_history(
    cfg: GRPOConfig,
    context: RunContext,
    lock: OutputLock,
    resume: Path | None,
    resume_state: ckpt.LoadedCheckpoint | None,
    config_path: str | None,
) -> None:
    """With the lock held: refuse a fresh start over checkpoints (judged again:
    the config check ran before the lock, and a crashed save may just have
    been restored), set aside what the output holds after the step this run
    starts from, and record the run's start (:mod:`grpo_core.checkpointing.lineage`)."""
    if resume is None:
        problem = lineage.fresh_start_problem(
            cfg.output_dir, cfg.max_steps, resuming=cfg.resume_from_checkpoint is not None, start_over=cfg.start_over
        )
        if problem is not None:
            raise ConfigError(problem)
    start_step = int(resume_state.trainer_state["step"]) if resume_state is not None else 0
    run = lock.holder.run
    if resume is not None:
        why = f"resuming from {resume}"
    elif cfg.start_over:
        why = "start_over"
    else:
        why = "a fresh start"
    for line in lineage.set_aside(context.output_dir, start_step, run, why):
        context.log(line)
    lineage.record_start(context.output_dir, run, start_step, resume, config_path, start_over=cfg.start_over)
    context.start_step = start_step


def _train_locked(
    cfg: GRPOConfig,
    host: PluginHost,
    context: RunContext,
    collector: StartupCollector,
    lock: OutputLock | None,
    config_path: str | None,
    net: SafetyNet,
) -> str:
    output_dir = context.output_dir
    with net.phase("reading the checkpoint to resume from"):
        resume, resume_state = _resume_point(cfg, context)
    with net.phase("loading the tokenizer"):
        model_dir = resolve_model_dir(cfg.base_model)
        context.tokenizer = load_tokenizer(cfg, model_dir)
    if resume is not None:  # before the history is set aside: a refused resume leaves output_dir as it was
        with net.phase("comparing the checkpoint with the config"):
            _check_resume_matches(cfg, context, resume, model_dir)
    with net.phase("recording the run in output_dir's history"):
        if lock is not None:
            _one_history(cfg, context, lock, resume, resume_state, config_path)
        elif resume_state is not None:
            context.start_step = int(resume_state.trainer_state["step"])
    main = process_rank() == 0  # rank 0 alone drives the producer: prompts, rewards, logs and saves
    spread = generation_spreads(cfg, host, world_size())  # every rank generates a share of each call
    with net.phase("loading the reward functions"):
        scorer = RewardScorer(cfg, host, context) if main else None
    with net.phase("loading data"):
        prompts, eval_prompts = _prompts(cfg, host, context, scorer)
    sampled = SampledModel()  # the model a rollout samples, once it has loaded
    context.get_model = sampled
    status = "failed"
    observer: RunObserver | None = None
    trainer: GRPOTrainer | None = None
    try:
        with net.phase("starting the trackers"):
            # trackers: before the model loads; rank 0 alone logs
            observer = (
                RunObserver.build(cfg, host, context, eval_prompts, _stop_ids(context.tokenizer)) if main else None
            )
        with net.phase("starting the plugins and the inference engine"):
            impls = build_implementations(host, cfg, context, main=main, spread=spread)  # a managed engine starts here
            _keep_trainer_off_engine_cores(context, impls)
        with net.phase("loading the model"):
            loaded = _load_model_parts(cfg, context, model_dir)
            dist = _joined_processes(cfg, context, loaded)
            sampled.alone = _alone_sampler(loaded, impls)
            if not spread:
                sampled()  # rank 0 samples alone throughout: place its model now, on this (the main) thread
        with net.phase("setting up the trainer"):
            trainer = GRPOTrainer(
                _trainer_parts(
                    cfg,
                    host,
                    context,
                    loaded,
                    impls,
                    dist,
                    scorer,
                    observer,
                    prompts,
                    _spread_generation(spread, host, context, loaded, dist, sampled),
                    describe(cfg, model_dir, world_size()),
                )
            )
        if resume is not None:
            with net.phase(f"resuming from {resume}"):
                trainer.resume(resume, resume_state)
            context.log(f"resumed from {resume} at step {trainer.step}")
        net.watch(trainer)
        collector.settle()  # an engine's own collections while it starts scan only what it makes
        with net.phase("starting training (the grpo_train_start hooks)"):
            host.hook.grpo_train_start(context=context)
        collector.started()
        status = trainer.train()
        with net.phase("saving the final model"):
            trainer.save_final()
        if observer is not None:
            context.log(observer.summary_line(status, trainer.step, output_dir))
        return status
    except (KeyboardInterrupt, TrainingInterrupted):
        status = "interrupted"
        raise
    except Exception as exc:
        net.on_failure(exc)  # a checkpoint where the phase allows, while the engine is still up
        raise
    finally:
        if observer is not None:
            observer.trackers.close()  # idempotent; the trainer closed them unless it never ran
        host.hook.grpo_train_end(context=context, status=status)
        if scorer is not None:
            scorer.close()
        if lock is not None:
            lineage.record_end(output_dir, lock.holder.run, status, None if trainer is None else trainer.step)

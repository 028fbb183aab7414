"""The consumer side of the loop: scored batches in, optimizer steps out.

Per optimizer step: take a scored batch from the producer (a fresh one every
``steps_per_generation x num_iterations`` steps, TRL's schedule), take this
step's slice of it, split into micro-batches of similar length,
compute log-probs (chunked over the LM head), the importance-sampling
correction and the PPO-clip loss, accumulate gradients, step, and every
``vllm_sync_interval`` steps push the weights to the inference engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.checkpointing.checkpoint import list_checkpoints
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import (
    EngineUnavailable,
    EnvironmentLost,
    GrpoError,
    PluginError,
    RewardError,
    TrainingDiverged,
    TrainingInterrupted,
    WeightSyncUnverified,
)
from grpo_core.contract.types import (
    Checkpointable,
    InferenceEngine,
    PolicyLossInputs,
    TrainingProgress,
)
from grpo_core.generation.producer import Producer, PromptStream, ScoredBatch
from grpo_core.generation.token_versions import drop_stale, staleness_metrics, token_staleness_bound
from grpo_core.modeling.compile import CompileOptions, compile_policy
from grpo_core.modeling.models import save_final
from grpo_core.modeling.precision import resolve_precision
from grpo_core.modeling.structure import decoder_and_head
from grpo_core.optimization.batch import (
    MicroBatch,
    Sample,
    completion_tokens,
    flatten,
    micro_batch_count,
    micro_batches,
    step_slices,
    steps_per_batch,
    steps_per_generation,
    with_signal_first,
)
from grpo_core.optimization.logprobs import head_is_plain, token_logprobs
from grpo_core.optimization.loss import (
    LossSettings,
    micro_batch_split_is_free,
    zero_advantage_rows_are_inert,
)
from grpo_core.optimization.optimizer import advance_schedule
from grpo_core.parallel import TrainingBackend
from grpo_core.runtime.distributed import Distributed
from grpo_core.sync.policy_sync import PolicySync, run_verifier
from grpo_core.training.observe import RunObserver
from grpo_core.training.run_checkpoint import LoopPosition, RunCheckpoints
from grpo_core.training.timing import StepClock, dominant_phases

if TYPE_CHECKING:
    from accelerate import Accelerator
    from pluggy import HookRelay
    from transformers import PreTrainedTokenizerBase

    from grpo_core.modeling.models import ReferenceModel
    from grpo_core.optimization.policy_forward import PolicyLogprobs
    from grpo_core.scoring.rewards import RewardScorer


@dataclass
class TrainerParts:
    """Everything the loop needs, built by :mod:`grpo_core.training.run`."""

    cfg: GRPOConfig
    context: RunContext
    hook: HookRelay  # the plugin host's hook relay: every implementation's hooks
    model: torch.nn.Module
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    producer: Producer
    scorer: RewardScorer | None  # rank 0 scores; None on the other ranks
    backend: TrainingBackend  # how the policy is spread over the processes (grpo_core.parallel)
    stream: PromptStream | None = None  # restored on resume
    reference: ReferenceModel | None = None  # when beta > 0
    engine: InferenceEngine | None = None  # the rollout's engine, handed to the weight sync
    stateful: dict[str, Checkpointable] = field(default_factory=dict)  # extension point -> implementation with state
    observer: RunObserver | None = None  # logs, trackers, evaluation, alerts (rank 0)
    forward: PolicyLogprobs | None = (
        None  # the prepared log-prob module (DDP/FSDP-wrapped with several processes); None: call the model
    )
    dist: Distributed = field(default_factory=Distributed)  # the training processes (one by default)


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next step edge."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequested:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. under some test runners)
                pass
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class GRPOTrainer:
    def __init__(self, parts: TrainerParts) -> None:
        self.parts = parts
        cfg = parts.cfg
        self.cfg = cfg
        self.trl = cfg.trl
        self.loss_settings = LossSettings.from_config(cfg)
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.policy_version = 0
        self.skipped_zero_adv_batches = 0
        self.skipped_zero_adv_samples = 0
        # With a token-sum loss a zero-advantage completion adds nothing: leave it out of the micro-batches
        self.drops_zero_advantage_rows = cfg.trl.skip_zero_advantage_batches and zero_advantage_rows_are_inert(
            self.loss_settings
        )
        # Where the loss does not depend on the split, micro-batches are cut where they pad least
        self.balances_micro_batches = micro_batch_split_is_free(self.loss_settings)
        self._left_out: list[tuple[int, int]] = []  # per step of the batch: (micro-batches, samples) left out
        self._batch: ScoredBatch | None = None
        self._token_metrics: dict[str, float] = {}  # per-token staleness of the batch (in-flight weight updates)
        self._micro: list[MicroBatch] = []
        self._micro_per_step: list[list[MicroBatch]] = []
        self.dist = parts.dist
        self.steps_per_generation = steps_per_generation(cfg, self.dist.world)
        self.steps_per_batch = steps_per_batch(cfg, self.dist.world)
        # in-flight updates and partial rollouts sample one completion with several policy versions
        self.versions_per_token = bool(self.trl.in_flight_weight_updates or self.trl.partial_rollout_token_budget)
        self.token_staleness_bound = token_staleness_bound(
            int(self.trl.prefetch_depth or 1),
            self.steps_per_batch,
            int(self.trl.max_completion_length),  # type: ignore[arg-type]
            self.trl.partial_rollout_token_budget,
        )
        self._num_items = 0.0
        self._stream_state: dict[str, Any] = {}
        self.pad_id = int(parts.tokenizer.pad_token_id)
        self.clock = StepClock()
        self.timings: list[dict[str, float]] = []  # each step's metrics, for the end-of-run time shares
        self.device = parts.accelerator.device
        self.precision = resolve_precision(cfg, self.device.type)
        self.backend = parts.backend  # backward, the optimizer step, full weights and checkpoints
        self.compiled_body = compile_policy(CompileOptions.of(cfg), parts.model)  # None unless torch_compile
        self.share_prompts = bool(cfg.share_prompt_prefix)
        self.verifier = run_verifier(
            cfg, parts.model, parts.engine, parts.tokenizer, self.precision, self.dist, parts.context.log
        )
        self.syncer = PolicySync(
            parts.hook,
            parts.engine,
            self.backend,
            self.dist,
            parts.producer,
            self.verifier,
            in_flight=bool(self.trl.in_flight_weight_updates),
        )
        self.checkpoints = RunCheckpoints(
            cfg.output_dir,
            self.backend,
            self.dist,
            parts.producer,
            parts.stateful,
            parts.tokenizer,
            parts.optimizer,
            parts.scheduler,
            save_total_limit=cfg.save_total_limit,
            max_steps=cfg.max_steps,
        )
        if self.compiled_body is not None:
            parts.context.log(
                f"torch_compile: the decoder body is compiled (backend "
                f"{cfg.torch_compile_backend or 'inductor'}) at the first training forward"
            )

    # ---------------------------------------------------------------- state

    def position(self) -> LoopPosition:
        return LoopPosition(
            self.step,
            self.policy_version,
            self.skipped_zero_adv_batches,
            self.skipped_zero_adv_samples,
            self._stream_state,
        )

    def save(self) -> Path:
        """Checkpoint everything an exact resume needs
        (:mod:`grpo_core.training.run_checkpoint`); every rank calls this."""
        pending = None if self._batch is None or not self.step % self.steps_per_batch else self._batch
        old_logps = [mb.old_logps for mb in self._micro] if pending is not None else None
        return self.checkpoints.save(self.position(), pending, old_logps)

    def resume(self, path: Path, loaded: ckpt.LoadedCheckpoint | None = None) -> None:
        """Continue from checkpoint ``path``; ``loaded`` is its
        :func:`~grpo_core.checkpointing.checkpoint.read_checkpoint` result when the
        caller checked it early (before the model loaded)."""
        resumed = self.checkpoints.resume(path, loaded, self.parts.stream)
        at = resumed.position
        self.step, self.policy_version = at.step, at.policy_version
        self.skipped_zero_adv_batches = at.skipped_zero_adv_batches
        self.skipped_zero_adv_samples = at.skipped_zero_adv_samples
        self._stream_state = at.stream
        if resumed.pending is not None:
            self._set_batch(resumed.pending, old_logps=resumed.old_logps)

    # ---------------------------------------------------------------- pieces

    def progress(self) -> TrainingProgress:
        return TrainingProgress(step=self.step, max_steps=self.cfg.max_steps)

    def _forward(
        self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``mb`` under ``model``; the policy goes through the
        prepared module, whose forward DDP/FSDP/DeepSpeed wrap."""
        args = (mb.input_ids.to(self.device), mb.attention_mask.to(self.device), mb.num_completion_tokens)
        kwargs = {
            "temperature": float(self.trl.temperature or 1.0),
            "with_entropy": with_entropy,
            "share_prompts": self.share_prompts,
        }
        with self.precision.autocast(self.device.type, model):  # bf16/fp16 compute; log-probs come back in float32
            # the policy's compiled body (torch_compile); the reference runs eager
            body = self.compiled_body if model is self.parts.model else None
            if model is self.parts.model and self.parts.forward is not None:
                logps, entropy = self.parts.forward(*args, **kwargs, body=body)
            else:
                logps, entropy = token_logprobs(model, *args, **kwargs, body=body)
        return logps.float(), None if entropy is None else entropy.float()

    def _set_batch(self, batch: ScoredBatch, old_logps: list[torch.Tensor | None] | None = None) -> None:
        """Make ``batch`` the one the next steps train on. ``old_logps`` (one
        per micro-batch, from a checkpoint) are used instead of recomputing
        them, which after a resume would give the already-updated policy's."""
        self._token_metrics = {}
        if self.versions_per_token:  # per-token versions: metrics, and the staleness bound per token
            groups, dropped = drop_stale(batch.groups, self.policy_version, self.token_staleness_bound)
            self._token_metrics = staleness_metrics(batch.groups, self.policy_version)
            self._token_metrics["inflight/dropped_stale_samples"] = float(dropped)
            batch = dataclasses.replace(batch, groups=groups) if dropped else batch
        self._batch = batch
        self._stream_state = batch.stream_state
        samples = flatten(batch.groups)
        # the generation batch's real tokens over every rank (dapo/cispo's normaliser), rows left out included
        self._num_items = self.dist.sum(float(completion_tokens(samples, self.trl.mask_truncated_completions)))
        parts = step_slices(samples, self.steps_per_generation)
        trained_parts = self._rows_to_train(parts)
        mbs = self.cfg.micro_batch_size
        self._micro_per_step = [
            micro_batches(
                part, mbs, self.pad_id, self.trl.mask_truncated_completions, balanced=self.balances_micro_batches
            )
            for part in trained_parts
        ]
        self._left_out = [
            (micro_batch_count(len(part), mbs) - len(micro), len(part) - len(trained))
            for part, trained, micro in zip(parts, trained_parts, self._micro_per_step, strict=True)
        ]
        self._micro = [mb for part in self._micro_per_step for mb in part]
        model = self.parts.model
        if old_logps is not None and len(old_logps) != len(self._micro):
            warnings.warn(
                "micro_batch_size changed since the checkpoint: the resumed batch's PPO ratios start "
                "from the resumed policy (not an exact resume)",
                stacklevel=2,
            )
            old_logps = None
        if old_logps is not None:  # a resumed pending batch: as saved
            for mb, saved in zip(self._micro, old_logps, strict=True):
                mb.old_logps = None if saved is None else saved.to(self.device)
        elif self.steps_per_batch > 1:
            # Log-probs of the policy that the batch's updates start from: the
            # denominator of the PPO ratio in every later step on this batch.
            with torch.no_grad():
                for mb in self._micro:
                    mb.old_logps = self._forward(model, mb, with_entropy=False)[0].detach()
        if float(self.trl.beta) > 0 and self.parts.reference is not None:
            with torch.no_grad(), self.parts.reference.active() as ref_model:
                for mb in self._micro:
                    mb.ref_logps = self._forward(ref_model, mb, with_entropy=False)[0].detach()

    def _rows_to_train(self, parts: list[list[Sample]]) -> list[list[Sample]]:
        """Each step's samples minus its zero-advantage ones, where they are
        inert (:func:`grpo_core.optimization.loss.zero_advantage_rows_are_inert`). A rank
        that would then run fewer micro-batches than the busiest one keeps
        just enough of its zero-advantage rows to run as many (each backward
        pass is a collective)."""
        if not self.drops_zero_advantage_rows:
            return parts
        mbs = self.cfg.micro_batch_size
        needed = [micro_batch_count(sum(s.has_signal for s in part), mbs) for part in parts]
        needed = [max(counts) for counts in zip(*self.dist.gather(needed), strict=True)]
        return [with_signal_first(part, (n - 1) * mbs + 1 if n else 0) for part, n in zip(parts, needed, strict=True)]

    def _is_weights(
        self, mb: MicroBatch, trainer_at_sampling: torch.Tensor, step_metrics: dict[str, list[float]]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        mask = mb.completion_mask.to(self.device)
        if mb.sampler_logps is None:
            return None, mask
        # the sync check on the sampled tokens (sync_check.py): a batch the engine sampled from the trainer's
        # weights now
        if self.verifier.sampled and (batch := self._batch) is not None and batch.policy_version == self.policy_version:
            fresh_rows = ~mb.replayed.to(self.device)[:, None]  # a replayed row was sampled by an older policy
            self.verifier.observe(
                batch.policy_version, trainer_at_sampling, mb.sampler_logps.to(self.device), mask.bool() & fresh_rows
            )
        weights, new_mask, m = self.parts.hook.grpo_is_correction(
            trainer_logps=trainer_at_sampling, sampler_logps=mb.sampler_logps.to(self.device), mask=mask
        )
        if self.trl.replay_recompute_logps and bool(mb.replayed.any()):
            # Replayed rows were sampled by an old policy: their ratio is taken
            # against freshly computed log-probs instead (no IS weight).
            rows = mb.replayed.to(self.device)
            weights = torch.where(rows[:, None], torch.ones_like(weights), weights)
            new_mask = torch.where(rows[:, None], mask, new_mask)
        for key, value in m.items():
            step_metrics.setdefault(f"is/{key}", []).append(float(value))
        return weights, new_mask

    def _hidden_states(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.nn.Module]:
        """The decoder's hidden states predicting the completion tokens, and
        the LM head: for losses that fuse the head (``policy_loss = liger``)."""
        plain_body, head = decoder_and_head(model)
        if not head_is_plain(model):
            raise GrpoError(
                f"policy_loss '{self.cfg.plugins.policy_loss or 'liger'}' fuses the LM head as a plain linear layer, "
                "but this model scales or soft-caps its logits after the head (logit_scale / "
                "final_logit_softcapping): set trl.use_liger_loss = false (the built-in loss applies them)."
            )
        body = self.compiled_body if self.compiled_body is not None else plain_body
        c = mb.num_completion_tokens
        with self.precision.autocast(self.device.type, self.parts.model):
            out = body(
                input_ids=mb.input_ids.to(self.device),
                attention_mask=mb.attention_mask.to(self.device),
                use_cache=False,
            )
        return out.last_hidden_state[:, -c - 1 : -1, :], head

    def _train_step(self) -> dict[str, float]:
        cfg, trl = self.cfg, self.trl
        model = self.parts.model
        model.train()
        clock = self.clock  # started when the previous step was logged (it may hold that step's checkpoint)
        fresh = self._batch is None or self.step % self.steps_per_batch == 0
        if fresh:
            with clock.phase("rollout"):
                produced = self.parts.producer.produce(self.progress())
            with clock.phase("forward_backward"):  # old / reference log-probs of the new batch
                self._set_batch(produced)
        batch = self._batch
        assert batch is not None
        step_metrics: dict[str, list[float]] = {}
        num_tokens = 0
        trained = 0
        loss_total = 0.0
        step_micro = self._micro_per_step[self.step % self.steps_per_generation]
        left_out_micro, left_out_samples = self._left_out[self.step % self.steps_per_generation]
        self.skipped_zero_adv_batches += left_out_micro
        self.skipped_zero_adv_samples += left_out_samples
        accumulation_steps = max(1, len(step_micro))
        # Every rank runs the same backward passes (each one is an all-reduce):
        # a micro-batch is skipped only where no rank has a learning signal.
        signal = self.dist.any([mb.has_signal for mb in step_micro])
        skip = trl.skip_zero_advantage_batches and float(trl.beta) == 0
        to_train = [i for i, any_signal in enumerate(signal) if any_signal or not skip]
        for i, mb in enumerate(step_micro):
            if i not in to_train:
                self.skipped_zero_adv_batches += 1
                self.skipped_zero_adv_samples += int(mb.advantages.shape[0])
                continue
            with clock.phase("forward_backward"):
                loss, m = self._micro_batch_loss(model, mb, accumulation_steps, step_metrics, last=i == to_train[-1])
            trained += 1
            num_tokens += int(mb.attention_mask.sum())
            loss_total += float(loss.detach())  # micro-batch losses are pre-scaled: their sum is the step's loss
            for key, value in m.items():
                step_metrics.setdefault(key, []).append(float(value))
        # the last sync's check on this step's samples, before the weights move (timed only when one waits)
        with clock.phase("weight_sync") if self.verifier.waiting else contextlib.nullcontext():
            self.verifier.settle()
        grad_norm = 0.0
        with clock.phase("optimizer"):
            if trained:
                grad_norm = self.backend.optimizer_step(cfg.max_grad_norm)
            lr = float(self.parts.scheduler.get_last_lr()[0])
            advance_schedule(self.parts.scheduler)  # also on a step that trained nothing, without torch's warning
            self.parts.optimizer.zero_grad(set_to_none=True)
        if trained and not math.isfinite(grad_norm):
            raise self._diverged(grad_norm, loss_total)
        self.step += 1
        self.policy_version += int(trained > 0)
        return self._step_metrics(batch, fresh, step_metrics, loss_total, grad_norm, lr, num_tokens, trained)

    def _diverged(self, grad_norm: float, loss: float) -> TrainingDiverged:
        """The error for a step whose gradient is NaN or inf: the update was not
        applied (DeepSpeed's engine applies it; the run stops before any save
        either way), so the last checkpoint holds finite weights."""
        saved = list_checkpoints(self.output_dir)
        resume = f"resume from {saved[-1]}" if saved else "start again"
        return TrainingDiverged(
            f"step {self.step + 1}: the gradient is not finite (grad_norm = {grad_norm}, loss = {loss}): the run "
            f"stops here rather than train on it, and saves nothing of this step. To go on, {resume} with a lower "
            "learning_rate or max_grad_norm; a reward or advantage that is inf, or a precision too narrow for the "
            "model (bf16), are the usual causes."
        )

    def _micro_batch_loss(
        self,
        model: torch.nn.Module,
        mb: MicroBatch,
        accumulation_steps: int,
        step_metrics: dict[str, list[float]],
        last: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The ``policy_loss`` implementation's loss of one micro-batch, then
        backward (``last``: the step's last trained micro-batch)."""
        inputs = PolicyLossInputs(
            settings=self.loss_settings,
            targets=mb.input_ids[:, -mb.num_completion_tokens :].to(self.device),
            mask=mb.completion_mask.to(self.device),
            advantages=mb.advantages.to(self.device),
            old_logps=mb.old_logps,
            ref_logps=mb.ref_logps,
            sampler_logps=None if mb.sampler_logps is None else mb.sampler_logps.to(self.device),
            temperature=float(self.trl.temperature or 1.0),
            # TRL's dapo/cispo normaliser: the generation batch's tokens (all ranks), rescaled to one
            # step and divided by the process count, as the gradient all-reduce averages over ranks
            num_items_in_batch=self._num_items / self.steps_per_generation / self.dist.world,
            accumulation_steps=accumulation_steps,
            logprobs=lambda with_entropy: self._forward(model, mb, with_entropy=with_entropy),
            hidden_states=lambda: self._hidden_states(model, mb),
            is_weights=lambda trainer_logps: self._is_weights(mb, trainer_logps, step_metrics),
        )
        loss, m = self.parts.hook.grpo_policy_loss(inputs=inputs)
        self.backend.backward(loss, last)
        return loss, m

    def _step_metrics(
        self,
        batch: ScoredBatch,
        fresh: bool,
        step_metrics: dict[str, list[float]],
        loss_total: float,
        grad_norm: float,
        lr: float,
        num_tokens: int,
        trained: int,
    ) -> dict[str, float]:
        metrics = {**batch.metrics, **self._token_metrics} if fresh else {}
        local = {k: sum(v) / len(v) for k, v in step_metrics.items()}
        # each rank's loss is its share of the global one after the gradient average: the mean is the global loss
        local.update(loss=loss_total, num_tokens=float(num_tokens))
        metrics.update(self.dist.mean_metrics(local, summed=("num_tokens",)))
        metrics.update(
            grad_norm=grad_norm,  # clipped after the all-reduce: the global norm
            learning_rate=lr,
            world_size=float(self.dist.world),
            skipped_zero_adv_batches=float(self.skipped_zero_adv_batches),
            skipped_zero_adv_samples=float(self.skipped_zero_adv_samples),
            policy_version=float(batch.policy_version),
            staleness=float(self.policy_version - 1 - batch.policy_version) if trained else 0.0,
        )
        return metrics

    def _sync_after_step(self, metrics: dict[str, float], observer: Any) -> None:
        """The step's weight sync (every ``vllm_sync_interval`` steps), and
        before an evaluation samples from the engine, the check of a sync
        that would otherwise wait for the next step's samples. The optimizer
        step is done by now: if either raises, the step's record is written
        first, so metrics.jsonl never loses a step that trained."""
        due = self.step % int(self.trl.vllm_sync_interval) == 0
        evaluating = self.dist.is_main and observer.syncs_before_eval(self)
        if not (due or evaluating):
            return
        try:
            with self.clock.phase("weight_sync"):
                if due:
                    self.sync_weights()
                if evaluating:
                    self.verify_engine_now()
        except BaseException:
            try:
                observer.record_only(self, {**metrics, **self.clock.metrics(), **self.verifier.take_metrics()})
            except Exception as lost:  # e.g. a full disk: the sync's own error is the one to report
                self.parts.context.log(f"step {self.step}'s metrics could not be written either: {lost}")
            raise

    @property
    def last_sync_version(self) -> int:
        return self.syncer.last_version

    def sync_weights(self) -> None:
        """Push the current policy to the engine (:class:`~grpo_core.sync.policy_sync.PolicySync`):
        every rank calls this; a sync that fails on rank 0 raises on every rank."""
        self.syncer.sync(self.policy_version)

    def verify_engine_now(self) -> None:
        """Check a sync still waiting for its sampled-token check with the
        probe now (rank 0; one process): before the engine samples for
        anything but training."""
        self.syncer.verify_now()

    def save_final(self) -> Path:
        """The trained model in the standard format, written by rank 0."""
        out = self.output_dir
        model = self.backend.full_model(self.policy_version)
        if self.dist.is_main:
            save_final(model, self.parts.tokenizer, out, safetensors=self.cfg.save_safetensors)
        self.dist.barrier()
        return out

    def _update_reference(self) -> None:
        """``sync_ref_model``: ref <- alpha * policy + (1 - alpha) * ref."""
        if self.parts.reference is not None:
            self.parts.reference.sync(self.parts.model, float(self.trl.ref_model_mixup_alpha))

    # ---------------------------------------------------------------- loop

    def train(self) -> str:
        cfg, trl = self.cfg, self.trl
        try:
            self.sync_weights()  # the engine starts from this run's weights, whatever it held before
        except WeightSyncUnverified as exc:  # nothing trained since the start: nothing new to checkpoint
            raise WeightSyncUnverified(
                f"{exc}\nTraining stopped before step {self.step + 1}; nothing was trained, so no "
                "checkpoint was written."
            ) from None
        observer = self.parts.observer or (RunObserver(cfg) if self.dist.is_main else _QuietObserver())
        observer.start(self)
        self.clock = StepClock()
        try:
            with StopRequested() as stop:
                while self.step < cfg.max_steps:
                    try:
                        metrics = self._train_step()
                        self._sync_after_step(metrics, observer)
                    except (EngineUnavailable, EnvironmentLost, RewardError, PluginError, WeightSyncUnverified) as exc:
                        path = self.save()  # everything finished so far is kept
                        raise type(exc)(
                            f"{exc}\nTraining stopped at step {self.step}; checkpoint saved to {path}. "
                            f'Resume with resume_from_checkpoint = "{path}".'
                        ) from exc
                    if trl.sync_ref_model and self.step % trl.ref_model_sync_steps == 0:
                        self._update_reference()
                    metrics.update(self.clock.metrics())  # the phases add up to step_time
                    metrics.update(
                        self.verifier.take_metrics()
                    )  # sync/*: the checks of the syncs since the last record
                    self.timings.append(metrics)
                    # The next step's clock starts now: evaluation, logging and this step's checkpoint
                    # are timed in the next step, so every second of the run is in some step_time.
                    self.clock = StepClock()
                    if self.dist.active and self.dist.broadcast(observer.syncs_before_eval(self)):
                        self.sync_weights()  # together: rank 0's evaluation must not sync alone
                    if self.dist.is_main:  # lifecycle step hooks and logging: rank 0
                        self.parts.hook.grpo_step_end(progress=self.progress(), metrics=metrics)
                    observer.step_end(self, metrics)  # logged before the checkpoint: a failed save loses no metrics
                    saved = None
                    if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < cfg.max_steps:
                        with self.clock.phase("checkpoint"):
                            saved = self.save()
                    if self.dist.any([stop.signal is not None])[0]:  # a signal on any rank stops all together
                        path = saved or self.save()
                        raise TrainingInterrupted(
                            f"stopped by signal {stop.signal or 'on another rank'} at step {self.step}; checkpoint "
                            f"saved to {path}. "
                            f'Resume with resume_from_checkpoint = "{path}".'
                        )
            try:
                self.verify_engine_now()  # the last sync: no step follows to check it on its samples
            except (WeightSyncUnverified, EngineUnavailable) as exc:  # training is complete: say so, save the model
                self.parts.context.log(f"warning: {exc}")
            self.save()
        finally:
            observer.close()
            self.parts.producer.close()
        shares = dominant_phases(self.timings)
        if shares:
            self.parts.context.log(f"time per step went to: {shares} (metrics.jsonl: time/*)")
        if self.skipped_zero_adv_samples:
            fewer = self.skipped_zero_adv_batches
            self.parts.context.log(
                f"zero advantage: {self.skipped_zero_adv_samples} completions left out of training ({fewer} "
                f"micro-batch{'' if fewer == 1 else 'es'} fewer); their groups had no reward variance"
            )
        return "completed"


class _QuietObserver:
    """The observer of ranks other than 0: rank 0 logs, tracks and evaluates."""

    def start(self, trainer: Any) -> None:
        pass

    def step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        pass

    def syncs_before_eval(self, trainer: Any) -> bool:
        return False

    def record_only(self, trainer: Any, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass

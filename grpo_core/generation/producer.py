"""The producer side of the loop: prompts in, scored rollout batches out.

The trainer only ever asks a producer for the next :class:`ScoredBatch`.
Whether that batch was made just now (synchronous), ahead of time in a
background thread (``async_prefetch``), or scored group by group while later
groups were still generating (``streaming_partial_batch``) changes the
scheduling inside this module, never the trainer.
"""

from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import EngineUnavailable, GrpoError, PluginError, RewardError
from grpo_core.contract.types import (
    Completion,
    Prompt,
    RolloutGroup,
    SamplingSettings,
    ScoredGroup,
    TrainingProgress,
)
from grpo_core.generation.episodes import (
    RolloutDriver,
    environment_metrics,
    episode_metrics,
    release,
    sample_groups,
    unscored_rows,
)
from grpo_core.generation.partial_rollouts import PartialRollouts
from grpo_core.generation.spread import GenerateShare, SpreadGeneration
from grpo_core.runtime.distributed import shares


@dataclass
class ScoredBatch:
    """One generation batch, scored, with the numbers to log about it."""

    groups: list[ScoredGroup]
    policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    stream_state: dict[str, Any] = field(default_factory=dict)  # prompt position after this batch


class PromptStream:
    """Endless epoch-wise (re)shuffled walk over the prompts, resumable."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Prompt]:
        out = []
        while len(out) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._make_order()


@dataclass(frozen=True)
class ProducerOptions:
    """The keys a :class:`RolloutProducer` reads, taken once from the config
    (:meth:`of`): ``trl.num_generations``, ``trl.scale_rewards`` and the streaming pair."""

    num_generations: int
    scale_rewards: str
    stream_chunk: int | None = None
    """Prompts per rollout call with ``trl.streaming_partial_batch`` (``trl.streaming_min_groups``,
    at least 1); None: the whole batch in one call."""
    partial_budget: int | None = None
    """``trl.partial_rollout_token_budget``: tokens per sample per batch, the rest carried over
    (:mod:`~grpo_core.generation.partial_rollouts`); None: every sample to its end in its batch."""

    @classmethod
    def of(cls, cfg: GRPOConfig) -> ProducerOptions:
        trl = cfg.trl
        chunk = max(1, int(trl.streaming_min_groups or 1)) if trl.streaming_partial_batch else None
        budget = trl.partial_rollout_token_budget
        return cls(int(trl.num_generations), str(trl.scale_rewards), chunk, budget)  # type: ignore[arg-type]


def sampling_from_config(cfg: GRPOConfig, stop_token_ids: list[int]) -> SamplingSettings:
    trl = cfg.trl
    extra = dict(trl.generation_kwargs or {})
    stops = list(stop_token_ids) + [int(t) for t in extra.pop("stop_token_ids", [])]
    return SamplingSettings(
        max_tokens=int(trl.max_completion_length),  # type: ignore[arg-type]
        temperature=float(trl.temperature),  # type: ignore[arg-type]
        top_p=float(trl.top_p),  # type: ignore[arg-type]
        top_k=trl.top_k or None,
        min_p=trl.min_p,
        repetition_penalty=trl.repetition_penalty,
        stop_token_ids=sorted(set(stops)),
        guided_regex=trl.vllm_guided_decoding_regex,
        extra=extra,
        seed=cfg.seed,
    )


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std(unbiased=False)) if len(values) > 1 else 0.0


def batch_metrics(groups: list[ScoredGroup], reward_names: list[str], weights: list[float]) -> dict[str, float]:
    """Reward and completion statistics of one scored batch (logged per step)."""
    metrics: dict[str, float] = {}
    totals: list[float] = []
    zero_std = 0
    for scored in groups:
        weighted = [
            sum(w * r for w, r in zip(weights, row) if r is not None and math.isfinite(r)) for row in scored.rewards
        ]
        totals.extend(weighted)
        zero_std += int(len(set(weighted)) <= 1)
    metrics["reward"], metrics["reward_std"] = _mean_std(totals)
    metrics["frac_reward_zero_std"] = zero_std / max(1, len(groups))
    for j, name in enumerate(reward_names):
        column = [row[j] for s in groups for row in s.rewards if row[j] is not None]
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = _mean_std([float(v) for v in column])
    lengths = [c.model_token_count for s in groups for c in s.group.completions]  # the policy's tokens, as TRL counts
    metrics["completions/mean_length"] = sum(lengths) / max(1, len(lengths))
    metrics["completions/max_length"] = float(max(lengths, default=0))
    metrics["completions/clipped_ratio"] = sum(c.truncated for s in groups for c in s.group.completions) / max(
        1, len(lengths)
    )
    metrics["replayed_groups"] = float(sum(s.replayed for s in groups))
    return metrics


class Producer(Protocol):
    """What the trainer asks of a producer (every schedule in this module:
    synchronous, prefetching, scattering to other ranks)."""

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        """The next scored batch, for the optimizer step ``progress`` names."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Hold any background work while the caller reads the state (a checkpoint)
        or changes the engine's weights (a sync's load without in-flight updates)."""

    def prefetched(self) -> list[ScoredBatch]:
        """Batches made but not handed out yet, for a checkpoint to save."""

    def restore(self, batches: list[ScoredBatch]) -> None:
        """Hand ``batches`` (from a checkpoint) out first, before anything new."""

    def partial_state(self) -> Any:
        """The samples carried over to the next batch (partial rollouts), for a
        checkpoint to save (call inside :meth:`paused`); None without them."""

    def restore_partial(self, state: Any) -> None:
        """Carry over the samples a checkpoint saved (:meth:`partial_state`)."""

    def weights_synced(self, version: int) -> None:
        """The engine now samples policy ``version``."""

    def close(self) -> None:
        """Stop background work; the run is over."""


class RolloutProducer:
    """Makes scored batches synchronously; the base every schedule wraps.

    ``concurrent_rollout``: the rollout declared ``concurrent_generate``, so
    with streaming every chunk of a batch is requested at once and each is
    scored as soon as it lands."""

    def __init__(
        self,
        options: ProducerOptions,
        hook: Any,
        scorer: Any,
        stream: PromptStream,
        prompts_per_batch: int,
        sampling: SamplingSettings,
        concurrent_rollout: bool,
        episodes: RolloutDriver | None = None,
    ) -> None:
        self.options = options
        self.episodes = episodes
        self.hook = hook
        self.scorer = scorer
        self.stream = stream
        self.prompts_per_batch = prompts_per_batch
        self.sampling = sampling
        self.concurrent_rollout = concurrent_rollout
        self.num_generations = options.num_generations
        self.synced_version = 0  # the policy version the engine samples from
        self._restored: deque[ScoredBatch] = deque()  # from a checkpoint, handed out before anything new
        self.partial = (
            None if options.partial_budget is None else PartialRollouts(options.partial_budget, self.num_generations)
        )

    def restore(self, batches: list[ScoredBatch]) -> None:
        """Batches a checkpoint saved before they were trained on: the next
        :meth:`produce` calls return them, in order, as they were made
        (samples, rewards, advantages, policy version), without generating.
        The prompt stream moves past them, so the next new batch takes the
        prompts it took in the run that saved them."""
        if not batches:
            return
        self._restored.extend(batches)
        if batches[-1].stream_state:
            self.stream.load_state_dict(batches[-1].stream_state)

    def prefetched(self) -> list[ScoredBatch]:
        """Restored batches not handed out yet (saved again by a checkpoint)."""
        return list(self._restored)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Nothing runs in the background here: nothing to pause."""
        return contextlib.nullcontext()

    def partial_state(self) -> Any:
        """The open groups of partial rollouts, after the last batch made."""
        return None if self.partial is None else self.partial.state_dict()

    def restore_partial(self, state: Any) -> None:
        """The open groups a checkpoint saved; the next new batch continues them."""
        if self.partial is not None:
            self.partial.load_state_dict(state)
        elif state:
            raise GrpoError(
                f"the checkpoint carries {len(state)} unfinished group(s) of partial rollouts, and this run has no "
                "trl.partial_rollout_token_budget: resume with the budget it was saved with, so they finish"
            )

    def weights_synced(self, version: int) -> None:
        """The trainer synced ``version`` to the engine: rollouts requested
        from now on are stamped with it."""
        self.synced_version = version

    def close(self) -> None:
        """Nothing runs in the background here: nothing to stop."""

    def _generate(
        self,
        prompts: list[Prompt],
        version: int,
        seed_offset: int,
        n: int = 0,
        sampling: SamplingSettings | None = None,
    ) -> list[RolloutGroup]:
        """``n`` (default ``num_generations``) samples of each prompt, with
        ``sampling`` (default the run's)."""
        sampling = sampling or self.sampling
        if sampling.seed is not None:  # a distinct, reproducible seed per request
            sampling = SamplingSettings(**{**sampling.__dict__, "seed": sampling.seed * 1_000_003 + seed_offset})
        return sample_groups(self.hook, prompts, n or self.num_generations, sampling, version, self.episodes)

    def _chunks(self, prompts: list[Prompt]) -> list[list[Prompt]]:
        size = self.options.stream_chunk
        if size is None:
            return [prompts]
        return [prompts[i : i + size] for i in range(0, len(prompts), size)]

    def _score(self, groups: list[RolloutGroup], step: int) -> tuple[list[list[list[float | None]]], float]:
        started = time.perf_counter()
        try:
            rewards = self.scorer.score(groups, step)
            unscored_rows(groups, rewards)  # a failed agent episode takes no part in its group
            return rewards, time.perf_counter() - started
        finally:
            release(groups)  # episodes are closed once scored; only plain data is kept

    def _stream_concurrently(
        self, chunks: list[list[Prompt]], version: int, base_seed: int, step: int
    ) -> tuple[list[RolloutGroup], list[Any], float, float]:
        """Every chunk in flight at once; each scored as soon as the scorer is
        free after it lands, so scoring overlaps the generation still running.
        Generation time is measured from the request to the last landing, in
        the requesting threads (not when the scorer gets round to a chunk)."""
        started = time.perf_counter()

        def generate(i: int) -> tuple[list[RolloutGroup], float]:
            groups = self._generate(chunks[i], version, base_seed + i)
            return groups, time.perf_counter()

        landed: dict[int, tuple[list[RolloutGroup], list[Any]]] = {}
        landings: list[float] = []
        score_seconds = 0.0
        with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="grpo-rollout") as pool:
            futures = {pool.submit(generate, i): i for i in range(len(chunks))}
            for future in as_completed(futures):
                chunk_groups, landed_at = future.result()
                landings.append(landed_at)
                rewards, seconds = self._score(chunk_groups, step)
                score_seconds += seconds
                landed[futures[future]] = (chunk_groups, rewards)
        groups = [g for i in sorted(landed) for g in landed[i][0]]
        rewards = [r for i in sorted(landed) for r in landed[i][1]]
        return groups, rewards, max(landings) - started, score_seconds

    def _one_after_another(
        self, chunks: list[list[Prompt]], version: int, base_seed: int, step: int
    ) -> tuple[list[RolloutGroup], list[Any], float, float]:
        groups: list[RolloutGroup] = []
        rewards: list[Any] = []
        gen_seconds = score_seconds = 0.0
        for i, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            chunk_groups = self._generate(chunk, version, base_seed + i)
            gen_seconds += time.perf_counter() - t0
            chunk_rewards, seconds = self._score(chunk_groups, step)
            score_seconds += seconds
            groups.extend(chunk_groups)
            rewards.extend(chunk_rewards)
        return groups, rewards, gen_seconds, score_seconds

    def _partial_batch(
        self, prompts: list[Prompt], version: int, base_seed: int, step: int
    ) -> tuple[list[RolloutGroup], list[Any], float, float, dict[str, float]]:
        """Partial rollouts: the open samples continued and the new prompts
        begun, each by at most the budget; the groups that finished are scored."""
        assert self.partial is not None
        started = time.perf_counter()
        finished, metrics = self.partial.generate(
            prompts,
            self.sampling,
            version,
            lambda requests, n, sampling, offset: self._generate(requests, version, base_seed + offset, n, sampling),
            self.concurrent_rollout,
        )
        gen_seconds = time.perf_counter() - started
        if not finished:
            return [], [], gen_seconds, 0.0, metrics
        rewards, score_seconds = self._score(finished, step)
        return finished, rewards, gen_seconds, score_seconds, metrics

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        if self._restored:
            return self._restored.popleft()
        started = time.perf_counter()
        prompts = self.stream.take(self.prompts_per_batch)
        stream_state = self.stream.state_dict()
        prompts = self.hook.grpo_replay_prompts(prompts=prompts, progress=progress) or prompts
        version = self.synced_version
        chunks = self._chunks(prompts)
        base_seed = progress.step * 1000  # from the step, not a counter: resumed runs sample alike
        partial_metrics: dict[str, float] = {}
        if self.partial is not None:
            groups, rewards, gen_seconds, score_seconds, partial_metrics = self._partial_batch(
                prompts, version, base_seed, progress.step
            )
        else:
            concurrent = len(chunks) > 1 and self.concurrent_rollout
            schedule = self._stream_concurrently if concurrent else self._one_after_another
            groups, rewards, gen_seconds, score_seconds = schedule(chunks, version, base_seed, progress.step)

        scored = self._advantages(groups, rewards) if groups else []
        scored = self.hook.grpo_replay_groups(groups=scored, progress=progress) or scored
        metrics = batch_metrics(scored, self.scorer.names, self.scorer.weights)
        metrics.update(partial_metrics)
        metrics.update(episode_metrics(scored))
        metrics.update(environment_metrics(scored, self.scorer.weights))
        # generation: wall time until the last chunk landed; scoring: summed
        # time in reward functions. With concurrent streaming they overlap, so
        # their sum exceeds the batch's wall time.
        metrics["time/generation"] = gen_seconds
        metrics["time/scoring"] = score_seconds
        metrics["time/rollout_wall"] = time.perf_counter() - started
        return ScoredBatch(groups=scored, policy_version=version, metrics=metrics, stream_state=stream_state)

    def _advantages(self, groups: list[RolloutGroup], rewards: list[list[list[float | None]]]) -> list[ScoredGroup]:
        rows = [[math.nan if v is None else float(v) for v in row] for per_group in rewards for row in per_group]
        tensor = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(self.scorer.names))
        weights = torch.tensor(self.scorer.weights, dtype=torch.float32)
        completions = [c for group in groups for c in group.completions]
        advantages = self.hook.grpo_aggregate_advantages(
            rewards=tensor,
            weights=weights,
            group_size=self.num_generations,
            scale_rewards=self.options.scale_rewards,
            completions=completions,
            reward_names=list(self.scorer.names),
        )
        flat, per_token = per_completion_advantages(advantages, completions)
        scored, k = [], 0
        for group, per_group in zip(groups, rewards, strict=True):
            n = len(group.completions)
            tokens = None if per_token is None else per_token[k : k + n]
            scored.append(
                ScoredGroup(group=group, rewards=per_group, advantages=flat[k : k + n], token_advantages=tokens)
            )
            k += n
        return scored


def per_completion_advantages(
    result: Any, completions: list[Completion]
) -> tuple[list[float], list[list[float]] | None]:
    """What ``grpo_aggregate_advantages`` returned, as one advantage per
    completion and, when it gave one per token, those (zero where the loss
    mask is 0); each completion's own advantage is then the mean over its
    policy tokens (for logs). Refused with a sentence when the shape is not
    one the contract allows."""
    if isinstance(result, torch.Tensor) and result.dim() == 1 and result.numel() == len(completions):
        return [float(a) for a in result.tolist()], None
    if isinstance(result, (list, tuple)) and all(isinstance(a, (int, float)) for a in result):
        if len(result) == len(completions):
            return [float(a) for a in result], None
    if isinstance(result, (list, tuple)) and len(result) == len(completions):
        per_token: list[list[float]] = []
        means: list[float] = []
        for i, (row, completion) in enumerate(zip(result, completions, strict=True)):
            values = [float(a) for a in (row.tolist() if isinstance(row, torch.Tensor) else row)]
            if len(values) != len(completion.token_ids) or not all(math.isfinite(a) for a in values):
                raise PluginError(
                    f"advantage_aggregation: completion {i} got {len(values)} per-token advantages for "
                    f"{len(completion.token_ids)} tokens (or a non-finite one); the contract is one finite float "
                    "per entry of token_ids"
                )
            mask = completion.loss_mask or [1] * len(values)
            values = [a if m else 0.0 for a, m in zip(values, mask, strict=True)]
            per_token.append(values)
            policy = [a for a, m in zip(values, mask, strict=True) if m]
            means.append(sum(policy) / len(policy) if policy else 0.0)
        return means, per_token
    raise PluginError(
        f"advantage_aggregation returned {type(result).__name__} for {len(completions)} completions: the contract "
        "is a [num_completions] tensor, or one list of per-token advantages per completion"
    )


class PrefetchingProducer:
    """Runs a producer ``depth`` batches ahead in a background thread.

    Generation for batch k+1 overlaps training on batch k; the batch carries
    the policy version that generated it, so the trainer knows its staleness
    and importance sampling can correct for it. Errors in the thread surface
    on the next :meth:`produce` call in the trainer's thread.

    Checkpoints: the trainer reads its state inside :meth:`paused`, which
    waits for a batch being made to be finished and keeps the next from
    starting, so the batches :meth:`prefetched` returns, the prompt stream and
    the replay state all stand at the same point. Those batches are saved and,
    on resume, handed back (:meth:`restore`): out first, without generating,
    with their original policy version; the thread then goes on from the
    batch after them. See :meth:`grpo_core.training.trainer.GRPOTrainer.save` for
    what makes such a resume exact.
    """

    def __init__(self, inner: RolloutProducer, depth: int, steps_per_batch: int, max_steps: int) -> None:
        self.inner = inner
        self.depth = max(1, depth)
        self.steps_per_batch = steps_per_batch  # batch k is consumed at optimizer step k * steps_per_batch
        self.max_steps = max_steps
        self._queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(self.depth)
        self._stop = threading.Event()
        self._making = threading.Lock()  # held by the thread while it makes a batch
        self._gate = threading.Lock()  # held by a checkpoint: no new batch starts (the lock is not fair)
        self._thread: threading.Thread | None = None
        self._produced = 0

    def start(self, first_batch: int) -> None:
        self._produced = first_batch
        self._thread = threading.Thread(target=self._run, name="grpo-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # A slot frees when the trainer takes a batch: at most `depth`
            # batches exist ahead of training, the one being built included,
            # so a batch is never more than `depth` policy versions stale.
            if not self._slots.acquire(timeout=0.2):
                continue
            with self._gate:  # a checkpoint is being read: start after it
                pass
            with self._making:  # a checkpoint waits for this batch to be finished
                if self._stop.is_set():
                    return
                try:
                    item: Any = self.inner.produce(
                        TrainingProgress(step=self._produced * self.steps_per_batch, max_steps=self.max_steps)
                    )
                except BaseException as exc:  # handed to the trainer's thread
                    item = exc
                self._produced += 1
                self._queue.put(item)
            if isinstance(item, BaseException):
                return

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        if self._thread is None:
            self.start(progress.step // self.steps_per_batch)
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive():
                    raise RuntimeError("the prefetch thread stopped without producing a batch") from None
        self._slots.release()
        if isinstance(item, BaseException):
            raise item
        return item

    def weights_synced(self, version: int) -> None:
        self.inner.weights_synced(version)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No batch is being made inside this block: one in progress is
        finished first (a checkpoint, or a weight sync's load, waits for
        it), the next starts after."""
        with self._gate, self._making:
            yield

    def prefetched(self) -> list[ScoredBatch]:
        """The finished batches not yet taken by the trainer, oldest first
        (call inside :meth:`paused`). A failure waiting in the queue ends the
        list: batches after it were never made."""
        batches: list[ScoredBatch] = []
        for item in list(self._queue.queue):
            if isinstance(item, BaseException):
                break
            batches.append(item)
        return batches + self.inner.prefetched()

    def restore(self, batches: list[ScoredBatch]) -> None:
        """Hand ``batches`` (from a checkpoint) out first; see
        :meth:`RolloutProducer.restore`. The thread takes them as its first
        batches, each in a slot, so the batch after them is requested when
        it was in the run that saved them: when the trainer takes the first."""
        self.inner.restore(batches)

    def partial_state(self) -> Any:
        """The open groups after the last batch the thread made (call inside :meth:`paused`)."""
        return self.inner.partial_state()

    def restore_partial(self, state: Any) -> None:
        self.inner.restore_partial(state)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


class ScatteringProducer:
    """With several training processes: rank 0 produces each scored batch
    (the only process that talks to the inference engine and scores), the
    main thread cuts it into one share of whole groups per rank and scatters
    them. Each rank's batch carries the metrics of the whole batch (rewards
    are logged over everything sampled) and ``all_groups`` (rank 0 only) for
    the checkpoint.

    An error producing on rank 0 reaches every rank as the same error type,
    so all of them stop (and checkpoint) together instead of waiting on a
    scatter that never comes. ``inner`` is None on the other ranks.

    With ``spread`` (:mod:`~grpo_core.generation.spread`) rank 0's
    generation calls are spread over every rank: while the other ranks wait
    for their share they may receive a :class:`GenerateShare` instead, which
    they sample and go on waiting; the batch's metrics then say how many
    completions each rank sampled."""

    def __init__(self, inner: Any, dist: Any, spread: SpreadGeneration | None = None) -> None:
        self.inner = inner
        self.dist = dist
        self.spread = spread

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        per_rank: list[Any] | None = None
        if self.dist.is_main:
            try:
                batch = self.inner.produce(progress)
                if self.spread is not None:
                    batch.metrics.update(self.spread.take_metrics())
                per_rank = [
                    ScoredBatch(
                        groups=part,
                        policy_version=batch.policy_version,
                        metrics=batch.metrics,
                        stream_state=batch.stream_state,
                    )
                    for part in shares(batch.groups, self.dist.world)
                ]
            except BaseException as exc:
                per_rank = [_Failure(type(exc), str(exc), _checkpoints_on(exc))] * self.dist.world
                self.dist.scatter(per_rank)
                raise
        mine = self.dist.scatter(per_rank)
        while isinstance(mine, GenerateShare):  # rank 0 is generating: sample this rank's share, then wait again
            assert self.spread is not None, "rank 0 spread a generation call, but this rank has no rollout"
            self.spread.serve(mine)
            mine = self.dist.scatter(None)
        if isinstance(mine, _Failure):
            raise mine.error()
        return mine

    def weights_synced(self, version: int) -> None:
        if self.inner is not None:
            self.inner.weights_synced(version)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0's producer paused (a checkpoint reads its state); nothing runs elsewhere."""
        return self.inner.paused() if self.inner is not None else contextlib.nullcontext()

    def prefetched(self) -> list[ScoredBatch]:
        """Rank 0's whole batches made ahead of training (saved whole, scattered again when handed out)."""
        return self.inner.prefetched() if self.inner is not None else []

    def restore(self, batches: list[ScoredBatch]) -> None:
        if self.inner is not None:
            self.inner.restore(batches)

    def partial_state(self) -> Any:
        """Rank 0's open groups (partial rollouts run with one training process only)."""
        return self.inner.partial_state() if self.inner is not None else None

    def restore_partial(self, state: Any) -> None:
        if self.inner is not None:
            self.inner.restore_partial(state)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


@dataclass
class _Failure:
    """Rank 0's producer error, as sent to the other ranks."""

    kind: type
    message: str
    checkpoints: bool  # the trainer saves a checkpoint on this error: every rank must take part

    def error(self) -> BaseException:
        try:
            error = self.kind(f"on rank 0: {self.message}")
        except Exception:  # an exception type whose constructor takes other arguments
            error = None
        if error is None or _checkpoints_on(error) != self.checkpoints:
            text = f"rank 0 failed producing a batch: {self.kind.__name__}: {self.message}"
            return PluginError(text) if self.checkpoints else RuntimeError(text)
        return error


def _checkpoints_on(exc: BaseException) -> bool:
    return isinstance(exc, (EngineUnavailable, RewardError, PluginError))

"""Generation on every training process, for a rollout that samples the trainer's model.

With several processes rank 0 alone drives the producer (prompt order,
rewards, advantages, replay, checkpoints). For a rollout that samples the
trainer's own model and declares ``generates_on_every_rank``, only its
*generation calls* are spread: rank 0's call is cut into contiguous shares of
whole prompts (every completion of a prompt on one process), each process
samples its share with its own rollout instance while the training backend
makes the whole policy available on it (FSDP2: unsharded; ZeRO-3: gathered
parameters; DDP: the replica as it is), and rank 0 puts the groups back in
prompt order. Under FSDP/ZeRO-3 no process then needs a full copy of the
policy to sample, and no process idles while rank 0 generates.

The other processes take part from :class:`~grpo_core.generation.producer.ScatteringProducer`:
while they wait for their share of the scored batch they receive either that
share or a :class:`GenerateShare`, which they serve and go on waiting. Every
call issues its collectives from the trainer's main thread (never with
``async_prefetch``, whose producer thread must issue none), one call at a
time. A process that fails to generate sends its error to rank 0, which
raises it there; the producer's own failure path then stops every process
together.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from grpo_core.contract.errors import shareable_error
from grpo_core.contract.types import Prompt, RolloutGroup, SamplingSettings
from grpo_core.runtime.distributed import Distributed

GenerationModel = Callable[[], contextlib.AbstractContextManager[Any]]
"""The backend's context that makes the whole policy usable on this process
for a block (a collective: every process enters it together); yields the model."""


class SampledModel:
    """What ``context.get_model()`` returns to a rollout that samples the
    trainer's model: inside a spread generation call, the policy the backend
    made whole on this process; otherwise rank 0's model for sampling alone
    (evaluation, ``async_prefetch``: the backend's ``sampling_model``), made
    on first use, so a run that never samples on rank 0 alone never places
    a full copy on the device."""

    def __init__(self, alone: Callable[[], Any] | None = None) -> None:
        self.alone = alone  # None until the model has loaded
        self._alone_model: Any = None
        self._lent: Any = None

    def __call__(self) -> Any:
        if self._lent is not None:
            return self._lent
        if self._alone_model is None and self.alone is not None:
            self._alone_model = self.alone()
        return self._alone_model

    @contextlib.contextmanager
    def lent(self, model: Any) -> Iterator[None]:
        self._lent = model
        try:
            yield
        finally:
            self._lent = None


@dataclass
class GenerateShare:
    """Rank 0's request to one process: sample this share of a call."""

    prompts: list[Prompt]
    num_generations: int
    sampling: SamplingSettings  # prompt_offset: where the share starts in the whole call
    policy_version: int


def prompt_shares(count: int, world: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each process's contiguous share of ``count``
    prompts: as even as the count allows, the larger shares first (a call
    of fewer prompts than processes leaves the last ones without any)."""
    size, extra = divmod(count, world)
    bounds, start = [], 0
    for rank in range(world):
        stop = start + size + (rank < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class SpreadGeneration:
    """The hook relay rank 0's producer calls, with ``grpo_rollout_generate``
    spread over every process (everything else is the host's own hook).

    ``generation_model`` is the backend's context that makes the policy whole
    on this process; ``sampled`` is what the rollout's ``get_model()`` reads."""

    def __init__(
        self,
        hook: Any,
        dist: Distributed,
        generation_model: GenerationModel,
        sampled: SampledModel,
        log: Callable[[str], None] = print,
    ) -> None:
        self.hook = hook
        self.dist = dist
        self.generation_model = generation_model
        self.sampled = sampled
        self.log = log
        self._one_call = threading.Lock()  # collectives of one call at a time, in order
        self._sampled_per_rank = [0] * dist.world

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hook, name)

    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        """Rank 0: one call, spread. Every process samples its share; the
        groups come back in ``prompts``' order. The first process's error
        (rank 0's own first) is raised here after every process has answered."""
        requests = [
            GenerateShare(
                prompts[start:stop],
                num_generations,
                replace(sampling, prompt_offset=sampling.prompt_offset + start),
                policy_version,
            )
            for start, stop in prompt_shares(len(prompts), self.dist.world)
        ]
        with self._one_call:
            mine = self.dist.scatter(requests)
            answers = self.dist.gather(self._generate(mine))
        failures = [(rank, answer) for rank, answer in enumerate(answers) if isinstance(answer, BaseException)]
        if failures:
            rank, error = failures[0]
            if rank:
                self.log(f"process {rank} failed to generate its share of the prompts: {type(error).__name__}: {error}")
            raise error
        for rank, groups in enumerate(answers):
            self._sampled_per_rank[rank] += sum(len(group.completions) for group in groups)
        return [group for groups in answers for group in groups]

    def serve(self, request: GenerateShare) -> None:
        """Another rank: sample ``request`` and send the groups (or the error) to rank 0."""
        self.dist.gather(self._generate(request))

    def _generate(self, request: GenerateShare) -> list[RolloutGroup] | BaseException:
        """This process's share, inside the backend's context (entered by
        every process, even one whose share is empty). An error is returned,
        in a form another process can receive, not raised: every process
        must still reach the gather."""
        try:
            with self.generation_model() as model, self.sampled.lent(model):
                if not request.prompts:
                    return []
                groups = self.hook.grpo_rollout_generate(
                    prompts=request.prompts,
                    num_generations=request.num_generations,
                    sampling=request.sampling,
                    policy_version=request.policy_version,
                )
            if groups is None or len(groups) != len(request.prompts):
                raise RuntimeError(
                    f"the rollout returned {0 if groups is None else len(groups)} groups for "
                    f"{len(request.prompts)} prompts"
                )
            return list(groups)
        except Exception as exc:
            return shareable_error(exc)

    def take_metrics(self) -> dict[str, float]:
        """Completions each process sampled since the last call (one batch's), as metrics."""
        counts, self._sampled_per_rank = self._sampled_per_rank, [0] * self.dist.world
        if not any(counts):
            return {}
        return {f"completions/sampled_on_rank_{rank}": float(count) for rank, count in enumerate(counts)}

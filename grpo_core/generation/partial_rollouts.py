"""Partial rollouts (``trl.partial_rollout_token_budget``): a token budget per
generation batch, and the samples carried over to the next batch.

Without it a batch is ready only when its longest sample is: one long
generation holds the whole step. With it (Kimi k1.5's and AReaL's partial
rollouts), every sample generates at most ``budget`` tokens per batch; one
that has not finished is carried over and continues in the next batch from
its exact ids, under the weights the engine holds then.

- A batch asks for the first ``min(budget, max_completion_length)`` tokens
  of each sample of its new prompts, and for ``min(budget, what is left of
  max_completion_length)`` more of every sample carried over from earlier
  batches. A continuation's prompt is the prompt's ids followed by the
  sample's ids so far (never re-tokenised), so it conditions on exactly
  what was sampled; its tokens carry the version they were sampled with
  (``Completion.token_versions``), so staleness and the importance weights
  stay per token.
- A sample is **open** when its last piece stopped at the piece's
  ``max_tokens`` (truncated) below ``max_completion_length``; an end of
  sequence or stop token, ``max_completion_length``, or an engine that gave
  fewer tokens than asked (its context full) closes it.
- A prompt's **group trains in the batch where its last open member
  closes**: group-relative advantages need every member's reward. Its
  closed members wait in the buffer unchanged until then. A batch is
  therefore the groups that finished in it: the first batches hold fewer
  than ``prompts_per_batch`` (possibly none: a step with nothing to train),
  later ones about that many on average. Every sample closes within
  ``ceil(max_completion_length / budget)`` batches, so the buffer stays
  bounded.
- The buffer is part of every checkpoint (:meth:`PartialRollouts.state_dict`:
  each open group's prompt, exact ids, sampler log-probs, versions, text,
  and which members are still open), so a resumed run continues the same
  samples: nothing is lost, nothing generated twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, SamplingSettings
from grpo_core.generation.token_versions import versions_of

Generate = Callable[[list[Prompt], int, SamplingSettings, int], list[RolloutGroup]]
"""``(prompts, num_generations, sampling, seed_offset) -> one group per prompt``: one rollout call."""


@dataclass
class OpenGroup:
    """A prompt's group with at least one member still generating."""

    prompt: Prompt
    completions: list[Completion]  # each member's tokens so far
    open: list[bool]  # which members go on in the next batch
    batches: int = 1  # generation batches it has taken part in


def empty_completion() -> Completion:
    return Completion(token_ids=[], text="", logprobs=[], token_versions=[])


def piece_sampling(sampling: SamplingSettings, already: int, budget: int) -> SamplingSettings:
    """``sampling`` for the next piece of a sample holding ``already`` tokens:
    at most ``budget`` tokens, never past ``sampling.max_tokens`` in all; a
    ``min_tokens`` generation kwarg counts the tokens already sampled."""
    asked = min(budget, sampling.max_tokens - already)
    extra = dict(sampling.extra)
    if isinstance(extra.get("min_tokens"), int):
        extra["min_tokens"] = min(asked, max(0, extra["min_tokens"] - already))
    return dataclasses.replace(sampling, max_tokens=asked, extra=extra)


def fold(done: Completion, piece: Completion, version: int) -> Completion:
    """``done`` followed by ``piece`` (one rollout answer for its
    continuation): exact ids appended, the sampler's log-probs, each new
    token's version (the piece's own when the engine recorded them, else
    ``version``), the text; ``truncated`` and ``extra`` are the piece's."""
    versions = versions_of(piece, version)  # checks one per token
    logprobs = None
    if done.logprobs is not None and piece.logprobs is not None:
        if len(piece.logprobs) != len(piece.token_ids):
            raise ValueError(f"a piece has {len(piece.logprobs)} log-probs for {len(piece.token_ids)} tokens")
        logprobs = list(done.logprobs) + list(piece.logprobs)
    return dataclasses.replace(
        piece,
        token_ids=list(done.token_ids) + list(piece.token_ids),
        text=done.text + piece.text,
        logprobs=logprobs,
        token_versions=list(done.token_versions or []) + versions,
    )


def still_open(piece: Completion, asked: int, total: int, limit: int) -> bool:
    """Whether a sample goes on: its last piece (``asked`` tokens asked for)
    stopped at its own max_tokens, and the sample (``total`` tokens) is still
    below ``limit`` (``max_completion_length``)."""
    return piece.truncated and len(piece.token_ids) >= asked and total < limit


class PartialRollouts:
    """The buffer of open groups, and one batch's generation over it."""

    def __init__(self, budget: int, num_generations: int) -> None:
        if budget < 1:
            raise ValueError("the partial rollout token budget must be at least 1")
        self.budget = budget
        self.num_generations = num_generations
        self.groups: list[OpenGroup] = []

    def generate(
        self,
        prompts: list[Prompt],
        sampling: SamplingSettings,
        version: int,
        call: Generate,
        concurrent: bool,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """One batch: the open samples' continuations and the first piece of
        ``num_generations`` samples of each new prompt, under ``version``.
        Returns the groups that finished (those carried over first, oldest
        first, then the new ones in prompt order), each stamped ``version``
        with every token's own version recorded, and the batch's metrics;
        the groups still open stay in the buffer."""
        limit = sampling.max_tokens
        jobs: list[tuple[list[Prompt], int, SamplingSettings, list[tuple[int, int]] | None]] = []
        waiting: dict[int, list[tuple[int, int]]] = {}  # tokens so far -> (group, member) still open
        for g, group in enumerate(self.groups):
            for m, completion in enumerate(group.completions):
                if group.open[m]:
                    waiting.setdefault(len(completion.token_ids), []).append((g, m))
        for already, members in sorted(waiting.items()):  # one call per length: one max_tokens each
            continuations = [
                dataclasses.replace(
                    self.groups[g].prompt,
                    prompt_ids=list(self.groups[g].prompt.prompt_ids) + list(self.groups[g].completions[m].token_ids),
                )
                for g, m in members
            ]
            jobs.append((continuations, 1, piece_sampling(sampling, already, self.budget), members))
        if prompts:
            jobs.append((prompts, self.num_generations, piece_sampling(sampling, 0, self.budget), None))

        def run(j: int) -> list[RolloutGroup]:
            requests, n, piece, _ = jobs[j]
            out = call(requests, n, piece, j)
            if len(out) != len(requests) or any(len(group.completions) != n for group in out):
                raise RuntimeError(
                    f"partial rollouts: the rollout returned {len(out)} groups for {len(requests)} prompts, or not "
                    f"{n} completions each"
                )
            return out

        if concurrent and len(jobs) > 1:  # every call in flight at once: the engine batches them
            with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="grpo-partial") as pool:
                answers = list(pool.map(run, range(len(jobs))))
        else:
            answers = [run(j) for j in range(len(jobs))]

        continued = 0
        new_groups: list[OpenGroup] = []
        for (_, _, piece_settings, members), answer in zip(jobs, answers, strict=True):
            asked = piece_settings.max_tokens
            if members is None:  # the new prompts' first pieces
                for prompt, group in zip(prompts, answer, strict=True):
                    completions = [fold(empty_completion(), c, version) for c in group.completions]
                    opened = [still_open(c, asked, len(c.token_ids), limit) for c in completions]
                    new_groups.append(OpenGroup(prompt, completions, opened, batches=0))
                continue
            for (g, m), group in zip(members, answer, strict=True):
                owner = self.groups[g]
                piece = group.completions[0]
                owner.completions[m] = fold(owner.completions[m], piece, version)
                owner.open[m] = still_open(piece, asked, len(owner.completions[m].token_ids), limit)
                continued += 1

        finished: list[RolloutGroup] = []
        kept: list[OpenGroup] = []
        carried_finished = 0
        for group in self.groups + new_groups:
            group.batches += 1
            if any(group.open):
                kept.append(group)
                continue
            carried_finished += int(group.batches > 1)
            finished.append(RolloutGroup(group.prompt, list(group.completions), version))
        self.groups = kept
        metrics = {
            "partial/finished_groups": float(len(finished)),
            "partial/finished_carried_groups": float(carried_finished),
            "partial/continued_samples": float(continued),
            "partial/open_groups": float(len(kept)),
            "partial/open_samples": float(sum(sum(g.open) for g in kept)),
        }
        return finished, metrics

    def state_dict(self) -> list[dict[str, Any]]:
        """Every open group as plain data a checkpoint holds (grpo's contract
        dataclasses, lists, numbers): the prompt, each member's exact ids,
        sampler log-probs, versions and text, and which members are open."""
        return [
            {
                "prompt": g.prompt,
                "completions": list(g.completions),
                "open": list(g.open),
                "batches": g.batches,
            }
            for g in self.groups
        ]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        """The buffer a checkpoint saved (:meth:`state_dict`); ``None`` or
        empty: nothing carried over."""
        self.groups = [
            OpenGroup(
                prompt=s["prompt"],
                completions=list(s["completions"]),
                open=[bool(o) for o in s["open"]],
                batches=int(s.get("batches", 1)),
            )
            for s in state or []
        ]
        for group in self.groups:
            if len(group.completions) != self.num_generations or len(group.open) != self.num_generations:
                raise GrpoError(
                    f"the checkpoint's partial rollouts hold groups of {len(group.completions)} samples, and "
                    f"trl.num_generations is {self.num_generations}: resume with the num_generations it was saved with"
                )

"""From scored groups to padded tensors.

A generation batch feeds ``steps_per_generation(cfg)`` optimizer steps
(TRL's meaning of ``generation_batch_size`` / ``steps_per_generation``):
its completions are cut, in order, into that many equal slices, one per
step, and each slice into ``gradient_accumulation_steps`` micro-batches of
``micro_batch_size``. Within a slice completions are sorted by length first,
so each micro-batch pads to a similar length: on CPU the padding is pure
wasted compute. Where the loss allows (token-sum losses), the cuts between
micro-batches move to where they pad least, so a micro-batch may hold more
or fewer than ``micro_batch_size`` rows, never more padded tokens than the
equal split's largest.

A completion's ``loss_mask`` (multi-turn episodes: 0 on the tokens the
environment or the chat template inserted) becomes its row of
``completion_mask``, so every loss term, normaliser and importance weight
downstream sees only the tokens the policy sampled.

Advantages are one per completion (``MicroBatch.advantages`` ``[B]``), or,
when the run's ``advantage_aggregation`` credits each turn, one per
completion token (``[B, C]``, aligned with ``completion_mask``; a
micro-batch holding any such row is ``[B, C]``, the others' one value
repeated along their row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.config.batch_shape import (
    generation_batch_size,
    global_step_batch,
    steps_per_batch,
    steps_per_generation,
)
from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import ScoredGroup

__all__ = [
    "MicroBatch",
    "Sample",
    "collate",
    "completion_tokens",
    "flatten",
    "generation_batch_size",
    "global_step_batch",
    "least_padding_cuts",
    "micro_batch_count",
    "micro_batches",
    "step_slices",
    "steps_per_batch",
    "steps_per_generation",
    "with_signal_first",
]


@dataclass
class Sample:
    """One completion with everything the loss needs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampler_logps: list[float] | None = None
    truncated: bool = False
    replayed: bool = False
    loss_mask: list[int] | None = None  # 1 = policy token; None: all ones
    token_advantages: list[float] | None = None  # one per completion token (per-turn credit); None: `advantage`

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def model_tokens(self) -> int:
        """Completion tokens the policy sampled: what the loss trains and counts."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))

    @property
    def has_signal(self) -> bool:
        if self.token_advantages is not None:
            return any(abs(a) > 1e-8 for a in self.token_advantages)
        return abs(self.advantage) > 1e-8


@dataclass
class MicroBatch:
    """Prompt left-padded + completion right-padded, as the model reads it."""

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C] float, 1 on real completion tokens
    advantages: torch.Tensor  # [B], or [B, C] when a row has per-token advantages
    sampler_logps: torch.Tensor | None  # [B, C] or None when the engine gave none
    replayed: torch.Tensor  # [B] bool
    old_logps: torch.Tensor | None = None  # filled when num_iterations > 1 or replay needs it
    ref_logps: torch.Tensor | None = None  # filled when beta > 0

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def has_signal(self) -> bool:
        return bool((self.advantages.abs() > 1e-8).any())


def flatten(groups: list[ScoredGroup]) -> list[Sample]:
    samples = []
    for scored in groups:
        per_token = scored.token_advantages or [None] * len(scored.advantages)
        for completion, advantage, tokens in zip(scored.group.completions, scored.advantages, per_token, strict=True):
            samples.append(
                Sample(
                    prompt_ids=scored.group.prompt.prompt_ids,
                    completion_ids=completion.token_ids,
                    advantage=advantage,
                    sampler_logps=completion.logprobs,
                    truncated=completion.truncated,
                    replayed=scored.replayed,
                    loss_mask=_checked_mask(completion.loss_mask, len(completion.token_ids)),
                    token_advantages=None if tokens is None else _checked_advantages(tokens, len(completion.token_ids)),
                )
            )
    return samples


def _checked_advantages(values: list[float], length: int) -> list[float]:
    """Per-token advantages, refused with a sentence unless one per completion token."""
    if len(values) != length:
        raise GrpoError(
            f"a completion's per-token advantages have {len(values)} entries for {length} tokens: the "
            "advantage_aggregation that made them must give one per entry of token_ids"
        )
    return [float(a) for a in values]


def _checked_mask(mask: list[int] | None, length: int) -> list[int] | None:
    """``mask`` as 0/1 ints, refused with a sentence when it cannot be one
    entry per completion token (a rollout or episode driver bug)."""
    if mask is None:
        return None
    values = [int(m) for m in mask]
    if len(values) != length or any(m not in (0, 1) for m in values):
        bad = f"{len(values)} entries for {length} tokens" if len(values) != length else "values other than 0 and 1"
        raise GrpoError(
            f"a completion's loss_mask has {bad}: the rollout (or episode driver) that made it must give "
            "one 0/1 entry per token of token_ids (1 = sampled by the policy)."
        )
    return values


def completion_tokens(samples: list[Sample], mask_truncated: bool) -> int:
    """Completion tokens the loss trains on in ``samples`` (what the
    completion mask counts): the policy's tokens (loss mask 1) of every
    completion not masked out for truncation."""
    return sum(s.model_tokens for s in samples if not (mask_truncated and s.truncated))


def with_signal_first(part: list[Sample], rows: int) -> list[Sample]:
    """The samples of ``part`` that carry a learning signal, topped up with
    zero-advantage ones (which add nothing to a token-sum loss) to at least
    ``rows`` samples where there are too few; in their original order."""
    topup = max(0, rows - sum(s.has_signal for s in part))
    keep = []
    for s in part:
        if s.has_signal:
            keep.append(s)
        elif topup:
            keep.append(s)
            topup -= 1
    return keep


def collate(samples: list[Sample], pad_id: int, mask_truncated: bool) -> MicroBatch:
    batch = len(samples)
    max_prompt = max(len(s.prompt_ids) for s in samples)
    max_completion = max(1, max(len(s.completion_ids) for s in samples))
    input_ids = torch.full((batch, max_prompt + max_completion), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, max_prompt + max_completion), dtype=torch.long)
    completion_mask = torch.zeros((batch, max_completion), dtype=torch.float32)
    has_sampler = all(s.sampler_logps is not None for s in samples)
    sampler = torch.zeros((batch, max_completion), dtype=torch.float32) if has_sampler else None
    per_token = any(s.token_advantages is not None for s in samples)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    if per_token:  # [B, C]: each token its own; a row with one advantage repeats it
        advantages = advantages.unsqueeze(1).repeat(1, max_completion)
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, max_prompt - p : max_prompt] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[row, max_prompt - p : max_prompt] = 1
        if c:
            input_ids[row, max_prompt : max_prompt + c] = torch.tensor(s.completion_ids, dtype=torch.long)
            attention[row, max_prompt : max_prompt + c] = 1
            row_mask = torch.ones(c) if s.loss_mask is None else torch.tensor(s.loss_mask[:c], dtype=torch.float32)
            if not (mask_truncated and s.truncated):
                completion_mask[row, :c] = row_mask
            if s.token_advantages is not None:
                advantages[row, :c] = torch.tensor(s.token_advantages[:c], dtype=torch.float32)
                advantages[row, c:] = 0.0
            if sampler is not None:
                logps = torch.tensor(s.sampler_logps[:c], dtype=torch.float32)  # type: ignore[index]
                # the engine's value at an environment token means nothing (drivers write 0.0): keep it finite
                sampler[row, :c] = torch.where(row_mask.bool(), logps, torch.zeros_like(logps))
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=completion_mask,
        advantages=advantages,
        sampler_logps=sampler,
        replayed=torch.tensor([s.replayed for s in samples], dtype=torch.bool),
    )


def micro_batch_count(rows: int, micro_batch_size: int) -> int:
    """Micro-batches that ``rows`` samples fill (the last one may be partial)."""
    return -(-rows // micro_batch_size)


def micro_batches(
    samples: list[Sample], micro_batch_size: int, pad_id: int, mask_truncated: bool, balanced: bool = False
) -> list[MicroBatch]:
    """Split into micro-batches of similar total length (sorted, then chunked).

    ``balanced``: as many micro-batches, cut where they pad least
    (:func:`least_padding_cuts`) instead of every ``micro_batch_size`` rows.
    Only for a loss that does not depend on which rows share a micro-batch
    (a token-sum loss normalised over the whole batch): with a per-sequence or
    per-micro-batch mean, unequal micro-batches would weigh rows differently."""
    ordered = sorted(samples, key=lambda s: s.length)
    if balanced:
        cuts = least_padding_cuts([s.length for s in ordered], micro_batch_size)
    else:
        cuts = _equal_cuts(len(ordered), micro_batch_size)
    return [collate(ordered[a:b], pad_id, mask_truncated) for a, b in zip(cuts, cuts[1:])]


def _equal_cuts(rows: int, micro_batch_size: int) -> list[int]:
    """``[0, micro_batch_size, 2 * micro_batch_size, ..., rows]``: full micro-batches, the last one partial."""
    return list(range(0, rows, micro_batch_size)) + [rows]


LEAST_PADDING_MAX_ROWS = 512
"""Above this many rows a step keeps equal micro-batches (the search's table grows as rows squared)."""

LEAST_PADDING_MIN_SAVING = 0.10
"""Unequal cuts are taken only where they pad at least this share less than
equal ones: on a CPU a small saving was lost to the shapes' noise
(benchmarks/RESULTS.md, "Micro-batches cut where they pad least")."""


def least_padding_cuts(lengths: list[int], micro_batch_size: int) -> list[int]:
    """Where to cut ``lengths`` (ascending) into ``ceil(rows / micro_batch_size)``
    contiguous micro-batches so that the padded area, each micro-batch's rows
    times its longest row, is least in total: ``[0, ..., rows]``.

    Why: a step's completions are often bimodal (short answers beside ones
    cut at ``max_completion_length``), and equal micro-batches of sorted rows
    then pad many short rows to a long one. Each micro-batch's padded area
    stays within the largest area of the equal split, so peak memory does not
    grow; the micro-batch count stays, so ranks stay in step and the
    accumulation is the same. Exact search (dynamic programming over the cut
    points, one vectorised pass per micro-batch); ties keep earlier cuts.
    Equal cuts stay where the best saves less than
    :data:`LEAST_PADDING_MIN_SAVING` of their area."""
    rows = len(lengths)
    parts = micro_batch_count(rows, micro_batch_size)
    equal = _equal_cuts(rows, micro_batch_size)
    if parts <= 1 or rows > LEAST_PADDING_MAX_ROWS:
        return equal
    longest = torch.tensor(lengths, dtype=torch.float64)
    equal_areas = [(b - a) * float(longest[b - 1]) for a, b in zip(equal, equal[1:])]
    budget = max(equal_areas)
    starts = torch.arange(rows + 1, dtype=torch.float64)[:, None]
    ends = torch.arange(rows + 1, dtype=torch.float64)[None, :]
    # area[k, i]: rows k..i-1 in one micro-batch, padded to row i-1's length
    area = (ends - starts) * torch.cat([longest.new_zeros(1), longest])[None, :]
    area = torch.where((ends > starts) & (area <= budget), area, torch.inf)
    best = torch.full((rows + 1,), torch.inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for _ in range(parts):
        total = best[:, None] + area
        best, choice = total.min(dim=0)
        choices.append(choice)
    if not float(best[rows]) <= (1.0 - LEAST_PADDING_MIN_SAVING) * sum(
        equal_areas
    ):  # inf: cannot happen, the equal split is feasible
        return equal
    cuts = [rows]
    for choice in reversed(choices):
        cuts.append(int(choice[cuts[-1]]))
    return cuts[::-1]


def step_slices(samples: list[Sample], steps: int) -> list[list[Sample]]:
    """``samples`` cut, in order, into ``steps`` slices of equal size (the
    last takes any remainder), one per optimizer step."""
    size = len(samples) // steps
    return [samples[i * size : (i + 1) * size if i < steps - 1 else len(samples)] for i in range(steps)]

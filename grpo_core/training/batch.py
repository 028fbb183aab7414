"""From scored groups to padded tensors.

A generation batch becomes micro-batches of ``micro_batch_size``
completions. Completions are sorted by length first, so each micro-batch
pads to a similar length: on CPU the padding is pure wasted compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.types import ScoredGroup


@dataclass
class Sample:
    """One completion with everything the loss needs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampler_logps: list[float] | None = None
    truncated: bool = False
    replayed: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """Prompt left-padded + completion right-padded, as the model reads it."""

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C] float, 1 on real completion tokens
    advantages: torch.Tensor  # [B]
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
        for completion, advantage in zip(scored.group.completions, scored.advantages, strict=True):
            samples.append(
                Sample(
                    prompt_ids=scored.group.prompt.prompt_ids,
                    completion_ids=completion.token_ids,
                    advantage=advantage,
                    sampler_logps=completion.logprobs,
                    truncated=completion.truncated,
                    replayed=scored.replayed,
                )
            )
    return samples


def collate(samples: list[Sample], pad_id: int, mask_truncated: bool) -> MicroBatch:
    batch = len(samples)
    max_prompt = max(len(s.prompt_ids) for s in samples)
    max_completion = max(1, max(len(s.completion_ids) for s in samples))
    input_ids = torch.full((batch, max_prompt + max_completion), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, max_prompt + max_completion), dtype=torch.long)
    completion_mask = torch.zeros((batch, max_completion), dtype=torch.float32)
    has_sampler = all(s.sampler_logps is not None for s in samples)
    sampler = torch.zeros((batch, max_completion), dtype=torch.float32) if has_sampler else None
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[row, max_prompt - p : max_prompt] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[row, max_prompt - p : max_prompt] = 1
        if c:
            input_ids[row, max_prompt : max_prompt + c] = torch.tensor(s.completion_ids, dtype=torch.long)
            attention[row, max_prompt : max_prompt + c] = 1
            if not (mask_truncated and s.truncated):
                completion_mask[row, :c] = 1.0
            if sampler is not None:
                sampler[row, :c] = torch.tensor(s.sampler_logps[:c], dtype=torch.float32)  # type: ignore[index]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=completion_mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        sampler_logps=sampler,
        replayed=torch.tensor([s.replayed for s in samples], dtype=torch.bool),
    )


def micro_batches(samples: list[Sample], micro_batch_size: int, pad_id: int, mask_truncated: bool) -> list[MicroBatch]:
    """Split into micro-batches of similar total length (sorted, then chunked)."""
    ordered = sorted(samples, key=lambda s: s.length)
    return [
        collate(ordered[i : i + micro_batch_size], pad_id, mask_truncated)
        for i in range(0, len(ordered), micro_batch_size)
    ]

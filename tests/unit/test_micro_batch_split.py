"""Unequal micro-batches cut where they pad least (``least_padding_cuts``),
and ``micro_batch_split_is_free``, which allows them only where the loss does
not depend on which rows share a micro-batch.

The split test reuses test_zero_advantage_inert's exact inputs (multiples of
1/8 in float64, on-policy): each row's gradient summed over micro-batches of
3 + 3 rows and of 2 + 4 rows must be equal bit for bit, and the step's loss
to float64 rounding, where the function says the split is free, and must
differ everywhere else, so adding a loss type to the free set (or taking one
out) fails the test.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_zero_advantage_inert import VARIANTS, inputs, settings_for

from grpo_core.optimization.batch import LEAST_PADDING_MIN_SAVING, Sample, least_padding_cuts, micro_batches
from grpo_core.optimization.loss import LOSS_TYPES, LossSettings, micro_batch_split_is_free, policy_loss


def step_loss_and_grad(settings: LossSettings, data: dict, split: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss and d loss / d logps, accumulated over micro-batches of ``split``'s rows."""
    logps = data["logps"].clone().requires_grad_(True)
    full_tokens = data["mask"].sum()
    total = torch.zeros((), dtype=torch.float64)
    for rows in split:
        pick = {k: (v[rows] if v is not None else None) for k, v in data.items() if k != "logps"}
        loss, _ = policy_loss(
            settings, logps[rows], num_items_in_batch=full_tokens, accumulation_steps=len(split), **pick
        )
        loss.backward()
        total = total + loss.detach()
    return total, logps.grad


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_unequal_micro_batches_change_nothing_exactly_where_the_split_is_free(loss_type: str, variant: str) -> None:
    settings = settings_for(loss_type, variant)
    free = micro_batch_split_is_free(settings)
    data = inputs(off_policy=False)
    data["advantages"] = torch.tensor([1.5, -0.75, 0.5, -0.5, 0.25, -1.0], dtype=torch.float64)
    equal_loss, equal_grad = step_loss_and_grad(settings, data, [[0, 1, 2], [3, 4, 5]])
    unequal_loss, unequal_grad = step_loss_and_grad(settings, data, [[0, 1], [2, 3, 4, 5]])
    assert float(equal_grad.abs().sum()) > 0.0  # the step has a gradient: a difference could show
    # each gradient element depends on its own token only where the split is free: exact; the
    # loss sums the same terms in another grouping (the KL terms are not multiples of 1/8)
    close = abs(float(equal_loss) - float(unequal_loss)) <= 1e-12 * max(abs(float(equal_loss)), 1e-30)
    same = torch.equal(equal_grad, unequal_grad) and close
    assert same == free, (
        f"{loss_type}/{variant}: micro_batch_split_is_free says {free}, but the split "
        f"{'changes nothing' if same else 'changes the step'}"
    )


def _padded(lengths: list[int], cuts: list[int]) -> list[int]:
    return [(b - a) * lengths[b - 1] for a, b in zip(cuts, cuts[1:])]


def test_least_padding_cuts_match_an_exhaustive_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        rows, size = rng.randint(1, 11), rng.randint(1, 5)
        lengths = sorted(rng.randint(1, 30) for _ in range(rows))
        parts = -(-rows // size)
        equal = list(range(0, rows, size)) + [rows]
        budget = max(_padded(lengths, equal))
        feasible = [[0, *inner, rows] for inner in itertools.combinations(range(1, rows), parts - 1)]
        best = min(sum(_padded(lengths, c)) for c in feasible if max(_padded(lengths, c)) <= budget)
        cuts = least_padding_cuts(lengths, size)
        assert (
            len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == rows and all(b > a for a, b in zip(cuts, cuts[1:]))
        )
        if best > (1 - LEAST_PADDING_MIN_SAVING) * sum(_padded(lengths, equal)):
            assert cuts == equal, (lengths, size, cuts)  # too small a saving: equal micro-batches
        else:
            assert sum(_padded(lengths, cuts)) == best, (lengths, size, cuts)
        assert max(_padded(lengths, cuts)) <= budget  # no micro-batch pads to more than the equal split's largest


def test_a_late_step_puts_its_few_long_answers_apart() -> None:
    """26 short answers and 6 cut at the length limit after 34-token prompts,
    micro_batch_size 16: the equal split pads 10 short completions to 48
    tokens; the cut at 26 pads them to 14."""
    completions = [6, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 14, 14, 14] + [
        48
    ] * 6
    assert least_padding_cuts([34 + n for n in completions], 16) == [0, 26, 32]
    assert sum(_padded(completions, [0, 26, 32])) < 0.7 * sum(_padded(completions, [0, 16, 32]))  # 652 against 944


def test_balanced_micro_batches_hold_every_row_once_in_as_many_micro_batches() -> None:
    rng = random.Random(1)
    samples = [
        Sample(prompt_ids=[1, 2, 3], completion_ids=list(range(100 * i, 100 * i + n)), advantage=1.0)
        for i, n in enumerate([rng.choice([3, 4, 5, 40]) for _ in range(20)])
    ]
    equal = micro_batches(samples, 8, 0, False)
    balanced = micro_batches(samples, 8, 0, False, balanced=True)
    assert len(balanced) == len(equal) == 3
    rows = lambda batches: sorted(tuple(r[r != 0].tolist()) for mb in batches for r in mb.input_ids)  # noqa: E731
    assert rows(balanced) == rows(equal)
    area = lambda batches: sum(mb.input_ids.numel() for mb in batches)  # noqa: E731
    assert area(balanced) < area(equal)
    assert max(mb.input_ids.numel() for mb in balanced) <= max(mb.input_ids.numel() for mb in equal)


def test_the_default_loss_cuts_where_padding_is_least_and_grpo_keeps_equal_micro_batches(tmp_path) -> None:
    from grpo_core.config.loader import validate

    config = {
        "base_model": "m",
        "datasets": [{"path": "d.jsonl"}],
        "output_dir": str(tmp_path),
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "trl": {"num_generations": 8, "reward_funcs": ["r.f"]},
    }
    default = LossSettings.from_config(validate(config))
    assert default.loss_type == "dapo" and micro_batch_split_is_free(default)
    grpo = LossSettings.from_config(validate({**config, "trl": {**config["trl"], "loss_type": "grpo"}}))
    assert not micro_batch_split_is_free(grpo)
    # what the trainer passes as micro_batches' `balanced`: unequal cuts for a bimodal step under dapo only
    rows = [Sample(prompt_ids=[1], completion_ids=[5] * n, advantage=1.0) for n in [2] * 12 + [40] * 4]
    for settings, unequal in ((default, True), (grpo, False)):
        sizes = [
            mb.input_ids.shape[0]
            for mb in micro_batches(rows, 8, 0, False, balanced=micro_batch_split_is_free(settings))
        ]
        assert sizes == ([12, 4] if unequal else [8, 8]), sizes

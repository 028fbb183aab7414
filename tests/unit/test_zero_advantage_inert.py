"""``zero_advantage_rows_are_inert`` is true exactly where leaving the
zero-advantage completions out leaves the loss and its gradient unchanged.

Tested on the loss itself, for every ``loss_type`` and for the two settings
that make the rows count (``beta > 0``, ``top_entropy_quantile < 1``): the
loss and the gradients of the kept rows are computed with the
zero-advantage rows and without them, the way the trainer leaves them out
(``num_items_in_batch`` stays the whole batch's token count). Where the
function says inert they must be equal, bit for bit; everywhere else they
must differ, so adding a loss type to the inert set (or taking one out)
fails this test.

Exact equality is a fair demand because the inputs are chosen so that
floating point adds them exactly in any order: on-policy (the ratio is
exp(0) = 1), with advantages and log-probs that are small multiples of
1/8 in float64. A second, off-policy case (ratios far from 1, some
clipped) asserts the gradients exactly (each is computed per element) and
the loss to 1e-12 relative (the same non-zero terms, possibly summed in a
different order by a longer tensor).
"""

from __future__ import annotations

import pytest
import torch

from grpo_core.optimization.loss import LOSS_TYPES, LossSettings, policy_loss, zero_advantage_rows_are_inert

B, C = 6, 5
KEPT = [0, 1, 2, 3]  # rows 4 and 5 have advantage 0
VARIANTS = {"plain": {}, "kl": {"beta": 0.04}, "entropy_quantile": {"top_entropy_quantile": 0.5}}


def inputs(off_policy: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    logps = -torch.randint(1, 24, (B, C), generator=g).double() / 8  # multiples of 1/8: sums are exact
    advantages = torch.tensor([1.5, -0.75, 0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    mask = torch.ones(B, C, dtype=torch.float64)
    mask[1, 3:] = 0.0
    mask[4, 4:] = 0.0  # padding in a zero-advantage row too
    entropy = torch.rand(B, C, generator=g, dtype=torch.float64)
    entropy[4:] += 2.0  # the zero-advantage rows hold the highest-entropy tokens: they move the quantile
    ref = logps + torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5
    old = logps + (torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5) if off_policy else None
    return {
        "logps": logps,
        "advantages": advantages,
        "mask": mask,
        "entropy": entropy,
        "ref_logps": ref,
        "old_logps": old,
    }


def settings_for(loss_type: str, variant: str) -> LossSettings:
    """``loss_type`` with ``VARIANTS[variant]``; cispo's upper bound wide, as its raw-ratio cap needs."""
    return LossSettings(
        loss_type=loss_type, epsilon=0.2, epsilon_high=0.28 if loss_type != "cispo" else 5.0, **VARIANTS[variant]
    )


def loss_and_grad(settings: LossSettings, data: dict, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over ``rows`` of the batch and d loss / d logps of those rows."""
    pick = {k: (v[rows] if v is not None else None) for k, v in data.items()}
    logps = pick.pop("logps").clone().requires_grad_(True)
    full_tokens = data["mask"].sum()  # the whole batch's tokens, whichever rows run (as the trainer passes it)
    loss, _ = policy_loss(settings, logps, num_items_in_batch=full_tokens, **pick)
    loss.backward()
    return loss.detach(), logps.grad


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_advantage_rows_change_nothing_exactly_where_inert(loss_type: str, variant: str) -> None:
    settings = settings_for(loss_type, variant)
    inert = zero_advantage_rows_are_inert(settings)
    data = inputs(off_policy=False)
    with_all, grad_all = loss_and_grad(settings, data, list(range(B)))
    without, grad_kept = loss_and_grad(settings, data, KEPT)
    assert float(without) != 0.0  # the kept rows carry a loss: a difference could show
    same = torch.equal(with_all, without) and torch.equal(grad_all[KEPT], grad_kept)
    change = (
        "changes nothing" if same else f"changes the loss {float(with_all)!r} -> {float(without)!r} or its gradient"
    )
    assert same == inert, (
        f"{loss_type}/{variant}: zero_advantage_rows_are_inert says {inert}, but leaving the rows out {change}"
    )
    if inert:
        assert torch.equal(grad_all[4:], torch.zeros_like(grad_all[4:]))  # the rows left out had no gradient either


@pytest.mark.parametrize(
    "loss_type",
    [
        t
        for t in LOSS_TYPES
        if zero_advantage_rows_are_inert(LossSettings(loss_type=t, epsilon_high=5.0 if t == "cispo" else 0.2))
    ],
)
def test_inert_off_policy_too(loss_type: str) -> None:
    """Ratios far from 1 (some clipped, for the PPO types): still inert."""
    settings = LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28 if loss_type != "cispo" else 1.2)
    data = inputs(off_policy=True)
    ratio = torch.exp(data["logps"] - data["old_logps"])
    assert bool(((ratio > 1.28) | (ratio < 0.8)).any())  # clipping is in play
    with_all, grad_all = loss_and_grad(settings, data, list(range(B)))
    without, grad_kept = loss_and_grad(settings, data, KEPT)
    assert torch.equal(grad_all[KEPT], grad_kept)
    assert torch.equal(grad_all[4:], torch.zeros_like(grad_all[4:]))
    assert abs(float(with_all) - float(without)) <= 1e-12 * abs(float(without))

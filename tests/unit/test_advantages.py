"""Advantage aggregation: parity with TRL 1.16's own code, edge cases, fuzz.

TRL computes advantages inline in ``GRPOTrainer._generate_and_score_completions``
(no function to call), so the parity test executes that block of TRL's
source text itself, cut out between two marker lines, on the same rewards.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl_source import trl_block

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import GrpoError
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins.advantages import NormalizeThenSum, SumThenNormalize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns about the vLLM version at import
    from trl.trainer import grpo_trainer as trl_grpo

CLASSES = {"sum_then_normalize": SumThenNormalize, "normalize_then_sum": NormalizeThenSum}


TRL_ADVANTAGES = trl_block(
    trl_grpo.GRPOTrainer._generate_and_score_completions,
    "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
    "# Slice to keep only the local part of the data",
)


def trl_advantages(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale: str, strategy: str):
    trainer = SimpleNamespace(
        multi_objective_aggregation=strategy,
        reward_weights=weights,
        scale_rewards=scale,
        reward_funcs=[None] * rewards.size(1),
    )
    scope = {
        "self": trainer,
        "rewards_per_func": rewards.clone(),
        "num_generations": group_size,
        "device": rewards.device,
        "torch": torch,
        "nanstd": trl_grpo.nanstd,
    }
    exec(TRL_ADVANTAGES, scope)  # TRL's own lines, unchanged
    return scope["advantages"]


def plugin(strategy: str, log=None):
    ctx = RunContext(config=GRPOConfig(base_model="x"), output_dir=Path("."), log=log or (lambda m: None))
    return CLASSES[strategy](ctx)


def sample_rewards(seed: int, n: int, k: int, nan_fraction: float = 0.0, levels: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, k, generator=g) * torch.tensor([1.0, 5.0, 0.1][:k]) + torch.arange(k)
    if levels:  # few distinct values: groups with zero std happen
        r = torch.randint(0, levels, (n, k), generator=g).float()
    if nan_fraction:
        r[torch.rand(n, k, generator=g) < nan_fraction] = float("nan")
    return r


@pytest.mark.parametrize("strategy", list(CLASSES))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize(
    "case",
    [
        dict(n=16, k=1, g=4),
        dict(n=24, k=3, g=8),
        dict(n=24, k=3, g=8, nan_fraction=0.25),
        dict(n=12, k=2, g=3, levels=2),  # binary rewards, many zero-std groups
        dict(n=8, k=2, g=2, nan_fraction=0.4),
        dict(n=6, k=2, g=1),  # one generation per prompt
    ],
    ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()),
)
def test_matches_trl(strategy, scale, case):
    rewards = sample_rewards(1, case["n"], case["k"], case.get("nan_fraction", 0.0), case.get("levels"))
    weights = torch.tensor([1.0, 0.5, 2.0][: case["k"]])
    expected = trl_advantages(rewards, weights, case["g"], scale, strategy)
    got = plugin(strategy).grpo_aggregate_advantages(rewards, weights, case["g"], scale)
    assert got.shape == (case["n"],) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_known_values_sum_then_normalize():
    # One group of 4, two functions (weights 1 and 0.5); None counts as 0 in
    # the sum; the last row has no reward at all and is left out.
    nan = float("nan")
    rewards = torch.tensor([[1.0, 2.0], [0.0, nan], [3.0, 0.0], [nan, nan]])
    adv = plugin("sum_then_normalize").grpo_aggregate_advantages(rewards, torch.tensor([1.0, 0.5]), 4, "none")
    # totals 2, 0, 3 (mean 5/3); the unscorable row gets 0.
    torch.testing.assert_close(adv, torch.tensor([2 - 5 / 3, -5 / 3, 3 - 5 / 3, 0.0]))
    scaled = plugin("sum_then_normalize").grpo_aggregate_advantages(rewards, torch.tensor([1.0, 0.5]), 4, "group")
    std = math.sqrt(((2 - 5 / 3) ** 2 + (5 / 3) ** 2 + (3 - 5 / 3) ** 2) / 2)
    torch.testing.assert_close(scaled, adv / (std + 1e-4))


def test_gdpo_balances_scales():
    """GDPO: a function with 100x the scale does not drown the other."""
    rewards = torch.tensor([[100.0, 0.0], [0.0, 1.0], [100.0, 1.0], [0.0, 0.0]])
    w = torch.tensor([1.0, 1.0])
    gdpo = plugin("normalize_then_sum").grpo_aggregate_advantages(rewards, w, 4, "group")
    grpo = plugin("sum_then_normalize").grpo_aggregate_advantages(rewards, w, 4, "group")
    # Row 1 (only the small reward) vs row 3 (nothing): GDPO separates them
    # as much as rows 0 and 3; plain summing barely does.
    assert float(gdpo[1] - gdpo[3]) == pytest.approx(float(gdpo[0] - gdpo[3]), rel=1e-3)
    assert grpo[1] - grpo[3] < 0.05 * (grpo[0] - grpo[3])


@pytest.mark.parametrize("strategy", list(CLASSES))
def test_all_nan_rows_get_zero_and_warn_once(strategy):
    messages: list[str] = []
    agg = plugin(strategy, log=messages.append)
    nan = float("nan")
    rewards = torch.tensor([[1.0], [nan], [0.0], [2.0]])
    for _ in range(3):
        adv = agg.grpo_aggregate_advantages(rewards, torch.tensor([1.0]), 2, "group")
        assert adv[1] == 0 and torch.isfinite(adv).all()
    assert len(messages) == 1 and "no reward" in messages[0]
    everything_nan = torch.full((4, 2), nan)
    assert (agg.grpo_aggregate_advantages(everything_nan, torch.ones(2), 2, "batch") == 0).all()


def test_bool_scale_is_spelled_out_once_by_the_config_and_errors():
    from grpo_core.config.schema import GRPOConfig

    # true/false become the words the hook receives, in one place: the schema (the default too)
    assert GRPOConfig(base_model="x").trl.scale_rewards == "group"
    assert GRPOConfig(base_model="x", trl={"scale_rewards": False}).trl.scale_rewards == "none"
    agg = plugin("sum_then_normalize")
    r = sample_rewards(3, 8, 1)
    with pytest.raises(GrpoError, match="groups of 3"):
        agg.grpo_aggregate_advantages(r, torch.ones(1), 3, "group")
    with pytest.raises(GrpoError, match="reward_weights"):
        agg.grpo_aggregate_advantages(r, torch.ones(2), 4, "group")
    with pytest.raises(GrpoError, match="scale_rewards"):
        agg.grpo_aggregate_advantages(r, torch.ones(1), 4, "global")


@pytest.mark.parametrize("name", list(CLASSES))
def test_loads_through_entry_point(name):
    """The published entry point builds the class and pluggy accepts its hook."""
    host = PluginHost()
    ctx = RunContext(config=GRPOConfig(base_model="x"), output_dir=Path("."), log=lambda m: None)
    obj = host.load_implementation("advantage_aggregation", name, ctx)
    assert isinstance(obj, CLASSES[name])
    adv = host.hook.grpo_aggregate_advantages(
        rewards=torch.tensor([[1.0], [0.0]]),
        weights=torch.ones(1),
        group_size=2,
        scale_rewards="group",
        completions=[],  # the per-completion aggregations do not read them
        reward_names=["r"],
    )
    assert adv[0] > 0 > adv[1]


reward_value = st.one_of(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32),
    st.just(float("nan")),
    st.just(float("inf")),
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    group_size=st.integers(1, 8),
    num_groups=st.integers(1, 5),
    num_funcs=st.integers(1, 3),
    scale=st.sampled_from(["group", "batch", "none"]),
    strategy=st.sampled_from(list(CLASSES)),
)
def test_fuzz_finite_and_centred(data, group_size, num_groups, num_funcs, scale, strategy):
    n = group_size * num_groups
    values = data.draw(st.lists(reward_value, min_size=n * num_funcs, max_size=n * num_funcs))
    weights = data.draw(st.lists(st.floats(0.0, 5.0, width=32), min_size=num_funcs, max_size=num_funcs))
    rewards = torch.tensor(values, dtype=torch.float32).view(n, num_funcs)
    adv = plugin(strategy).grpo_aggregate_advantages(rewards, torch.tensor(weights), group_size, scale)

    assert adv.shape == (n,)
    assert torch.isfinite(adv).all()
    unscorable = (~torch.isfinite(rewards)).all(dim=1)
    assert (adv[unscorable] == 0).all()
    if group_size == 1:
        assert (adv == 0).all()
    if strategy == "sum_then_normalize" and scale != "batch":
        # Group-relative: the scorable completions of a group average to 0.
        for grp, dead in zip(adv.view(-1, group_size).double(), unscorable.view(-1, group_size)):
            live = grp[~dead]
            if live.numel():
                assert abs(float(live.mean())) <= 1e-3 * max(1.0, float(live.abs().max()))
    if strategy == "normalize_then_sum":
        live = adv[~unscorable].double()
        if live.numel():
            assert abs(float(live.mean())) <= 1e-3 * max(1.0, float(live.abs().max()))

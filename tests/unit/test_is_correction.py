"""Importance-sampling correction: parity with TRL 1.16's own code, and
the contract (shapes, mask, entry points, errors).

TRL computes the vLLM importance-sampling ratio (and its logged statistics)
inline in ``GRPOTrainer._generate_and_score_completions``; the parity test
executes those blocks of TRL's source text themselves, cut out between
marker lines, on the same log-probs. ``accelerator.gather`` is an identity
stand-in (one process here).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trl_source import trl_block

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins import is_correction as isc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns about the vLLM version at import
    from trl.trainer import grpo_trainer as trl_grpo

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
FACTORIES = {m: getattr(isc, m) for m in MODES}


_METHOD = trl_grpo.GRPOTrainer._generate_and_score_completions
TRL_RATIO = trl_block(
    _METHOD,
    "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
    "# Compute the per-token log probabilities for the reference model",
)
TRL_METRICS = trl_block(_METHOD, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {")


class _OneProcess:
    def gather(self, t):
        return t


def trl_correction(mode: str, cap: float, trainer_logps, sampler_logps, mask):
    trainer = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=cap,
        vllm_importance_sampling_clip_min=None,
        accelerator=_OneProcess(),
        _metrics={"train": defaultdict(list)},
    )
    scope = {
        "self": trainer,
        "torch": torch,
        "math": math,
        "mask": mask,
        "completion_mask": mask,
        "tool_mask": None,
        "old_per_token_logps": trainer_logps,
        "sampling_per_token_logps": sampler_logps,
        "device": trainer_logps.device,
        "mode": "train",
        "nanmin": trl_grpo.nanmin,
        "nanmax": trl_grpo.nanmax,
    }
    exec(TRL_RATIO, scope)  # TRL's own lines, unchanged
    exec(TRL_METRICS, scope)
    metrics = {k.removeprefix("sampling/"): v[0] for k, v in trainer._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], metrics


def make_logps(seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    b, c = 6, 9
    trainer = -torch.rand(b, c, generator=g) * 4
    sampler = trainer + torch.randn(b, c, generator=g) * spread
    sampler[2, 3] = float("nan")  # a token the engine could not score
    lengths = torch.tensor([9, 4, 6, 1, 9, 7])
    mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return trainer, sampler, mask


def context(cap: float | None = None) -> RunContext:
    trl = {"vllm_importance_sampling_cap": cap} if cap is not None else {}
    return RunContext(config=GRPOConfig(base_model="x", trl=trl), output_dir=Path("."), log=lambda m: None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap", [1.2, 2.0, 5.0])
@pytest.mark.parametrize("seed,spread", [(0, 0.3), (1, 0.05), (2, 1.0)])
def test_matches_trl(mode, cap, seed, spread):
    trainer, sampler, mask = make_logps(seed, spread)
    expected, trl_metrics = trl_correction(mode, cap, trainer, sampler, mask)
    weights, out_mask, metrics = FACTORIES[mode](context(cap)).grpo_is_correction(trainer, sampler, mask)

    assert weights.shape == trainer.shape
    assert torch.equal(out_mask, mask)  # TRL narrows the weights, never the mask
    torch.testing.assert_close(weights, expected.expand_as(trainer), atol=1e-6, rtol=1e-6)
    assert torch.isfinite(weights).all()
    for key, value in trl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_modes_differ_as_documented():
    trainer, sampler, mask = make_logps(2, 1.0)  # large mismatch: the cap bites
    cap = 2.0
    out = {m: FACTORIES[m](context(cap)).grpo_is_correction(trainer, sampler, mask) for m in MODES}
    tt, tm = out["token_truncate"][0], out["token_mask"][0]
    real = mask.bool()
    assert tt[real].max() == pytest.approx(cap) and (tt[real] > 0).all()
    assert (tm[real] == 0).any() and tm.max() <= cap
    # Where the token ratio is under the cap, both modes agree.
    under = real & (tm > 0)
    torch.testing.assert_close(tt[under], tm[under])
    assert out["token_mask"][2]["importance_sampling_ratio/masked_fraction"] > 0
    # Sequence modes: one weight per row.
    for m in ("sequence_truncate", "sequence_mask"):
        w = out[m][0]
        assert (w == w[:, :1]).all()
    # The unscored (NaN) token counts as ratio 1 in token modes.
    assert tt[2, 3] == 1.0


def test_no_correction_and_identical_policies():
    trainer, sampler, mask = make_logps(0)
    w, m, metrics = isc.NoCorrection(context()).grpo_is_correction(trainer, sampler, mask)
    assert torch.equal(w, torch.ones_like(trainer)) and torch.equal(m, mask)
    assert metrics["sampling_logp_difference/max"] > 0
    w, _, metrics = isc.NoCorrection(context()).grpo_is_correction(trainer, None, mask)
    assert torch.equal(w, torch.ones_like(trainer)) and metrics == {}
    # Same log-probs on both sides: every mode gives weight 1.
    for mode in MODES:
        w, _, _ = FACTORIES[mode](context()).grpo_is_correction(trainer, trainer.clone(), mask)
        torch.testing.assert_close(w, torch.ones_like(trainer))


def test_factories_read_the_cap():
    assert isc.token_mask(context(3.5)).cap == 3.5
    assert isc.sequence_truncate(context()).cap == isc.DEFAULT_CAP
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode"):
        isc.ImportanceSamplingCorrection("tokens", 2.0)
    with pytest.raises(ConfigError, match="sampler's log-probs"):
        isc.token_truncate(context()).grpo_is_correction(*make_logps(0)[:1], None, make_logps(0)[2])


@pytest.mark.parametrize("name", ["none", *MODES])
def test_loads_through_entry_point(name):
    host = PluginHost()
    obj = host.load_implementation("is_correction", name, context(1.5))
    trainer, sampler, mask = make_logps(2, 1.0)
    weights, out_mask, _ = host.hook.grpo_is_correction(trainer_logps=trainer, sampler_logps=sampler, mask=mask)
    assert weights.shape == trainer.shape and torch.equal(out_mask, mask)
    if name == "none":
        assert isinstance(obj, isc.NoCorrection) and (weights == 1).all()
    else:
        assert obj.mode == name and weights.max() <= 1.5

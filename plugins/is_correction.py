"""Importance-sampling correction for completions sampled by the inference
engine (vLLM) rather than the trainer's own forward pass (TRL 1.16's
``vllm_importance_sampling_mode``).

The engine's numerics (kernels, dtype, stale weights under async
generation) make its token probabilities differ from the trainer's. The
ratio ``pi_trainer / pi_sampler`` of each sampled token re-weights the
policy-gradient loss:

* ``token_truncate``: per-token ratio, clipped from above at the cap (TIS);
* ``token_mask``: per-token ratio, set to 0 where above the cap (MIS);
* ``sequence_truncate`` / ``sequence_mask``: one ratio per sequence, the
  product of its tokens' ratios, clipped or zeroed the same way.

As in TRL, a token the engine could not score (``NaN``) contributes ratio 1,
and so does a token outside the completion mask (an episode's environment
tokens: the sequence modes multiply over the policy's tokens only),
and masking zeroes the weight but leaves the completion mask unchanged (so
the loss's normalisation, which counts tokens, matches TRL's).
``none`` (:class:`NoCorrection`) applies no weights.
"""

from __future__ import annotations

import math

import torch

from grpo_core.plugin_api import EFFECTIVE_DEFAULTS, ConfigError, RunContext, hookimpl

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# grpo's effective default; note TRL 1.16's own default cap is 3.0.
DEFAULT_CAP = float(EFFECTIVE_DEFAULTS["vllm_importance_sampling_cap"])


def _difference_metrics(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the two policies' log-probs are apart on real, scored tokens."""
    delta = (trainer_logps - sampler_logps).abs()
    delta = delta[mask.bool() & ~torch.isnan(delta)]
    if delta.numel() == 0:
        return {"sampling_logp_difference/mean": 0.0, "sampling_logp_difference/max": 0.0}
    return {"sampling_logp_difference/mean": float(delta.mean()), "sampling_logp_difference/max": float(delta.max())}


class NoCorrection:
    """Weights of 1: train on sampler completions as if on-policy."""

    def __init__(self, context: RunContext | None = None) -> None:
        self.context = context

    @hookimpl
    def grpo_is_correction(
        self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        metrics = {} if sampler_logps is None else _difference_metrics(trainer_logps, sampler_logps, mask)
        return torch.ones_like(trainer_logps), mask, metrics


class ImportanceSamplingCorrection:
    """One of TRL's four modes with an upper cap (and optional lower bound)."""

    def __init__(self, mode: str, cap: float | None, floor: float | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"trl.vllm_importance_sampling_mode = '{mode}' must be one of {', '.join(MODES)}")
        if cap is not None and cap <= 0:
            raise ConfigError(f"trl.vllm_importance_sampling_cap = {cap} must be > 0")
        if cap is None and floor is None:
            raise ConfigError(
                f"vllm_importance_sampling_mode '{mode}' needs a bound: set trl.vllm_importance_sampling_cap"
            )
        if cap is not None and floor is not None and floor >= cap:
            raise ConfigError(f"importance-sampling lower bound {floor} must be below the cap {cap}")
        self.mode = mode
        self.cap = cap
        self.floor = floor

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    @hookimpl
    def grpo_is_correction(
        self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        if sampler_logps is None:
            raise ConfigError(
                f"is_correction '{self.mode}' needs the sampler's log-probs, but the rollout returned none; "
                "use a rollout that reports them (vLLM) or set trl.vllm_importance_sampling_correction = false"
            )
        # Unscored tokens (NaN) get difference 0, i.e. ratio 1; so do tokens
        # outside the mask (padding, an episode's environment tokens), whatever
        # the sampler wrote there: a sequence's weight is over its policy tokens.
        diff = torch.nan_to_num(torch.where(mask.bool(), trainer_logps - sampler_logps, 0.0), nan=0.0)
        if self.sequence_level:
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if self.mode.endswith("truncate"):
            weights = torch.clamp(ratio, min=self.floor, max=self.cap)
            outside = None
        else:
            low = -math.inf if self.floor is None else self.floor
            high = math.inf if self.cap is None else self.cap
            outside = (ratio < low) | (ratio > high)
            weights = ratio.masked_fill(outside, 0.0)

        # Statistics over sequences (sequence modes) or real tokens (token modes), as TRL logs them.
        flat = weights.flatten() if self.sequence_level else weights[mask.bool()]
        metrics = _difference_metrics(trainer_logps, sampler_logps, mask)
        if flat.numel():
            metrics.update(
                {
                    "importance_sampling_ratio/min": float(flat.min()),
                    "importance_sampling_ratio/mean": float(flat.mean()),
                    "importance_sampling_ratio/max": float(flat.max()),
                }
            )
        if outside is not None:
            dropped = outside.flatten() if self.sequence_level else outside[mask.bool()]
            metrics["importance_sampling_ratio/masked_fraction"] = (
                float(dropped.float().mean()) if dropped.numel() else 0.0
            )
        return weights.expand_as(trainer_logps).detach().contiguous(), mask, metrics


def _cap(context: RunContext) -> float:
    cap = context.config.trl.vllm_importance_sampling_cap
    return DEFAULT_CAP if cap is None else float(cap)


def token_truncate(context: RunContext) -> ImportanceSamplingCorrection:
    """Per-token sampler/trainer ratio, clipped from above at trl.vllm_importance_sampling_cap (TIS)."""
    return ImportanceSamplingCorrection("token_truncate", _cap(context))


def token_mask(context: RunContext) -> ImportanceSamplingCorrection:
    """Per-token ratio, weight 0 where above the cap (MIS)."""
    return ImportanceSamplingCorrection("token_mask", _cap(context))


def sequence_truncate(context: RunContext) -> ImportanceSamplingCorrection:
    """One ratio per sequence (the product of its tokens'), clipped from above at the cap."""
    return ImportanceSamplingCorrection("sequence_truncate", _cap(context))


def sequence_mask(context: RunContext) -> ImportanceSamplingCorrection:
    """One ratio per sequence (the product of its tokens'), weight 0 where above the cap."""
    return ImportanceSamplingCorrection("sequence_mask", _cap(context))

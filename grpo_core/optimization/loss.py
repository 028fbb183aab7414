"""The GRPO policy loss, every variant TRL 1.16 offers that grpo exposes.

One function, :func:`policy_loss`, turns per-token log-probs and per-sequence
advantages into the scalar to back-propagate, plus metrics. It follows TRL
1.16's ``GRPOTrainer._compute_loss`` operation for operation (the parity test
runs TRL's own method on the same inputs), so results and hyper-parameters
carry over between the two:

* importance ratio ``exp(logp - old_logp)`` per token, or per sequence
  (GSPO: exp of the masked mean log-ratio), clipped PPO-style with
  ``epsilon``/``epsilon_high`` (optionally capped at ``delta``), or CISPO's
  detached clipped weight, or SAPO's sigmoid soft gate, or VESPO's detached
  gamma weight of the sequence's whole ratio (which folds the sampler
  importance weights in, instead of multiplying by them);
* optional off-policy sequence masking (OPSM), high-entropy token selection,
  sampler importance weights, and a k3 KL penalty to a reference policy;
* normalisation per ``loss_type`` (per sequence, per token in the micro
  batch, by ``B x max_completion_length``, by the tokens of the whole
  accumulation window, or LUSPO's per-sequence sum averaged over sequences).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.config.loss_rules import loss_level_warnings
from grpo_core.config.schema import EFFECTIVE_DEFAULTS
from grpo_core.contract.errors import ConfigError

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
PPO_CLIP_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_SUM_TYPES = ("dapo", "cispo", "vespo")  # normalised by the tokens of the whole accumulation window


@dataclass(frozen=True)
class LossSettings:
    """The loss hyper-parameters, resolved (no ``None`` meaning "default")."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    max_completion_length: int = 256
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"trl.loss_type = '{self.loss_type}' is not one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ConfigError(
                f"trl.importance_sampling_level = '{self.importance_sampling_level}' must be 'token' or 'sequence'"
            )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ConfigError(f"trl.top_entropy_quantile = {self.top_entropy_quantile} must be in (0, 1]")
        if self.max_completion_length < 1:
            raise ConfigError(f"trl.max_completion_length = {self.max_completion_length} must be >= 1")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            # TRL warns the same: these sum per-token terms, so a per-sequence
            # ratio is not the GSPO objective.
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type='{self.loss_type}' sums per-token terms; "
                "GSPO's objective is loss_type='grpo'.",
                stacklevel=3,
            )
        for message in loss_level_warnings(self.loss_type, self.importance_sampling_level):
            warnings.warn(message, stacklevel=3)
        if self.loss_type == "cispo" and self.epsilon_high < 1.0:
            warnings.warn(
                f"loss_type='cispo' caps the raw ratio at trl.epsilon_high = {self.epsilon_high} (< 1: most tokens "
                "are down-weighted); CISPO/ScaleRL use a cap well above 1, e.g. epsilon_high = 5.0.",
                stacklevel=3,
            )

    @classmethod
    def from_config(cls, cfg: GRPOConfig) -> LossSettings:
        """Read the ``[trl]`` table; ``None`` entries take TRL 1.16's defaults."""
        trl = cfg.trl

        def value(name: str) -> Any:
            got = getattr(trl, name)
            return EFFECTIVE_DEFAULTS.get(name) if got is None else got

        epsilon = float(value("epsilon"))
        return cls(
            loss_type=str(value("loss_type")),
            epsilon=epsilon,
            epsilon_high=float(trl.epsilon_high) if trl.epsilon_high is not None else epsilon,
            delta=trl.delta,
            beta=float(value("beta")),
            importance_sampling_level=str(value("importance_sampling_level")),
            top_entropy_quantile=float(trl.top_entropy_quantile),
            max_completion_length=int(value("max_completion_length")),
            sapo_temperature_pos=float(trl.sapo_temperature_pos),
            sapo_temperature_neg=float(trl.sapo_temperature_neg),
            vespo_k_pos=float(trl.vespo_k_pos),
            vespo_lambda_pos=float(trl.vespo_lambda_pos),
            vespo_k_neg=float(trl.vespo_k_neg),
            vespo_lambda_neg=float(trl.vespo_lambda_neg),
            off_policy_mask_threshold=trl.off_policy_mask_threshold,
            use_bias_correction_kl=bool(value("use_bias_correction_kl")),
        )


def zero_advantage_rows_are_inert(settings: LossSettings) -> bool:
    """Whether a completion whose advantage is 0 can be left out of the
    micro-batches without changing the loss or its gradient.

    True for the token-sum losses (``dapo``, ``cispo``, ``vespo``) without a
    KL term or an entropy quantile: such a completion's per-token loss is
    ``0 x ratio`` (exactly 0, whatever the ratio, VESPO's weight of its own
    row, or the importance weight), and the normaliser,
    ``num_items_in_batch``, counts the whole generation batch's tokens
    whichever rows run. The per-sequence and per-micro-batch normalisations
    (``grpo``, ``bnpo``, ``dr_grpo``, ``sapo``, ``luspo``) divide by a count
    that includes those rows; ``beta > 0`` gives them a KL term; and the entropy
    quantile is taken over every token of the micro-batch."""
    return settings.loss_type in TOKEN_SUM_TYPES and settings.beta == 0.0 and settings.top_entropy_quantile >= 1.0


def micro_batch_split_is_free(settings: LossSettings) -> bool:
    """Whether the loss and its gradient are the same however a step's rows
    are split into micro-batches (to float rounding), so that micro-batches
    may be cut unequally where they pad least.

    True for the token-sum losses (``dapo``, ``cispo``, ``vespo``): each
    token's term is divided by ``num_items_in_batch``, the whole batch's
    count (VESPO's weight depends on its own row only), and a KL term is per
    token too. False for the per-sequence and per-micro-batch means
    (``grpo``, ``bnpo``, ``dr_grpo``, ``sapo``, ``luspo``), where a row's weight depends on
    how many rows or tokens share its micro-batch, and for an entropy quantile,
    taken over each micro-batch's tokens."""
    return settings.loss_type in TOKEN_SUM_TYPES and settings.top_entropy_quantile >= 1.0


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """True for real tokens whose entropy is in the top ``quantile`` of this
    batch's real tokens ("Beyond the 80/20 rule")."""
    real = entropy[mask.bool()].float()
    if real.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(real, 1.0 - quantile)
    return ((entropy * mask) >= threshold) & mask.bool()


def off_policy_sequence_mask(
    advantages: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """OPSM (DeepSeek-V3.2): ``[B, 1]`` 0/1, dropping sequences with a
    negative advantage whose mean ``log pi_sampler - log pi_theta`` over real
    tokens exceeds ``threshold``. Unscored (NaN) tokens count as no drift."""
    drift = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (advantages >= 0) | (mean_drift <= threshold)
    return keep.to(mask.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Token mean over real tokens; a per-sequence ``[B, 1]`` value is
    averaged over sequences (as TRL logs it)."""
    if x.shape[1] == 1:
        return float(x.float().mean())
    return float(torch.where(mask.bool(), x, 0.0).sum() / mask.sum().clamp(min=1.0))


def policy_loss(
    settings: LossSettings,
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    accumulation_steps: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch, scaled so that summing the gradients of
    ``accumulation_steps`` micro-batches gives one optimizer step's.

    Shapes: ``logps``, ``mask`` (0/1 float), ``old_logps``, ``ref_logps``,
    ``entropy``, ``sampler_logps`` are ``[B, C]``; ``advantages`` ``[B]`` (or
    ``[B, C]``: one per token, e.g. per-turn credit); ``is_weights``
    ``[B, C]`` or ``[B, 1]`` (sampler importance-sampling weights, from an
    ``is_correction`` plugin). ``vespo`` does not multiply by them: their
    log, summed over the real tokens, joins its sequence weight (TRL 1.16).

    * ``old_logps=None``: on-policy, the ratio is 1 with gradient (TRL's
      ``logps.detach()``).
    * ``num_items_in_batch``: real tokens in the whole accumulation window,
      for ``dapo``/``cispo``/``vespo``; default ``mask.sum() * accumulation_steps``.
    * ``sampler_logps``: the inference engine's log-probs, which OPSM prefers
      over ``old_logps`` to see drift from both updates and engine mismatch.
    """
    s = settings
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mask = mask.to(logps.dtype)
    # Tokens outside the mask (padding, an episode's environment tokens) get
    # exactly no gradient from any term, even one whose value there is not finite.
    logps = torch.where(mask.bool(), logps, logps.detach())
    if old_logps is None:
        old_logps = logps.detach()
    entropy_mask = _entropy_mask(s, entropy, mask)
    opsm = None
    if s.off_policy_mask_threshold is not None:
        behaviour = sampler_logps if sampler_logps is not None else old_logps
        opsm = off_policy_sequence_mask(advantages, logps, behaviour, mask, s.off_policy_mask_threshold)
    ratio = _ratio(s, logps, old_logps, mask)
    per_token_kl = _k3_kl(s, logps, ref_logps, ratio) if s.beta != 0.0 else None

    if s.loss_type == "vespo":
        phi = vespo_weights(s, advantages, logps - old_logps, mask, is_weights)
        per_token = -phi * advantages * logps
        metrics = {"vespo/phi_seq_mean": _masked_mean(phi, mask)}
        is_weights = None  # folded into phi
    else:
        per_token, metrics = _surrogate(s, logps, ratio, advantages, mask)
    if opsm is not None:
        per_token = per_token * opsm
        metrics["opsm/dropped_fraction"] = float(1.0 - opsm.float().mean())
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if is_weights is not None:
        per_token = per_token * is_weights
    if per_token_kl is not None:
        per_token = per_token + s.beta * per_token_kl
        metrics["kl"] = _masked_mean(per_token_kl.detach(), mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), mask)
    return _reduce(s, per_token, mask, num_items_in_batch, accumulation_steps), metrics


@torch.no_grad()
def vespo_weights(
    s: LossSettings,
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """VESPO's gamma weight of each sequence (TRL 1.16's ``get_gamma_weights``):
    ``phi(w) = exp(lambda) * w**k * exp(-lambda * w)`` (1 at ``w = 1``), with
    ``w`` the sequence's whole importance ratio ``prod pi_theta / pi_old``
    times the sampler correction ``prod pi_old / pi_sampler`` over its real
    tokens, and ``(k, lambda)`` chosen by the advantage's sign. Computed in
    log space, detached: a gradient scale, never differentiated. ``[B, 1]``
    (``[B, C]`` with per-token advantages, whose sign may vary).

    Differs from TRL only where TRL's inputs cannot reach: a log-ratio or a
    weight outside the mask (padding, environment tokens) counts as 0 here,
    where TRL multiplies the log-ratio by the mask (``0 x nan`` would be
    NaN) and sums the weights' logs over every column (its weights are 1
    outside the mask, as grpo's ``is_correction`` makes them)."""
    lower = math.log(1e-8)
    real = mask.bool()
    seq_log_ratio = torch.where(real, torch.clamp(log_ratio, -20.0, 20.0), 0.0).sum(-1, keepdim=True)
    if is_weights is not None:
        log_is = torch.clamp(torch.log(is_weights), lower, 20.0)
        if log_is.shape[-1] != 1:
            log_is = torch.where(real, log_is, 0.0)
        seq_log_ratio = seq_log_ratio + log_is.sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, s.vespo_k_pos, s.vespo_k_neg)
    lam = torch.where(nonneg, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _entropy_mask(s: LossSettings, entropy: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """``top_entropy_quantile < 1``: train only on the high-entropy tokens."""
    if s.top_entropy_quantile >= 1.0:
        return None
    if entropy is None:
        raise ValueError("policy_loss: top_entropy_quantile < 1 needs `entropy` (token_logprobs(with_entropy=True))")
    return high_entropy_mask(entropy, mask, s.top_entropy_quantile)


def _ratio(s: LossSettings, logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``pi_theta / pi_old`` per token, or per sequence (GSPO: ``[B, 1]``)."""
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "sequence":
        log_ratio = (torch.where(mask.bool(), log_ratio, 0.0).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def _k3_kl(s: LossSettings, logps: torch.Tensor, ref_logps: torch.Tensor | None, ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref), bias-corrected by the ratio
    when ``use_bias_correction_kl``."""
    if ref_logps is None:
        raise ValueError("policy_loss: beta > 0 needs `ref_logps` (the reference policy's log-probs)")
    ref_minus = ref_logps - logps
    per_token_kl = torch.exp(ref_minus) - ref_minus - 1
    return per_token_kl * ratio if s.use_bias_correction_kl else per_token_kl


def _surrogate(
    s: LossSettings, logps: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token policy-gradient term of ``loss_type`` and its clipping metrics."""
    metrics: dict[str, float] = {}
    if s.loss_type == "cispo":
        weight = torch.clamp(ratio, max=s.epsilon_high).detach()
        metrics["cispo_clip_ratio"] = _masked_mean(((ratio > s.epsilon_high) & (advantages > 0)).float(), mask)
        return -weight * advantages * logps, metrics
    if s.loss_type == "sapo":
        tau = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * advantages, metrics
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    if s.delta is not None:
        ratio = torch.clamp(ratio, max=s.delta)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    low = ((ratio < 1 - s.epsilon) & (advantages < 0)).float()
    high = ((ratio > 1 + s.epsilon_high) & (advantages > 0)).float()
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    return per_token, metrics


def _reduce(
    s: LossSettings,
    per_token: torch.Tensor,
    mask: torch.Tensor,
    num_items_in_batch: int | float | torch.Tensor | None,
    accumulation_steps: int,
) -> torch.Tensor:
    """Normalise the masked per-token loss as ``loss_type`` prescribes. The
    counts are the mask's, so only the policy's tokens count."""
    masked = torch.where(mask.bool(), per_token, 0.0)  # not `* mask`: 0 x inf would be NaN
    if s.loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if s.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    if s.loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * s.max_completion_length) / accumulation_steps
    if s.loss_type == "luspo":  # each sequence's sum (its mean times its length), averaged over sequences
        return masked.sum(-1).mean() / accumulation_steps
    # dapo, cispo, vespo: the whole accumulation window's token count
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum() * accumulation_steps
    normaliser = torch.as_tensor(num_items_in_batch, dtype=masked.dtype, device=masked.device).clamp(min=1.0)
    return masked.sum() / normaliser

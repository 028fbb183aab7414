"""``grpo.policy_loss:grpo``: the built-in GRPO loss (:func:`grpo_core.optimization.loss.policy_loss`).

Log-probs (and entropies) from the chunked LM-head path, the run's
importance-sampling correction, then every TRL 1.16 loss variant grpo
offers. The default unless ``trl.use_liger_loss`` chooses ``liger``.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_core.plugin_api import PolicyLossInputs, hookimpl, policy_loss


class GRPOPolicyLoss:
    """grpo's own clipped policy loss, every trl.loss_type.

    ``grpo.policy_loss:grpo``."""

    per_token_advantages = True  # policy_loss takes [B, C] advantages (per-turn credit) as TRL's does

    def __init__(self, context: Any = None) -> None:
        self.context = context

    @hookimpl
    def grpo_policy_loss(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        logps, entropy = inputs.logprobs(True)
        trainer_at_sampling = inputs.old_logps if inputs.old_logps is not None else logps.detach()
        is_weights, mask = inputs.is_weights(trainer_at_sampling)
        return policy_loss(
            inputs.settings,
            logps,
            inputs.advantages,
            mask,
            old_logps=inputs.old_logps,
            ref_logps=inputs.ref_logps,
            is_weights=is_weights,
            entropy=entropy,
            num_items_in_batch=inputs.num_items_in_batch,
            sampler_logps=inputs.sampler_logps,
            accumulation_steps=inputs.accumulation_steps,
        )

"""TRL 1.16's rules on combinations of ``trl.loss_type`` with other options,
read by both the config check (``grpo config check``, every run before
anything loads) and the loss itself (:class:`grpo_core.optimization.loss.LossSettings`).

TRL warns on LUSPO without sequence-level ratios and on VESPO with them (it
runs both), and refuses VESPO with a sequence-level vLLM importance-sampling
mode: VESPO folds the sampler correction into its own sequence weight as a
sum of per-token log-weights, which a per-sequence weight cannot give.
"""

from __future__ import annotations

SEQUENCE_IS_MODES = ("sequence_truncate", "sequence_mask")
TOKEN_IS_MODES = ("token_truncate", "token_mask")


def loss_level_warnings(loss_type: str, importance_sampling_level: str) -> list[str]:
    """What TRL 1.16 warns about ``loss_type`` at ``importance_sampling_level``."""
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        return [
            "trl.loss_type = 'luspo' with trl.importance_sampling_level = 'token': LUSPO is defined on GSPO's "
            "sequence-level ratio; set trl.importance_sampling_level = 'sequence' to mirror the paper's setup."
        ]
    if loss_type == "vespo" and importance_sampling_level != "token":
        return [
            "trl.loss_type = 'vespo' computes its sequence-level importance weight itself: "
            "trl.importance_sampling_level should be 'token' (the default)."
        ]
    return []


def vespo_correction_problem(loss_type: str, is_correction: str) -> str | None:
    """TRL 1.16's refusal: VESPO with a sequence-level sampler correction.
    ``is_correction``: the name of the run's ``is_correction`` implementation."""
    if loss_type != "vespo" or is_correction not in SEQUENCE_IS_MODES:
        return None
    return (
        f"trl.loss_type = 'vespo' needs a token-level importance-sampling correction (it sums the per-token "
        f"log-weights into its own sequence weight), but the run's is_correction is '{is_correction}': set "
        f"trl.vllm_importance_sampling_mode to one of {', '.join(TOKEN_IS_MODES)} (or "
        "trl.vllm_importance_sampling_correction = false), or choose another loss_type."
    )

"""``grpo.policy_loss:liger`` (``trl.use_liger_loss = true``): Liger-Kernel's fused GRPO loss.

``LigerFusedLinearGRPOLoss`` takes the decoder's hidden states and the LM
head's weight and computes the log-probs and the loss chunk by chunk, never
holding the whole ``[tokens, vocab]`` logits, and computes the head's
gradient in the same pass (less memory than two passes). It is written in
PyTorch (chunked, optionally ``torch.compile``-d), not Triton: it runs on
CPU as on CUDA, and needs only the ``liger-kernel`` package (the ``gpu``
extra: ``pip install 'grpo[gpu]'``). liger is imported only here, only
when this implementation is chosen.

What it does not do, refused by :meth:`LigerPolicyLoss.grpo_validate_config`
so no option is silently dropped: ``trl.top_entropy_quantile < 1`` and
``trl.off_policy_mask_threshold`` (liger computes no entropies and has no
OPSM), sequence-level ratios with ``cispo``, ``sapo`` or ``vespo`` (liger
raises on them), ``vespo`` with a liger-kernel too old to have it, per-token
advantages (an ``advantage_aggregation`` that credits turns: liger takes one
advantage per completion), and models whose logits are scaled or soft-capped after the head
(Cohere's ``logit_scale``, Gemma-2's ``final_logit_softcapping``: the
trainer's ``hidden_states`` refuses them at the first step). It logs ``kl`` and ``clip_ratio/region_mean``
(``cispo_clip_ratio`` for cispo; no clip metric for sapo and vespo, which do not clip); no
``entropy``, no ``clip_ratio/low_mean``/``high_mean`` and no ``vespo/phi_seq_mean``.

``luspo``: liger-kernel's own ``luspo`` reduction is an earlier TRL's
(``(loss x length).mean()`` over every column, padding included), which
differs from TRL 1.16's (each sequence's masked sum, averaged over
sequences) as soon as a per-token term enters (token-level ratios, a KL
term, token-level sampler weights). LUSPO's surrogate is the PPO clip of
``dr_grpo``, and ``dr_grpo``'s reduction with ``max_completion_length = 1``
is exactly TRL 1.16's: that is what is asked of liger. Parity with the
built-in loss (itself parity-tested against TRL): tests/unit/test_liger_loss.py.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from grpo_core.plugin_api import (
    DEFAULT_CHUNK_SIZE,
    ConfigError,
    GrpoError,
    PolicyLossInputs,
    hookimpl,
)

if TYPE_CHECKING:
    from grpo_core.plugin_api import GRPOConfig

TOKEN_SUM_TYPES = ("dapo", "cispo", "vespo")  # normalised by num_items_in_batch, in liger as in grpo
PACKAGE_HINT = "pip install 'liger-kernel>=0.6' (or the gpu extra: pip install 'grpo[gpu]')"


def liger_problem() -> str | None:
    """Why the Liger loss cannot run here, or ``None``. It needs the package,
    not a GPU: its GRPO loss is plain PyTorch (no Triton kernel)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # noqa: F401
    except ImportError as exc:
        return (
            f"trl.use_liger_loss = true needs the liger-kernel package, which is not importable here ({exc}): "
            f"{PACKAGE_HINT}."
        )
    return None


def liger_has_vespo() -> bool:
    """Whether the installed liger-kernel's GRPO loss takes ``vespo`` (0.8 does; earlier ones lack it)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # optional: imported only when chosen

    return "vespo_k_pos" in inspect.signature(LigerFusedLinearGRPOLoss.__init__).parameters


class LigerPolicyLoss:
    """Liger's fused-linear GRPO loss behind the ``policy_loss`` extension point."""

    uses_hidden_states = True  # fuses the LM head: runs the decoder through inputs.hidden_states
    per_token_advantages = False  # liger's loss takes one advantage per completion ([B])

    def __init__(self, context: Any = None) -> None:
        # liger-kernel is optional: imported only where used, so grpo runs without it
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        self.context = context
        self._loss_class = LigerFusedLinearGRPOLoss
        self._losses: dict[tuple[Any, ...], Any] = {}

    @staticmethod
    def grpo_validate_config(config: GRPOConfig) -> list[str]:
        errors = []
        problem = liger_problem()
        if problem is not None:
            errors.append(problem)
        trl = config.trl
        if float(trl.top_entropy_quantile) < 1.0:
            errors.append(
                f"trl.top_entropy_quantile = {trl.top_entropy_quantile} needs per-token entropies, which the Liger "
                "loss does not compute: set trl.use_liger_loss = false or top_entropy_quantile = 1.0."
            )
        if trl.off_policy_mask_threshold is not None:
            errors.append(
                "trl.off_policy_mask_threshold (OPSM) is not part of the Liger loss: set trl.use_liger_loss = false "
                "or remove off_policy_mask_threshold."
            )
        loss_type = trl.loss_type or "dapo"
        if trl.importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
            errors.append(
                f"trl.importance_sampling_level = 'sequence' with trl.loss_type = '{loss_type}' is refused by the "
                "Liger loss: set importance_sampling_level = 'token' or trl.use_liger_loss = false."
            )
        if loss_type == "vespo" and problem is None and not liger_has_vespo():
            errors.append(
                "trl.loss_type = 'vespo' needs a liger-kernel whose GRPO loss has it (0.8 or later): "
                "pip install -U 'liger-kernel>=0.8', or set trl.use_liger_loss = false."
            )
        if errors:
            raise ConfigError("; ".join(errors))
        if trl.importance_sampling_level == "sequence" and loss_type != "luspo":
            return [
                "trl.importance_sampling_level = 'sequence' is numerically fragile with the Liger loss; use 'token'."
            ]
        return []

    def _module(self, inputs: PolicyLossInputs, device: torch.device) -> Any:
        s = inputs.settings
        key = (s, inputs.temperature, device.type, inputs.ref_logps is not None)
        if key not in self._losses:
            # luspo as dr_grpo over one column: TRL 1.16's reduction (see the module's docstring)
            luspo = s.loss_type == "luspo"
            vespo = (
                {
                    "vespo_k_pos": s.vespo_k_pos,
                    "vespo_lambda_pos": s.vespo_lambda_pos,
                    "vespo_k_neg": s.vespo_k_neg,
                    "vespo_lambda_neg": s.vespo_lambda_neg,
                }
                if s.loss_type == "vespo"
                else {}
            )
            self._losses[key] = self._loss_class(
                beta=s.beta,
                compiled=device.type == "cuda",  # its chunk function under torch.compile where it pays
                use_ref_model=s.beta != 0.0,
                epsilon_low=s.epsilon,
                epsilon_high=s.epsilon_high,
                loss_type="dr_grpo" if luspo else s.loss_type,
                max_completion_length=1 if luspo else s.max_completion_length,
                importance_sampling_level=s.importance_sampling_level,
                sapo_temperature_pos=s.sapo_temperature_pos,
                sapo_temperature_neg=s.sapo_temperature_neg,
                temperature=inputs.temperature,
                delta=s.delta,
                use_bias_correction_kl=s.use_bias_correction_kl,
                **vespo,
            )
        return self._losses[key]

    @hookimpl
    def grpo_policy_loss(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        if inputs.advantages.dim() != 1:
            raise GrpoError(
                "the Liger loss (trl.use_liger_loss) takes one advantage per completion, but the run's "
                "advantage_aggregation gave one per token: set trl.use_liger_loss = false"
            )
        hidden, head = inputs.hidden_states()  # [B, C, H]: liger chunks over sequences
        trainer_at_sampling = inputs.old_logps
        if trainer_at_sampling is None and inputs.sampler_logps is not None:
            # On-policy with an engine-sampled batch: the IS correction needs the
            # current log-probs, which liger computes only inside its loss.
            trainer_at_sampling = _logps_no_grad(hidden, head, inputs.targets, inputs.temperature)
        is_weights, mask = (
            inputs.is_weights(trainer_at_sampling) if trainer_at_sampling is not None else (None, inputs.mask)
        )
        loss_fn = self._module(inputs, hidden.device)
        loss, metrics = loss_fn(
            hidden,
            head.weight,
            inputs.targets,
            mask.float(),
            inputs.advantages.float(),
            bias=getattr(head, "bias", None),
            ref_per_token_logps=inputs.ref_logps,
            old_per_token_logps=inputs.old_logps,
            vllm_is_ratio=is_weights,
            num_items_in_batch=inputs.num_items_in_batch,
        )
        s = inputs.settings
        if s.loss_type not in TOKEN_SUM_TYPES:  # liger normalises per micro-batch; grpo's sum over accumulation
            loss = loss / inputs.accumulation_steps
        out: dict[str, float] = {}
        values = [float(m) for m in metrics]
        if s.beta != 0.0:
            out["kl"] = values.pop(0)
        if values and s.loss_type not in ("sapo", "vespo"):  # liger reports 0 for the losses that do not clip
            out["cispo_clip_ratio" if s.loss_type == "cispo" else "clip_ratio/region_mean"] = values[0]
        return loss, out


def _logps_no_grad(hidden: torch.Tensor, head: Any, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    batch, c, width = hidden.shape
    flat, flat_targets = hidden.detach().reshape(batch * c, width), targets.reshape(batch * c)
    parts = []
    with torch.no_grad():
        for start in range(0, batch * c, DEFAULT_CHUNK_SIZE):
            logits = head(flat[start : start + DEFAULT_CHUNK_SIZE]).float() / temperature
            logps = torch.log_softmax(logits, dim=-1)
            parts.append(logps.gather(-1, flat_targets[start : start + DEFAULT_CHUNK_SIZE, None]).squeeze(-1))
    return torch.cat(parts).view(batch, c)

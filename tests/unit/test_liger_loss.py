"""``trl.use_liger_loss``: Liger-Kernel's fused GRPO loss (plugins/liger_loss.py)
against grpo's own loss (grpo_core/optimization/loss.py), on the same inputs.

Liger's GRPO loss is plain PyTorch (chunked; torch.compile only on CUDA
here), so the parity tests run on CPU wherever the package is installed;
without it they are skipped, saying so. The refusal tests fake the
package's absence (and CUDA's, which liger does not need) instead of
relying on this machine.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import minimal_config

from grpo_core.contract.types import PolicyLossInputs
from grpo_core.optimization.loss import LossSettings

B, C, H, V = 4, 6, 16, 50


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    hidden = torch.randn(B, C, H, generator=g)
    targets = torch.randint(0, V, (B, C), generator=g)
    mask = torch.ones(B, C)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    logps = torch.log_softmax(head(hidden) / 0.8, -1).gather(-1, targets[..., None]).squeeze(-1).detach()
    return {
        "head": head,
        "hidden": hidden,
        "targets": targets,
        "mask": mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -1.2]),
        "old_logps": logps + 0.3 * torch.randn(B, C, generator=g),  # ratios away from 1: clipping engages
        "ref_logps": logps + 0.2 * torch.randn(B, C, generator=g),
        "is_weights": torch.rand(B, C, generator=g) + 0.5,
    }


def _inputs(
    data: dict, settings: LossSettings, hidden: torch.Tensor, head: torch.nn.Module, accumulation: int
) -> PolicyLossInputs:
    def logprobs(with_entropy: bool):
        logits = head(hidden).float() / 0.8
        all_logps = torch.log_softmax(logits, -1)
        entropy = -(all_logps.exp() * all_logps).sum(-1) if with_entropy else None
        return all_logps.gather(-1, data["targets"][..., None]).squeeze(-1), entropy

    return PolicyLossInputs(
        settings=settings,
        targets=data["targets"],
        mask=data["mask"],
        advantages=data["advantages"],
        old_logps=data["old_logps"],
        ref_logps=data["ref_logps"] if settings.beta else None,
        temperature=0.8,
        num_items_in_batch=float(data["mask"].sum()) * accumulation,
        accumulation_steps=accumulation,
        logprobs=logprobs,
        hidden_states=lambda: (hidden, head),
        is_weights=lambda _trainer: (data["is_weights"], data["mask"]),
    )


def _loss_and_grads(impl, data: dict, settings: LossSettings, accumulation: int):
    hidden = data["hidden"].clone().requires_grad_(True)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data.copy_(data["head"].weight)
    loss, metrics = impl.grpo_policy_loss(inputs=_inputs(data, settings, hidden, head, accumulation))
    loss.backward()
    return loss.detach(), hidden.grad, head.weight.grad, metrics


CASES = [
    LossSettings(loss_type="dapo"),
    LossSettings(loss_type="grpo", beta=0.04),
    LossSettings(loss_type="bnpo", epsilon_high=0.28),
    LossSettings(loss_type="dr_grpo", max_completion_length=C, beta=0.04, use_bias_correction_kl=True),
    LossSettings(loss_type="cispo", epsilon_high=5.0),
    LossSettings(loss_type="sapo"),
    LossSettings(loss_type="grpo", importance_sampling_level="sequence"),
    LossSettings(loss_type="dapo", delta=1.3),
    LossSettings(loss_type="luspo", importance_sampling_level="sequence"),
    LossSettings(loss_type="vespo"),
    LossSettings(loss_type="vespo", beta=0.04, use_bias_correction_kl=True),
]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL's (and grpo's) warning: LUSPO is meant for sequence-level ratios
    # token-level ratios and a KL term: where liger-kernel's own luspo reduction is not TRL 1.16's
    CASES.append(LossSettings(loss_type="luspo", beta=0.04))


@pytest.mark.parametrize(
    "settings", CASES, ids=lambda s: f"{s.loss_type}-{s.importance_sampling_level}-b{s.beta}-d{s.delta}"
)
def test_liger_matches_builtin_loss_and_gradients(settings: LossSettings) -> None:
    pytest.importorskip(
        "liger_kernel.chunked_loss",
        reason="liger-kernel is not installed (gpu extra; pip install 'liger-kernel>=0.6'). Its GRPO loss is plain "
        "PyTorch, so this parity test runs on CPU once it is.",
    )
    from grpo_plugins.liger_loss import LigerPolicyLoss
    from grpo_plugins.policy_loss import GRPOPolicyLoss

    data = _batch()
    if settings.loss_type == "vespo":
        # VESPO sums the sampler weights' logs over every column in liger (as in TRL); grpo's
        # is_correction makes them 1 outside the mask, where the built-in loss leaves them out
        data["is_weights"] = torch.where(data["mask"].bool(), data["is_weights"], 1.0)
    ours = _loss_and_grads(GRPOPolicyLoss(), data, settings, accumulation=2)
    liger = _loss_and_grads(LigerPolicyLoss(), data, settings, accumulation=2)
    # float32 on both sides; liger computes the log-softmax in its own chunks.
    torch.testing.assert_close(liger[0], ours[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(liger[1], ours[1], rtol=1e-4, atol=1e-6)  # d loss / d hidden
    torch.testing.assert_close(liger[2], ours[2], rtol=1e-4, atol=1e-6)  # d loss / d head weight
    assert float(ours[0]) != 0.0
    if settings.beta:
        assert liger[3]["kl"] == pytest.approx(ours[3]["kl"], rel=1e-4)
    if settings.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        if settings.importance_sampling_level == "token":
            assert liger[3]["clip_ratio/region_mean"] == pytest.approx(ours[3]["clip_ratio/region_mean"], abs=1e-6)
    else:
        assert not any(key.startswith("clip_ratio") for key in liger[3])  # the losses that do not clip


def _cfg(tmp_path: Path, **trl):
    from grpo_core.config.loader import validate

    return validate(minimal_config(trl={"use_liger_loss": True, **trl}))


def test_config_check_refuses_liger_without_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    # Faked absence: importing liger_kernel raises ImportError whatever is installed.
    for name in [m for m in sys.modules if m.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ConfigError, match=r"trl.use_liger_loss = true needs the liger-kernel package.*pip install"):
        check_run_config(_cfg(tmp_path))


def test_config_check_refuses_options_liger_does_not_have(tmp_path: Path) -> None:
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    with pytest.raises(ConfigError, match="top_entropy_quantile.*use_liger_loss = false"):
        check_run_config(_cfg(tmp_path, top_entropy_quantile=0.2))
    with pytest.raises(ConfigError, match="off_policy_mask_threshold"):
        check_run_config(_cfg(tmp_path, off_policy_mask_threshold=0.5))


def test_liger_refuses_what_it_cannot_run_for_the_new_loss_types(tmp_path: Path) -> None:
    """Sequence-level ratios with vespo (liger raises on them; TRL only
    warns), and per-token advantages, which liger's loss cannot take."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from grpo_core.contract.errors import ConfigError, GrpoError
    from grpo_core.validation.run_check import check_run_config
    from grpo_plugins.liger_loss import LigerPolicyLoss

    with pytest.raises(ConfigError, match="'sequence' with trl.loss_type = 'vespo' is refused by the Liger loss"):
        check_run_config(_cfg(tmp_path, loss_type="vespo", importance_sampling_level="sequence"))
    warned = check_run_config(_cfg(tmp_path, loss_type="luspo", importance_sampling_level="sequence"))
    assert not any("numerically fragile" in w for w in warned)  # LUSPO is meant for sequence level
    data = _batch()
    data["advantages"] = data["advantages"].unsqueeze(1).expand(B, C)
    head = data["head"]
    inputs = _inputs(data, LossSettings(), data["hidden"], head, 1)
    with pytest.raises(GrpoError, match="one advantage per completion.*use_liger_loss = false"):
        LigerPolicyLoss().grpo_policy_loss(inputs=inputs)


def test_sequence_level_importance_sampling_warns_however_liger_was_chosen(tmp_path: Path) -> None:
    """The warning is the Liger plugin's own: choosing it by name
    (plugins.policy_loss) gets it exactly as trl.use_liger_loss does, and the
    built-in loss never does."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from grpo_core.config.loader import validate
    from grpo_core.validation.run_check import check_run_config

    fragile = "importance_sampling_level = 'sequence' is numerically fragile with the Liger loss"
    assert any(fragile in w for w in check_run_config(_cfg(tmp_path, importance_sampling_level="sequence")))
    by_name = _cfg(tmp_path, importance_sampling_level="sequence", use_liger_loss=False).model_dump(exclude_unset=True)
    by_name["plugins"] = {"policy_loss": "liger"}
    assert any(fragile in w for w in check_run_config(validate(by_name)))
    assert not any(
        fragile in w
        for w in check_run_config(_cfg(tmp_path, importance_sampling_level="sequence", use_liger_loss=False))
    )


def test_liger_is_accepted_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's GRPO loss needs no GPU: with CUDA faked absent the check passes
    and the built-in is not chosen instead."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from grpo_core.config.implementations import chosen_implementations
    from grpo_core.validation.run_check import check_run_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _cfg(tmp_path)
    check_run_config(cfg)
    assert chosen_implementations(cfg)["policy_loss"] == "liger"
    assert chosen_implementations(_cfg(tmp_path, use_liger_loss=False))["policy_loss"] == "grpo"

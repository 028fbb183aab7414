"""policy_loss against TRL 1.16's own GRPOTrainer._compute_loss.

TRL's method is called unbound on a small harness object that carries only
the attributes it reads; its log-prob helper is replaced by one returning
fixed tensors (the model forward is what token_logprobs tests cover). The
accelerator is a single-process stand-in (gather/reduce are identities),
since there is one process here. Loss, gradient w.r.t. the log-probs and the
logged metrics are compared for every loss type and option.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import minimal_config

from grpo_core.config.loader import apply_effective_defaults
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError
from grpo_core.optimization.loss import LOSS_TYPES, LossSettings, policy_loss

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns about the vLLM version at import
    from trl.trainer.grpo_trainer import GRPOTrainer

B, P, C = 6, 3, 7


class _SingleProcessAccelerator:
    """accelerate's collective ops, for one process: identities."""

    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


class TrlLoss:
    """Just enough of a GRPOTrainer for TRL's own loss code to run."""

    _compute_loss = GRPOTrainer._compute_loss
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def __init__(self, s: LossSettings, logps, entropy, use_is: bool, accumulation_steps: int):
        self.loss_type = s.loss_type
        self.epsilon_low = s.epsilon
        self.epsilon_high = s.epsilon_high
        self.beta = s.beta
        self.importance_sampling_level = s.importance_sampling_level
        self.top_entropy_quantile = s.top_entropy_quantile
        self.off_policy_mask_threshold = s.off_policy_mask_threshold
        self.max_completion_length = s.max_completion_length
        self.use_vllm = use_is
        self.vllm_importance_sampling_correction = use_is
        self.current_gradient_accumulation_steps = accumulation_steps
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.model = SimpleNamespace(training=True)
        self.accelerator = _SingleProcessAccelerator()
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.args = SimpleNamespace(
            delta=s.delta,
            use_bias_correction_kl=s.use_bias_correction_kl,
            sapo_temperature_pos=s.sapo_temperature_pos,
            sapo_temperature_neg=s.sapo_temperature_neg,
            vespo_k_pos=s.vespo_k_pos,
            vespo_lambda_pos=s.vespo_lambda_pos,
            vespo_k_neg=s.vespo_k_neg,
            vespo_lambda_neg=s.vespo_lambda_neg,
            steps_per_generation=accumulation_steps,
        )
        self._logps, self._entropy = logps, entropy

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == self._logps.size(1)
        return self._logps, self._entropy, None


def make_data(seed: int = 0, empty_row: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, C, generator=g, dtype=torch.float64).float() * 3 - 0.05
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    if empty_row:
        lengths[2] = 0
    mask = (torch.arange(C).unsqueeze(0) < lengths.unsqueeze(1)).float()
    # Ratios spread across both clip edges (exp(+-0.4) ~ 0.67 .. 1.5).
    old = logps + torch.randn(B, C, generator=g) * 0.4
    sampler = old + torch.randn(B, C, generator=g) * 0.3
    sampler[3, 1] = float("nan")  # a token the engine could not score
    return {
        "logps": logps,
        "old": old,
        "ref": logps + torch.randn(B, C, generator=g) * 0.3,
        "sampler": sampler,
        "mask": mask,
        "advantages": torch.tensor([1.3, -0.7, 0.0, -1.9, 0.4, 2.2]),
        "entropy": torch.rand(B, C, generator=g) * 5,
        # 1 outside the mask, as TRL's producer and grpo's is_correction make them (the difference
        # of log-probs is masked before exp): VESPO sums the weights' logs over every column
        "is_token": torch.where(mask.bool(), torch.rand(B, C, generator=g) * 1.5 + 0.25, 1.0),
        "is_seq": torch.rand(B, 1, generator=g) * 1.5 + 0.25,
    }


def run_trl(s: LossSettings, d, *, on_policy, is_key, sampler, accumulation_steps, num_items):
    logps = d["logps"].clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.ones(B, C, dtype=torch.long),
        "completion_mask": d["mask"],
        "advantages": d["advantages"],
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    if not on_policy:
        inputs["old_per_token_logps"] = d["old"]
    if s.beta != 0.0:
        inputs["ref_per_token_logps"] = d["ref"]
    if is_key:
        inputs["importance_sampling_ratio"] = d[is_key]
    if sampler:
        inputs["sampling_per_token_logps"] = d["sampler"]
    trl = TrlLoss(s, logps, d["entropy"], use_is=is_key is not None, accumulation_steps=accumulation_steps)
    loss = trl._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, logps)
    metrics = {k: v[0] for k, v in trl._metrics["train"].items()}
    return loss.detach(), grad, metrics


def run_ours(s: LossSettings, d, *, on_policy, is_key, sampler, accumulation_steps, num_items):
    logps = d["logps"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        s,
        logps,
        d["advantages"],
        d["mask"],
        old_logps=None if on_policy else d["old"],
        ref_logps=d["ref"] if s.beta != 0.0 else None,
        is_weights=d[is_key] if is_key else None,
        entropy=d["entropy"],
        num_items_in_batch=num_items,
        sampler_logps=d["sampler"] if sampler else None,
        accumulation_steps=accumulation_steps,
    )
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad, metrics


# name -> (settings changes, run options)
SCENARIOS: dict[str, tuple[dict, dict]] = {
    "token": ({}, {}),
    "on_policy": ({}, {"on_policy": True}),
    "sequence_gspo": ({"importance_sampling_level": "sequence"}, {}),
    "delta": ({"delta": 1.2}, {}),
    "kl": ({"beta": 0.04}, {}),
    "kl_bias_corrected": ({"beta": 0.04, "use_bias_correction_kl": True}, {}),
    "kl_bias_corrected_sequence": (
        {"beta": 0.1, "use_bias_correction_kl": True, "importance_sampling_level": "sequence"},
        {},
    ),
    "is_weights_token": ({}, {"is_key": "is_token"}),
    "is_weights_sequence": ({}, {"is_key": "is_seq"}),
    "opsm_old_logps": ({"off_policy_mask_threshold": 0.05}, {}),
    "opsm_sampler_logps": ({"off_policy_mask_threshold": 0.05}, {"sampler": True}),
    # Thresholds just above a negative-advantage row's mean drift (row 3:
    # 0.114 from old log-probs, 0.068 from the sampler's with its NaN token
    # counted as no drift): that row is kept, where a stricter one drops it.
    "opsm_old_logps_loose": ({"off_policy_mask_threshold": 0.13}, {}),
    "opsm_sampler_logps_loose": ({"off_policy_mask_threshold": 0.09}, {"sampler": True}),
    "top_entropy": ({"top_entropy_quantile": 0.3}, {}),
    "accumulation": ({}, {"accumulation_steps": 3, "num_items": 71}),
    "everything": (
        {
            "delta": 1.3,
            "beta": 0.02,
            "use_bias_correction_kl": True,
            "off_policy_mask_threshold": 0.1,
            "top_entropy_quantile": 0.6,
        },
        {"is_key": "is_token", "sampler": True, "accumulation_steps": 2, "num_items": 40},
    ),
    "empty_row": ({}, {"empty_row": True}),
}


def base_settings(loss_type: str) -> LossSettings:
    # CISPO's epsilon_high is a cap on the raw ratio (ScaleRL uses ~5); the
    # data's ratios reach ~3, so 1.4 makes the cap bite.
    eps_high = 1.4 if loss_type == "cispo" else 0.28
    # VESPO keeps TRL's default gamma shape: its weights of these sequences
    # range from 0.4 to 1.2 (0.18 to 1.1 with the sampler weights folded in).
    return LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=eps_high, max_completion_length=9)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, scenario):
    changes, options = SCENARIOS[scenario]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sequence level with token-sum losses warns (as TRL does)
        s = replace(base_settings(loss_type), **changes)
    d = make_data(empty_row=options.get("empty_row", False))
    accumulation_steps = options.get("accumulation_steps", 1)
    num_items = options.get("num_items")
    kw = {
        "on_policy": options.get("on_policy", False),
        "is_key": options.get("is_key"),
        "sampler": options.get("sampler", False),
        "accumulation_steps": accumulation_steps,
    }
    # TRL needs the window's token count; ours defaults it to mask.sum() x steps.
    trl_num_items = num_items if num_items is not None else float(d["mask"].sum()) * accumulation_steps
    trl_loss, trl_grad, trl_metrics = run_trl(s, d, num_items=trl_num_items, **kw)
    loss, grad, metrics = run_ours(s, d, num_items=num_items, **kw)

    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, trl_grad, atol=1e-5, rtol=1e-5)
    # The scenario must exercise something: a non-zero gradient on some token.
    assert grad.abs().max() > 1e-4

    for key in (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "cispo_clip_ratio",
        "vespo/phi_seq_mean",
        "kl",
        "entropy",
    ):
        assert (key in metrics) == (key in trl_metrics), key
        if key in metrics:
            assert metrics[key] == pytest.approx(trl_metrics[key], abs=1e-6), key


def test_options_change_the_result():
    """Each option moves the loss or gradient (so the parity above is not
    parity of options that do nothing)."""
    d = make_data()
    base = run_ours(
        base_settings("grpo"), d, on_policy=False, is_key=None, sampler=False, accumulation_steps=1, num_items=None
    )
    for changes, options in (
        ({"delta": 1.2}, {}),
        ({"beta": 0.04}, {}),
        ({"importance_sampling_level": "sequence"}, {}),
        ({"off_policy_mask_threshold": 0.05}, {}),
        ({"top_entropy_quantile": 0.3}, {}),
        ({"epsilon_high": 0.5}, {}),
        ({}, {"is_key": "is_token"}),
    ):
        s = replace(base_settings("grpo"), **changes)
        opts = {"on_policy": False, "is_key": None, "sampler": False, "accumulation_steps": 1, "num_items": None}
        opts.update(options)
        loss, grad, _ = run_ours(s, d, **opts)
        assert (loss - base[0]).abs() > 1e-6 or (grad - base[1]).abs().max() > 1e-6, changes or options


def test_clip_metrics_count_real_tokens():
    d = make_data()
    _, _, m = run_ours(
        base_settings("dapo"), d, on_policy=False, is_key=None, sampler=False, accumulation_steps=1, num_items=None
    )
    assert 0 < m["clip_ratio/region_mean"] <= 1
    assert m["clip_ratio/region_mean"] == pytest.approx(m["clip_ratio/low_mean"] + m["clip_ratio/high_mean"])


def test_from_config_resolves_defaults():
    cfg = GRPOConfig(base_model="x", trl={"loss_type": "grpo", "epsilon": 0.3, "beta": 0.01})
    s = LossSettings.from_config(cfg)
    assert (s.loss_type, s.epsilon, s.epsilon_high, s.beta) == ("grpo", 0.3, 0.3, 0.01)
    assert s.importance_sampling_level == "token" and s.max_completion_length == 256
    cfg = apply_effective_defaults(GRPOConfig(base_model="x", trl={"epsilon_high": 0.28, "delta": 1.5}))
    s = LossSettings.from_config(cfg)
    assert (s.loss_type, s.epsilon, s.epsilon_high, s.delta) == ("dapo", 0.2, 0.28, 1.5)


def test_bad_settings_and_missing_inputs_fail_clearly():
    with pytest.raises(ConfigError, match="trl.loss_type"):
        LossSettings(loss_type="ppo")
    with pytest.raises(ConfigError, match="importance_sampling_level"):
        LossSettings(importance_sampling_level="batch")
    d = make_data()
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(LossSettings(beta=0.1), d["logps"], d["advantages"], d["mask"])
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(LossSettings(top_entropy_quantile=0.5), d["logps"], d["advantages"], d["mask"])


def test_vespo_shape_and_sampler_weights_change_the_result():
    """VESPO's four shape parameters each move the loss, and the sampler
    weights enter its sequence weight (not as a factor: the loss with
    weights differs from the loss without them times any one weight)."""
    d = make_data()
    opts = {"on_policy": False, "is_key": None, "sampler": False, "accumulation_steps": 1, "num_items": None}
    base, base_grad, metrics = run_ours(base_settings("vespo"), d, **opts)
    assert 0.0 < metrics["vespo/phi_seq_mean"] < 1.0
    # advantages of both signs: each parameter reaches some row
    for changes in ({"vespo_k_pos": 1.0}, {"vespo_lambda_pos": 1.5}, {"vespo_k_neg": 1.5}, {"vespo_lambda_neg": 4.0}):
        loss, grad, _ = run_ours(replace(base_settings("vespo"), **changes), d, **opts)
        assert (grad - base_grad).abs().max() > 1e-4, changes
    weighted, weighted_grad, _ = run_ours(base_settings("vespo"), d, **{**opts, "is_key": "is_token"})
    assert not torch.allclose(weighted_grad, base_grad * d["is_token"], atol=1e-4)
    # outside the mask a sampler weight does not count (its log-probs are padding there)
    d_padded = dict(d, is_token=torch.where(d["mask"].bool(), d["is_token"], 7.0))
    again, again_grad, _ = run_ours(base_settings("vespo"), d_padded, **{**opts, "is_key": "is_token"})
    torch.testing.assert_close(again_grad, weighted_grad)


def test_luspo_weights_each_sequence_by_its_length():
    """On-policy at sequence level every ratio is 1, unclipped: LUSPO's loss
    is -mean(advantage x length) over the micro-batch, GRPO's -mean(advantage)."""
    d = make_data()
    opts = {"on_policy": True, "is_key": None, "sampler": False, "accumulation_steps": 1, "num_items": None}
    luspo = LossSettings(loss_type="luspo", importance_sampling_level="sequence", epsilon_high=0.28)
    loss, grad, _ = run_ours(luspo, d, **opts)
    lengths = d["mask"].sum(-1)
    assert float(loss) == pytest.approx(float(-(d["advantages"] * lengths).mean()), rel=1e-6)
    # d loss / d logp of a real token: -advantage / B, whatever the row's length (length-unbiased)
    expected = (-d["advantages"] / B).unsqueeze(1).expand(B, C) * d["mask"]
    torch.testing.assert_close(grad, expected)


def test_trl_warnings_and_refusal_for_luspo_and_vespo(tmp_path):
    """TRL 1.16 warns on LUSPO without sequence-level ratios and on VESPO
    with them, and refuses VESPO with a sequence-level vLLM importance-sampling
    mode: grpo says the same, in the config check (before anything loads)
    and, for the warnings, when the loss is built."""
    from grpo_core.config.loader import validate
    from grpo_core.validation.run_check import check_run_config

    with pytest.warns(UserWarning, match="luspo.*importance_sampling_level = 'sequence'"):
        LossSettings(loss_type="luspo")
    with pytest.warns(UserWarning, match="vespo.*should be 'token'"):
        LossSettings(loss_type="vespo", importance_sampling_level="sequence")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossSettings(loss_type="luspo", importance_sampling_level="sequence")
        LossSettings(loss_type="vespo")

    def cfg(**trl):
        return validate(minimal_config(trl=trl))

    assert any("luspo" in w for w in check_run_config(cfg(loss_type="luspo")))
    assert not any("luspo" in w for w in check_run_config(cfg(loss_type="luspo", importance_sampling_level="sequence")))
    assert any("vespo" in w for w in check_run_config(cfg(loss_type="vespo", importance_sampling_level="sequence")))
    ok = {"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "token_mask"}
    assert not any("vespo" in w for w in check_run_config(cfg(**ok)))
    for mode in ("sequence_mask", "sequence_truncate"):
        with pytest.raises(ConfigError, match=f"loss_type = 'vespo'.*'{mode}'.*token_truncate, token_mask"):
            check_run_config(cfg(**{**ok, "vllm_importance_sampling_mode": mode}))
    # without the correction there is nothing to fold in: accepted, as TRL does
    check_run_config(
        cfg(**{**ok, "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_correction": False})
    )

"""The episode loss mask (``Completion.loss_mask``) downstream of a
completion: batching, every loss term and normaliser, the IS correction,
shared prompt prefixes, zero-advantage row dropping, the Liger loss
(``trl.rollout_func``'s ``env_mask`` in real runs: tests/e2e/test_loss_mask_runs.py).

The model is the tiny random Llama of tests/tiny_model.py (the properties
are the loss's arithmetic, not the model's size), run through the real
``token_logprobs``, ``collate``, policy-loss plugins and IS corrections.

Two properties, for every ``loss_type`` and option:

* **interior** environment tokens (model turn, environment reply, model
  turn) get exactly zero gradient at their log-probs, whatever junk (large,
  NaN, inf) their old, reference and sampler log-probs hold;
* **trailing** environment tokens change nothing: loss, metrics and the
  parameters' gradient equal those of the same batch with them removed (in
  a causal model the tokens before them do not see them), which also checks
  that no normaliser counts them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import Completion, PolicyLossInputs, Prompt, RolloutGroup, ScoredGroup
from grpo_core.optimization.batch import MicroBatch, collate, completion_tokens, flatten, with_signal_first
from grpo_core.optimization.logprobs import token_logprobs
from grpo_core.optimization.loss import LossSettings
from grpo_plugins import is_correction as isc
from grpo_plugins.policy_loss import GRPOPolicyLoss

PAD = 0
TEMPERATURE = 0.9
JUNK = [0.0, math.nan, math.inf, -math.inf, 30.0, -30.0]  # what a sampler may have written at environment tokens


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train()  # the training path; this config has no dropout, so it is deterministic
    return model


# ---------------------------------------------------------------- episodes


def _sampler(ids: list[int], mask: list[int]) -> list[float]:
    """Sampler log-probs: a value keyed by the token id on policy tokens, junk on the others."""
    return [-0.3 - (t % 7) / 10 if m else JUNK[k % len(JUNK)] for k, (t, m) in enumerate(zip(ids, mask, strict=True))]


def _episode(segments: list[tuple[list[int], int]], truncated: bool = False, drop_env: bool = False) -> Completion:
    """A completion from (ids, mask value) segments; ``drop_env``: the same
    completion with its environment tokens left out (and no mask)."""
    if drop_env:
        segments = [(ids, m) for ids, m in segments if m]
    ids = [t for seg, _ in segments for t in seg]
    mask = [m for seg, m in segments for _ in seg]
    return Completion(
        token_ids=ids,
        text="",
        logprobs=_sampler(ids, mask),
        truncated=truncated,
        loss_mask=None if drop_env or all(mask) else mask,
    )


INTERIOR = [  # (prompt, [(segments, truncated)], advantages)
    (
        [1, 9, 15, 27],
        [
            ([([201, 202, 203], 1), ([901, 902], 0), ([204, 205, 2], 1)], False),
            ([([211], 1), ([911, 912, 913], 0), ([212, 213], 1)], False),
        ],
        [1.0, -0.7],
    ),
    (
        [1, 33, 44],
        [
            ([([221, 222, 223, 224], 1)], False),
            ([([231, 232], 1), ([931], 0), ([233], 1), ([932, 933], 0)], False),
            ([([241, 242], 1), ([941, 942], 0), ([243, 244], 1)], True),
        ],
        [0.4, -1.1, 0.6],
    ),
]
TRAILING = [
    (
        [1, 9, 15, 27],
        [([([201, 202, 203, 204], 1), ([901, 902, 903], 0)], False), ([([211, 212], 1), ([911], 0)], False)],
        [1.0, -0.7],
    ),
    (
        [1, 33, 44],
        [
            ([([221, 222, 223, 224, 225], 1)], False),
            ([([231, 232, 233], 1), ([932, 933, 934, 935], 0)], False),
            ([([241, 242], 1), ([941, 942], 0)], True),
        ],
        [0.4, -1.1, 0.6],
    ),
]


def _groups(spec, drop_env: bool = False, advantages: list[list[float]] | None = None) -> list[ScoredGroup]:
    out = []
    for g, (prompt, episodes, adv) in enumerate(spec):
        completions = [_episode(segs, truncated, drop_env) for segs, truncated in episodes]
        adv = adv if advantages is None else advantages[g]
        out.append(ScoredGroup(RolloutGroup(Prompt(f"p{g}", prompt), completions), [[a] for a in adv], list(adv)))
    return out


# ---------------------------------------------------------------- the loss of one micro-batch


def _keyed(targets: torch.Tensor, scale: float) -> torch.Tensor:
    """A per-token offset keyed by the token id (the same in both layouts of a batch)."""
    return scale * torch.cos(targets.float() * 1.7)


def _is_plugin(mode: str | None):
    return None if mode is None else isc.ImportanceSamplingCorrection(mode, cap=1.5 if mode.endswith("mask") else 1.2)


def _loss(
    model,
    mb: MicroBatch,
    settings: LossSettings,
    num_items: float,
    is_mode: str | None = None,
    share_prompts: bool = False,
    impl=None,
):
    """The policy-loss plugin's loss on ``mb``, as the trainer wires it; the
    log-probs tensor is returned too, with its gradient kept."""
    c = mb.num_completion_tokens
    targets = mb.input_ids[:, -c:]
    policy_tokens = mb.completion_mask.bool()
    kept: dict[str, torch.Tensor] = {}

    def logprobs(with_entropy: bool):
        logps, entropy = token_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            c,
            temperature=TEMPERATURE,
            with_entropy=with_entropy,
            share_prompts=share_prompts,
        )
        logps.retain_grad()
        kept["logps"] = logps
        return logps, entropy

    with torch.no_grad():
        current = token_logprobs(model, mb.input_ids, mb.attention_mask, c, temperature=TEMPERATURE)[0]
    # old / reference policies: away from the current one on policy tokens (clipping and KL engage), junk elsewhere
    old = torch.where(policy_tokens, current + _keyed(targets, 0.3), torch.full_like(current, -100.0))
    ref = torch.where(policy_tokens, current + _keyed(targets, -0.2) + 0.05, torch.full_like(current, 100.0))
    plugin = _is_plugin(is_mode)

    def is_weights(trainer_logps: torch.Tensor):
        if plugin is None:
            return None, mb.completion_mask
        weights, mask, _ = plugin.grpo_is_correction(
            trainer_logps=trainer_logps, sampler_logps=mb.sampler_logps, mask=mb.completion_mask
        )
        return weights, mask

    inputs = PolicyLossInputs(
        settings=settings,
        targets=targets,
        mask=mb.completion_mask,
        advantages=mb.advantages,
        old_logps=old,
        ref_logps=ref if settings.beta else None,
        sampler_logps=mb.sampler_logps,
        temperature=TEMPERATURE,
        num_items_in_batch=num_items,
        accumulation_steps=1,
        logprobs=logprobs,
        hidden_states=None,
        is_weights=is_weights,
    )
    loss, metrics = (impl or GRPOPolicyLoss()).grpo_policy_loss(inputs=inputs)
    return loss, metrics, kept.get("logps")


def _one_batch(groups: list[ScoredGroup], model=None) -> tuple[MicroBatch, float]:
    """One micro-batch of ``groups`` and its policy-token count. With
    ``model``: sampler log-probs near its own on policy tokens (so IS weights
    stay near 1 and the caps engage on some tokens only) and junk (NaN, +-inf,
    +-30), past collate's clean-up, everywhere else."""
    samples = flatten(groups)
    mb = collate(samples, PAD, mask_truncated=True)
    return mb if model is None else _near_sampler(model, mb), float(completion_tokens(samples, mask_truncated=True))


def _near_sampler(model, mb: MicroBatch) -> MicroBatch:
    c = mb.num_completion_tokens
    with torch.no_grad():
        current = token_logprobs(model, mb.input_ids, mb.attention_mask, c, temperature=TEMPERATURE)[0]
    junk = torch.tensor(JUNK).repeat(current.numel())[: current.numel()].view_as(current)
    near = current + _keyed(mb.input_ids[:, -c:], 0.25) - 0.05
    mb.sampler_logps = torch.where(mb.completion_mask.bool(), near, junk)
    return mb


def _grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))


CASES = {
    "grpo": (LossSettings(loss_type="grpo"), None),
    "bnpo": (LossSettings(loss_type="bnpo", epsilon_high=0.28), None),
    "dr_grpo": (LossSettings(loss_type="dr_grpo", max_completion_length=16), None),
    "dapo": (LossSettings(loss_type="dapo"), None),
    "cispo": (LossSettings(loss_type="cispo", epsilon_high=5.0), None),
    "sapo": (LossSettings(loss_type="sapo"), None),
    "grpo-kl": (LossSettings(loss_type="grpo", beta=0.04), None),
    "dapo-kl-bias-corrected": (LossSettings(loss_type="dapo", beta=0.04, use_bias_correction_kl=True), None),
    "dapo-entropy-quantile": (LossSettings(loss_type="dapo", top_entropy_quantile=0.5), None),
    "gspo-sequence-ratio": (LossSettings(loss_type="grpo", importance_sampling_level="sequence"), None),
    "dapo-opsm": (LossSettings(loss_type="dapo", off_policy_mask_threshold=0.1), None),
    "dapo-is-token_truncate": (LossSettings(loss_type="dapo"), "token_truncate"),
    "bnpo-is-token_mask": (LossSettings(loss_type="bnpo"), "token_mask"),
    "grpo-is-sequence_truncate": (LossSettings(loss_type="grpo", beta=0.04), "sequence_truncate"),
    "cispo-is-sequence_mask": (LossSettings(loss_type="cispo", epsilon_high=5.0), "sequence_mask"),
    "luspo-sequence-kl": (LossSettings(loss_type="luspo", importance_sampling_level="sequence", beta=0.04), None),
    "luspo-is-token_truncate": (
        LossSettings(loss_type="luspo", importance_sampling_level="sequence"),
        "token_truncate",
    ),
    "vespo": (LossSettings(loss_type="vespo"), None),
    "vespo-is-token_mask": (LossSettings(loss_type="vespo", beta=0.04), "token_mask"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_environment_tokens_get_no_gradient(tiny, case: str) -> None:
    """Interior environment tokens: their log-probs get exactly zero
    gradient, the loss and every gradient stay finite though their old,
    reference and sampler log-probs are junk (ratios and KL terms of inf there, NaN and +-inf sampler values)."""
    settings, is_mode = CASES[case]
    mb, num_items = _one_batch(_groups(INTERIOR), tiny)
    env = (mb.attention_mask[:, -mb.num_completion_tokens :].bool()) & ~mb.completion_mask.bool()
    env[4] = False  # the truncated completion: all of it masked, environment or not
    assert int(env.sum()) == 8, "the batch has its environment tokens where this test expects them"
    assert num_items == 3 + 3 + 1 + 2 + 4 + 2 + 1, "policy tokens of the untruncated completions"
    loss, metrics, logps = _loss(tiny, mb, settings, num_items, is_mode)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values()), metrics
    grad = logps.grad
    assert torch.isfinite(grad).all()
    assert (grad[env] == 0).all(), f"environment tokens got gradient {grad[env]}"
    assert (grad[~mb.completion_mask.bool()] == 0).all()
    assert (grad[mb.completion_mask.bool()] != 0).sum() >= 4, "policy tokens train (else the test shows nothing)"
    for p in tiny.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    tiny.zero_grad(set_to_none=True)


@pytest.mark.parametrize("case", list(CASES))
def test_trailing_environment_tokens_change_nothing(tiny, case: str) -> None:
    """Loss, metrics and parameter gradients with trailing environment tokens
    masked equal those of the same batch without them: no gradient reaches
    the parameters from them and no normaliser (per sequence, per batch,
    num_items_in_batch, entropy quantile, sequence IS weight) counts them."""
    settings, is_mode = CASES[case]
    with_env, items_env = _one_batch(_groups(TRAILING), tiny)
    without, items = _one_batch(_groups(TRAILING, drop_env=True), tiny)
    assert items_env == items and with_env.num_completion_tokens > without.num_completion_tokens
    loss_env, metrics_env, _ = _loss(tiny, with_env, settings, items_env, is_mode)
    loss, metrics, _ = _loss(tiny, without, settings, items, is_mode)
    assert float(loss.detach()) != 0.0
    # float32; the wider batch runs attention and matmuls on other shapes (summation order)
    torch.testing.assert_close(loss_env, loss, rtol=1e-5, atol=1e-7)
    assert metrics_env.keys() == metrics.keys()
    for key in metrics:
        assert metrics_env[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    moved = 0.0
    for g_env, g in zip(_grads(tiny, loss_env), _grads(tiny, loss), strict=True):
        if g is None:
            assert g_env is None
            continue
        torch.testing.assert_close(g_env, g, rtol=1e-4, atol=1e-8)
        moved = max(moved, float(g.abs().max()))
    assert moved > 1e-6


def test_liger_loss_honours_the_mask(tiny) -> None:
    """The Liger loss (plain PyTorch, runs on CPU) on a masked batch: the same
    loss and head gradient as the built-in one, none from environment tokens."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (gpu extra)")
    from grpo_plugins.liger_loss import LigerPolicyLoss

    mb, items = _one_batch(_groups(TRAILING))
    without, items_plain = _one_batch(_groups(TRAILING, drop_env=True))
    head = tiny.get_output_embeddings()
    body = tiny.model

    def liger_loss(batch: MicroBatch, num_items: float, settings: LossSettings) -> torch.Tensor:
        c = batch.num_completion_tokens

        def hidden_states():
            out = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            return out.last_hidden_state[:, -c - 1 : -1, :], head

        with torch.no_grad():
            current = token_logprobs(tiny, batch.input_ids, batch.attention_mask, c, temperature=TEMPERATURE)[0]
        targets = batch.input_ids[:, -c:]
        # finite everywhere, as the trainer's own forwards give them: liger multiplies by the mask, so an
        # inf at a masked token would be NaN (the built-in loss selects instead; the tests above feed it junk)
        old = current + _keyed(targets, 0.3)
        ref = current + _keyed(targets, -0.2) + 0.05
        inputs = PolicyLossInputs(
            settings=settings,
            targets=targets,
            mask=batch.completion_mask,
            advantages=batch.advantages,
            old_logps=old,
            ref_logps=ref if settings.beta else None,
            sampler_logps=None,
            temperature=TEMPERATURE,
            num_items_in_batch=num_items,
            accumulation_steps=1,
            logprobs=None,
            hidden_states=hidden_states,
            is_weights=lambda _t: (None, batch.completion_mask),
        )
        return LigerPolicyLoss().grpo_policy_loss(inputs=inputs)[0]

    for settings in (
        LossSettings(loss_type="dapo", beta=0.04),
        LossSettings(loss_type="grpo"),
        LossSettings(loss_type="grpo", importance_sampling_level="sequence"),
    ):
        loss_env, loss = liger_loss(mb, items, settings), liger_loss(without, items_plain, settings)
        torch.testing.assert_close(loss_env, loss, rtol=1e-5, atol=1e-7)
        (g_env,), (g,) = torch.autograd.grad(loss_env, [head.weight]), torch.autograd.grad(loss, [head.weight])
        torch.testing.assert_close(g_env, g, rtol=1e-4, atol=1e-8)
        assert float(g.abs().max()) > 0
        builtin, _, _ = _loss(tiny, mb, settings, items)
        torch.testing.assert_close(loss_env, builtin, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- shared prompts, zero-advantage rows


def test_shared_prompt_prefix_with_masked_completions_matches_the_plain_path(tiny) -> None:
    """One group (one prompt) of episodes: running the prompt once gives the
    loss and gradients of running every row, and still none at environment tokens."""
    mb, items = _one_batch(_groups(INTERIOR[:1]), tiny)
    settings = LossSettings(loss_type="grpo", beta=0.04)
    loss, _, logps = _loss(tiny, mb, settings, items, "token_truncate")
    seen: list[int] = []
    hook = tiny.model.embed_tokens.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    try:
        shared, _, shared_logps = _loss(tiny, mb, settings, items, "token_truncate", share_prompts=True)
    finally:
        hook.remove()
    seen = seen[1:]  # the first forward is the no-grad one for the old / reference log-probs (not shared)
    assert sum(seen) < mb.input_ids.numel(), "the prompt ran once: the shared path was taken"
    torch.testing.assert_close(shared, loss, rtol=1e-5, atol=1e-7)
    for g_shared, g in zip(_grads(tiny, shared), _grads(tiny, loss), strict=True):
        if g is not None:
            torch.testing.assert_close(g_shared, g, rtol=1e-4, atol=1e-7)
    shared.backward()
    env = mb.attention_mask[:, -mb.num_completion_tokens :].bool() & ~mb.completion_mask.bool()
    assert env.any() and (shared_logps.grad[env] == 0).all()
    tiny.zero_grad(set_to_none=True)


def test_dropping_zero_advantage_rows_with_masked_completions_changes_nothing(tiny) -> None:
    """dapo: leaving zero-advantage episodes out of the micro-batch (the
    trainer's ``with_signal_first``), with num_items_in_batch counted over the
    whole batch's policy tokens, gives the same loss and gradients."""
    groups = _groups(INTERIOR, advantages=[[1.0, 0.0], [0.0, -1.1, 0.0]])
    samples = flatten(groups)
    items = float(completion_tokens(samples, mask_truncated=True))
    kept = with_signal_first(samples, rows=0)
    assert len(kept) == 2 < len(samples)
    settings = LossSettings(loss_type="dapo")
    full, _, _ = _loss(tiny, _near_sampler(tiny, collate(samples, PAD, True)), settings, items, "sequence_truncate")
    dropped, _, _ = _loss(tiny, _near_sampler(tiny, collate(kept, PAD, True)), settings, items, "sequence_truncate")
    torch.testing.assert_close(dropped, full, rtol=1e-5, atol=1e-7)
    assert float(full.detach()) != 0.0
    for g_d, g in zip(_grads(tiny, dropped), _grads(tiny, full), strict=True):
        if g is not None:
            torch.testing.assert_close(g_d, g, rtol=1e-4, atol=1e-8)


# ---------------------------------------------------------------- batching


def test_collate_puts_the_loss_mask_into_the_completion_mask() -> None:
    """The mask row is the episode's mask, zeroed for a truncated completion
    under ``mask_truncated_completions``; the sampler's junk at environment
    tokens is replaced by a finite 0; the count is the policy's tokens."""
    samples = flatten(_groups(INTERIOR))
    for mask_truncated in (False, True):
        mb = collate(samples, PAD, mask_truncated)
        for row, s in enumerate(samples):
            c = len(s.completion_ids)
            expected = [0] * c if mask_truncated and s.truncated else (s.loss_mask or [1] * c)
            assert mb.completion_mask[row, :c].tolist() == expected
            assert mb.completion_mask[row, c:].sum() == 0
            sampler = mb.sampler_logps[row, :c]
            assert torch.isfinite(sampler).all()
            policy = torch.tensor(s.loss_mask or [1] * c).bool()
            assert (sampler[~policy] == 0).all() and (sampler[policy] < 0).all()
        assert completion_tokens(samples, mask_truncated) == int(mb.completion_mask.sum())
    assert completion_tokens(samples, mask_truncated=False) == 16 + 4  # the truncated episode's 4 policy tokens


def test_a_loss_mask_that_does_not_fit_is_refused_by_name() -> None:
    group = _groups(INTERIOR[:1])[0]
    group.group.completions[0].loss_mask = [1, 0]
    with pytest.raises(GrpoError, match=r"loss_mask has 2 entries for 8 tokens.*one 0/1 entry per token"):
        flatten([group])
    group.group.completions[0].loss_mask = [1, 1, 1, 2, 0, 1, 1, 1]
    with pytest.raises(GrpoError, match=r"loss_mask has values other than 0 and 1"):
        flatten([group])


def test_replayed_episodes_keep_their_loss_mask_and_record() -> None:
    """The replay buffer's plain-data state (checkpoints) keeps a remembered
    episode's loss mask and EpisodeStats, and never holds its live environment."""
    from grpo_core.config.loader import validate
    from grpo_core.contract.context import RunContext
    from grpo_core.contract.types import EpisodeStats, TrainingProgress
    from grpo_plugins.replay import SignalReplay

    cfg = validate({"base_model": "unused", "trl": {"replay_buffer_size": 2}})
    replay = SignalReplay(RunContext(config=cfg, output_dir=Path(".")))
    group = _groups(INTERIOR[:1])[0]
    for completion in group.group.completions:
        completion.episode = EpisodeStats(turns=2, model_tokens=completion.model_token_count, environment_tokens=2)
        completion.environment = object()  # a live episode object: not plain data
    progress = TrainingProgress(step=1, max_steps=10)
    replay.grpo_replay_groups(groups=[group], progress=progress)
    state = json.loads(json.dumps(replay.state_dict()))  # plain data only
    restored = SignalReplay(RunContext(config=cfg, output_dir=Path(".")))
    restored.load_state_dict(state)
    empty = _groups(INTERIOR[:1], advantages=[[0.0, 0.0]])
    got = restored.grpo_replay_groups(groups=empty, progress=progress)[0]
    assert got.replayed
    for before, after in zip(group.group.completions, got.group.completions, strict=True):
        assert after.loss_mask == before.loss_mask and after.loss_mask is not None
        assert after.episode == before.episode and isinstance(after.episode, EpisodeStats)
        assert after.environment is None
    assert [s.loss_mask for s in flatten([got])] == [c.loss_mask for c in group.group.completions]

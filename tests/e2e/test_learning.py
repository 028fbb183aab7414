"""The training loop learns in the right direction, on a tiny model built
here (tests/tiny_model.py) where the rewarded behaviour is one learnable
feature: completions of even token ids.

A sign flip or misalignment anywhere between reward and update (advantages,
batch layout, loss) makes the trained policy move away from the reward; the
flipped variant is run inside the test to show the checks catch it. Also
here, on the same cheap model: ``skip_zero_advantage_batches`` and its
metric, KL against the reference (``beta``), and ``num_iterations > 1``.
Full fine-tuning through the real loop (transformers rollout, reward
functions, advantages, PPO loss, AdamW); each run takes seconds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import metrics, raw_config, run_workdir

from grpo_core.config.loader import validate
from grpo_core.training.run import run_training

REWARDS = '''
def even(completion_ids, **kwargs):
    """Fraction of the completion's tokens whose id is even."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]

def constant(completion_ids, **kwargs):
    return [1.0 for _ in completion_ids]

def even_on_odd_prompts(prompts, completion_ids, **kwargs):
    """`even` for the prompts that end in an odd number, 1.0 (no signal) for the rest."""
    scores = even(completion_ids)
    return [score if int(prompt.rstrip(":").split()[-1]) % 2 else 1.0 for prompt, score in zip(prompts, scores)]
'''


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rows = [{"prompt": f"Write token number {i}:"} for i in range(8)]
    return run_workdir(tmp_path, rows, {"learning_rewards": REWARDS}, monkeypatch)


# the runs' settings; a test changes some through config()'s keywords
RUN = {
    "adapter": None,
    "sequence_len": 64,
    "micro_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "max_steps": 6,
    "learning_rate": 1e-2,
    "lr_scheduler": "constant",
    "seed": 1,
}


def config(workdir: Path, model_dir: str, name: str, **trl: object):
    top = {
        k: trl.pop(k)
        for k in list(trl)
        if k
        in ("max_steps", "learning_rate", "gradient_accumulation_steps", "shuffle_dataset", "micro_batch_size", "seed")
    }
    trl = {
        "num_generations": 8,
        "max_completion_length": 4,
        "reward_funcs": ["learning_rewards.even"],
        "temperature": 1.0,
        **trl,
    }
    return validate(raw_config(model_dir, workdir, out=name, **(RUN | top), trl=trl))


def log_p_even_first_token(model_dir: str | Path, cfg) -> float:
    """Mean over the dataset's prompts of log P(first completion token is
    even): the trained policy's log-probability of the rewarded answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.data.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    values = []
    with torch.no_grad():
        for prompt in load_prompts(cfg, tokenizer):
            logits = model(torch.tensor([prompt.prompt_ids])).logits[0, -1]
            values.append(torch.logsumexp(torch.log_softmax(logits, -1)[0::2], 0))
    return float(torch.stack(values).mean())


def learned_direction(cfg, model_dir: str) -> tuple[float, float, float, float]:
    """Train; return (first-2-step reward, last-2-step reward, log P(even)
    before, after)."""
    before = log_p_even_first_token(model_dir, cfg)
    assert run_training(cfg) == "completed"
    rewards = [r["reward"] for r in metrics(Path(cfg.output_dir))]
    after = log_p_even_first_token(cfg.output_dir, cfg)
    return sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2, before, after


def assert_learns(result: tuple[float, float, float, float]) -> None:
    first, last, before, after = result
    assert last > first + 0.2, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert after > before + 0.2, f"log P(rewarded answer) did not rise: {before:.3f} -> {after:.3f}"


def test_training_raises_the_reward_and_the_rewarded_log_prob(workdir: Path, tiny_model_dir: str, monkeypatch) -> None:
    # At start the policy is indifferent (log P(even) ~ log 0.5 = -0.69); 6
    # steps at lr 1e-2 take the reward from ~0.5 to >0.9.
    result = learned_direction(config(workdir, tiny_model_dir, "right"), tiny_model_dir)
    print("reward %.3f -> %.3f, log P(even) %.3f -> %.3f" % result)
    assert_learns(result)

    # The same run with the advantages' sign flipped where the loop reads
    # them (the bug this test guards against) must fail the same checks.
    import grpo_core.training.trainer as trainer_module

    real_flatten = trainer_module.flatten

    def flipped(groups):
        samples = real_flatten(groups)
        for s in samples:
            s.advantage = -s.advantage
        return samples

    monkeypatch.setattr(trainer_module, "flatten", flipped)
    wrong = learned_direction(config(workdir, tiny_model_dir, "flipped"), tiny_model_dir)
    print("flipped: reward %.3f -> %.3f, log P(even) %.3f -> %.3f" % wrong)
    with pytest.raises(AssertionError):
        assert_learns(wrong)
    assert wrong[3] < wrong[2]  # and it moves the other way


def test_skip_zero_advantage_batches_skips_counts_and_leaves_weights(workdir: Path, tiny_model_dir: str) -> None:
    """A constant reward gives every completion advantage 0: with
    skip_zero_advantage_batches (the default) each of the step's 2 micro-batches is
    skipped and counted, nothing is trained, and the schedule still steps
    without torch's order warning reaching the user."""
    from safetensors.torch import load_file

    cfg = config(
        workdir,
        tiny_model_dir,
        "skip",
        reward_funcs=["learning_rewards.constant"],
        skip_zero_advantage_batches=True,
        max_steps=2,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert run_training(cfg) == "completed"
    assert not [w for w in record if "lr_scheduler.step()" in str(w.message)]
    rows = metrics(Path(cfg.output_dir))
    assert [r["skipped_zero_adv_batches"] for r in rows] == [2.0, 4.0]  # cumulative, 2 micro-batches a step
    assert all(r["grad_norm"] == 0.0 and r["num_tokens"] == 0 for r in rows)
    start, end = (
        load_file(str(Path(tiny_model_dir) / "model.safetensors")),
        load_file(str(Path(cfg.output_dir) / "model.safetensors")),
    )
    for key in start:
        assert torch.equal(start[key], end[key]), key

    kept = config(
        workdir,
        tiny_model_dir,
        "noskip",
        reward_funcs=["learning_rewards.constant"],
        skip_zero_advantage_batches=False,
        max_steps=1,
    )
    run_training(kept)
    row = metrics(Path(kept.output_dir))[0]
    assert row["skipped_zero_adv_batches"] == 0.0 and row["num_tokens"] > 0  # both micro-batches ran


def test_zero_advantage_completions_are_left_out_with_the_same_loss_and_gradient(
    workdir: Path, tiny_model_dir: str, capsys
) -> None:
    """With the default token-sum loss (dapo), completions whose advantage is
    0 are left out of the micro-batches: a step whose 2 prompts are one with
    signal and one without runs 1 micro-batch instead of 2, and its loss and
    gradient are those of running both (the normaliser still counts the rows
    left out)."""
    runs = {}
    for name, skip in (("drop", True), ("all", False)):
        # seed 2: no completion of the odd prompt's group scores exactly its group's mean (advantage 0, which
        # dapo leaves out too): the 8 left out are the other group's
        cfg = config(
            workdir,
            tiny_model_dir,
            name,
            reward_funcs=["learning_rewards.even_on_odd_prompts"],
            skip_zero_advantage_batches=skip,
            max_steps=1,
            shuffle_dataset=False,
            seed=2,
        )
        assert run_training(cfg) == "completed"
        runs[name] = metrics(Path(cfg.output_dir))[0]
        said = capsys.readouterr()
        assert (
            "zero advantage: 8 completions left out of training (1 micro-batch fewer)" in said.out + said.err
        ) == skip
    dropped, full = runs["drop"], runs["all"]
    print({k: (dropped[k], full[k]) for k in ("loss", "grad_norm", "num_tokens", "frac_reward_zero_std")})
    assert full["frac_reward_zero_std"] == 0.5  # one group of the two has no signal
    assert dropped["skipped_zero_adv_samples"] == 8 and dropped["skipped_zero_adv_batches"] == 1
    assert full["skipped_zero_adv_samples"] == 0 and full["skipped_zero_adv_batches"] == 0
    assert dropped["num_tokens"] < full["num_tokens"]
    assert dropped["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
    assert dropped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert full["grad_norm"] > 0


def test_zero_advantage_completions_stay_where_the_loss_counts_them(workdir: Path, tiny_model_dir: str) -> None:
    """Under bnpo (normalised by the micro-batch's tokens) a completion with
    advantage 0 still counts in the normaliser: in one micro-batch of both
    groups nothing is left out. dapo on the same batch trains only the group
    with signal, and since its normaliser is the same token count (one
    micro-batch per step) its loss and gradient must equal bnpo's: an
    independent check of the count that the rows left out keep in it."""
    rows = {}
    for loss_type in ("bnpo", "dapo"):
        cfg = config(
            workdir,
            tiny_model_dir,
            loss_type,
            reward_funcs=["learning_rewards.even_on_odd_prompts"],
            loss_type=loss_type,
            max_steps=1,
            shuffle_dataset=False,
            micro_batch_size=16,
            gradient_accumulation_steps=1,
            seed=2,
        )
        assert run_training(cfg) == "completed"
        rows[loss_type] = metrics(Path(cfg.output_dir))[0]
    bnpo, dapo = rows["bnpo"], rows["dapo"]
    assert bnpo["skipped_zero_adv_samples"] == 0 and bnpo["skipped_zero_adv_batches"] == 0
    assert dapo["skipped_zero_adv_samples"] == 8 and dapo["skipped_zero_adv_batches"] == 0
    assert dapo["num_tokens"] < bnpo["num_tokens"]
    assert dapo["loss"] == pytest.approx(bnpo["loss"], rel=1e-5, abs=1e-7)
    assert dapo["grad_norm"] == pytest.approx(bnpo["grad_norm"], rel=1e-5) and bnpo["grad_norm"] > 0


def test_kl_is_zero_at_the_first_step_and_positive_after_an_update(workdir: Path, tiny_model_dir: str) -> None:
    cfg = config(workdir, tiny_model_dir, "kl", beta=0.1, max_steps=3)
    assert run_training(cfg) == "completed"
    kl = [r["kl"] for r in metrics(Path(cfg.output_dir))]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # policy == reference before any update
    assert kl[1] > 1e-4 and kl[2] > 1e-4, kl


def test_num_iterations_takes_old_logps_once_per_batch(workdir: Path, tiny_model_dir: str) -> None:
    """With num_iterations = 2 each batch trains two steps; the PPO ratio is
    1 on the first (old = current) and not on the second (old log-probs are
    the first step's, not recomputed): with a small epsilon, tokens clip."""
    cfg = config(workdir, tiny_model_dir, "iters", num_iterations=2, epsilon=0.01, epsilon_high=0.01, max_steps=4)
    assert run_training(cfg) == "completed"
    rows = metrics(Path(cfg.output_dir))
    clip = [r["clip_ratio/region_mean"] for r in rows]
    assert clip[0] == 0.0 and clip[2] == 0.0, clip  # first iteration of each batch: ratio exactly 1
    assert clip[1] > 0.05 and clip[3] > 0.05, clip  # second: the policy moved since the old log-probs
    assert "reward" in rows[0] and "reward" not in rows[1]  # one generation per two steps


def test_ref_model_sync_steps_moves_the_reference_to_the_policy(workdir: Path, tiny_model_dir: str) -> None:
    """sync_ref_model with alpha 1 every 2 steps: the reference becomes the
    policy after steps 2 and 4, so KL is ~0 again on steps 3 and 5 (first
    forward after the copy) and positive on the steps in between."""
    cfg = config(
        workdir,
        tiny_model_dir,
        "refsync",
        beta=0.1,
        sync_ref_model=True,
        ref_model_mixup_alpha=1.0,
        ref_model_sync_steps=2,
        max_steps=5,
    )
    assert run_training(cfg) == "completed"
    kl = [r["kl"] for r in metrics(Path(cfg.output_dir))]
    assert (
        kl[0] == pytest.approx(0.0, abs=1e-7)
        and kl[2] == pytest.approx(0.0, abs=1e-7)
        and kl[4] == pytest.approx(0.0, abs=1e-7)
    ), kl
    assert kl[1] > 1e-4 and kl[3] > 1e-4, kl


def test_replay_recompute_logps_gives_replayed_rows_no_is_weight(tmp_path: Path) -> None:
    """A replayed row was sampled by an old policy: with
    replay_recompute_logps its ratio is taken against fresh log-probs and the
    sampler's stale log-probs neither weight nor mask it; without, the
    IS correction (token_mask, cap 3) masks its far-off tokens. The real
    is_correction implementation, loaded through the plugin host."""
    from grpo_core.contract.context import RunContext
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.optimization.batch import Sample, collate
    from grpo_core.training.trainer import GRPOTrainer

    def weights(recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = validate(
            {
                "base_model": "unused/model",
                "trl": {
                    "reward_funcs": ["x.y"],
                    "vllm_importance_sampling_correction": True,
                    "vllm_importance_sampling_mode": "token_mask",
                    "replay_recompute_logps": recompute,
                },
            }
        )
        host = PluginHost()
        host.load_implementation("is_correction", "token_mask", RunContext(config=cfg, output_dir=tmp_path))
        trainer = GRPOTrainer.__new__(GRPOTrainer)  # only _is_weights is exercised: no model needed
        trainer.parts, trainer.trl, trainer.device = SimpleNamespace(hook=host.hook), cfg.trl, torch.device("cpu")
        trainer.verifier = SimpleNamespace(sampled=False)  # no engine whose syncs to check
        fresh = Sample([1], [2, 3], 1.0, sampler_logps=[-0.1, -0.2])
        stale = Sample([1], [4, 5], -1.0, sampler_logps=[-5.0, -6.0], replayed=True)
        mb = collate([fresh, stale], pad_id=0, mask_truncated=False)
        trainer_logps = torch.tensor([[-0.1, -0.2], [-0.1, -0.1]])
        w, mask = trainer._is_weights(mb, trainer_logps, {})
        return w, mask

    w, mask = weights(recompute=True)
    assert torch.equal(w[1], torch.ones(2)) and torch.equal(mask[1], torch.ones(2))
    assert torch.allclose(w[0], torch.ones(2))  # the fresh row: ratio exp(0) = 1
    w, mask = weights(recompute=False)
    assert torch.equal(w[1], torch.zeros(2))  # ratio e^4.9, e^5.9 > cap: masked

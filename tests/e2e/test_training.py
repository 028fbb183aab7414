"""End-to-end training runs (transformers rollout) on the tiny random model of
tests/tiny_model.py: what is checked is the loop's plumbing (metrics keys,
timings, checkpoints, a loadable adapter, errors naming the reward, the
reference model), not what a model learns (tests/e2e/test_learning.py).

Each run is tiny (a few steps, 8-token completions) but goes through the
whole loop: dataset, rollout, rewards, advantages, loss, optimizer,
checkpoints, metrics, final adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import merged, metrics, raw_config, run_workdir

from grpo_core.config.loader import validate
from grpo_core.contract.errors import RewardError
from grpo_core.training.run import run_training

REWARDS = """
import re

def last_digit_even(completions, **kwargs):
    out = []
    for c in completions:
        digits = re.findall(r"\\d", c[0]["content"])
        out.append(1.0 if digits and int(digits[-1]) % 2 == 0 else 0.0)
    return out

def even_tokens(completions, completion_ids, **kwargs):
    # the fraction of even token ids: it varies within every group of the tiny model's random
    # completions (which never sample a digit or EOS in 8 tokens), so every step trains
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]

def first_id_even(completion_ids, **kwargs):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]

def broken(completions, **kwargs):
    raise ValueError("boom")
"""


ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {a + 1}?"}], "answer": str(2 * a + 1)} for a in range(1, 9)
]


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return run_workdir(tmp_path, ROWS, {"tiny_rewards": REWARDS}, monkeypatch)


def tiny_config(workdir: Path, model_dir: str, **overrides) -> dict:
    base = raw_config(
        model_dir,
        workdir,
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        sequence_len=128,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        lr_scheduler="constant",
        seed=7,
        trl={
            "num_generations": 4,
            "max_completion_length": 8,
            "reward_funcs": ["tiny_rewards.last_digit_even", "tiny_rewards.even_tokens"],
            "reward_weights": [1.0, 0.5],
            "temperature": 1.0,
        },
    )
    return merged(base, **overrides)


REQUIRED_METRICS = {
    "step",
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "rewards/last_digit_even/mean",
    "rewards/last_digit_even/std",
    "rewards/even_tokens/mean",
    "frac_reward_zero_std",
    "entropy",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "num_tokens",
    "step_time",
}


def test_short_run_writes_metrics_checkpoints_and_a_loadable_adapter(workdir: Path, tiny_model_dir: str) -> None:
    # even_tokens varies within every group: both steps train (every metric below is of a trained step)
    cfg = validate(tiny_config(workdir, tiny_model_dir, save_steps=1, seed=8))
    assert run_training(cfg) == "completed"
    out = workdir / "out"
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    missing = REQUIRED_METRICS - set(records[0])
    assert not missing, f"metrics.jsonl lacks {missing}"
    assert records[0]["completions/mean_length"] > 0
    # every second of a step is accounted for: the phases add up to step_time
    from grpo_core.training.timing import PHASES

    for record in records:
        parts = [record[f"time/{phase}"] for phase in (*PHASES, "other")]
        assert sum(parts) == pytest.approx(record["step_time"], rel=1e-6)
        assert record["time/rollout"] > 0 and record["time/forward_backward"] > 0 and record["time/optimizer"] > 0
    # save_steps = 1: step 1's checkpoint is written after its metrics line (a failed save loses no
    # metrics), so its time shows in step 2's record; nothing was saved before step 1
    assert records[0]["time/checkpoint"] == 0 and records[1]["time/checkpoint"] > 0
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, str(out))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "training left every LoRA B at zero"


@pytest.mark.extended  # exact resume is the default tier's through tests/e2e/test_resume_exact.py (split runs equal a
# straight run)
def test_resume_continues_identically(workdir: Path, tiny_model_dir: str) -> None:
    straight = validate(tiny_config(workdir, tiny_model_dir, max_steps=3, output_dir=str(workdir / "straight")))
    run_training(straight)

    first = validate(tiny_config(workdir, tiny_model_dir, max_steps=2, save_steps=1, output_dir=str(workdir / "split")))
    run_training(first)
    resumed = validate(
        tiny_config(
            workdir,
            tiny_model_dir,
            max_steps=3,
            output_dir=str(workdir / "split"),
            resume_from_checkpoint=str(workdir / "split" / "checkpoint-2"),
        )
    )
    run_training(resumed)

    a, b = metrics(workdir / "straight"), metrics(workdir / "split")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("reward", "loss", "completions/mean_length", "grad_norm"):
        assert a[-1][key] == pytest.approx(b[-1][key], rel=1e-4, abs=1e-6), key

    from safetensors.torch import load_file

    wa = load_file(str(workdir / "straight" / "adapter_model.safetensors"))
    wb = load_file(str(workdir / "split" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-6)


def test_failing_reward_names_function_and_keeps_checkpoint(workdir: Path, tiny_model_dir: str) -> None:
    ok = validate(tiny_config(workdir, tiny_model_dir, max_steps=1))
    run_training(ok)
    broken = validate(
        tiny_config(
            workdir,
            tiny_model_dir,
            max_steps=2,
            resume_from_checkpoint="latest",
            trl={"reward_funcs": ["tiny_rewards.broken"], "reward_weights": [1.0]},
        )
    )
    with pytest.raises(RewardError) as info:
        run_training(broken)
    message = str(info.value)
    assert "broken" in message and "boom" in message
    assert "checkpoint" in message
    assert (workdir / "out" / "checkpoint-1" / "trainer_state.json").is_file()


def test_num_iterations_and_beta_run_with_reference(
    workdir: Path, tiny_model_dir: str, capsys: pytest.CaptureFixture
) -> None:
    cfg = validate(
        tiny_config(
            workdir,
            tiny_model_dir,
            max_steps=2,
            trl={"num_iterations": 2, "beta": 0.04, "loss_type": "grpo", "num_completions_to_print": 2},
        )
    )
    run_training(cfg)
    shown = capsys.readouterr().err
    assert "sample completions" in shown and "last_digit_even" in shown  # the completions table
    records = metrics(workdir / "out")
    assert "kl" in records[0] and records[0]["kl"] is not None
    # the second iteration reuses the batch: its ratio differs from 1 after an update
    assert records[1]["kl"] >= 0.0


@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
def test_luspo_and_vespo_train_through_the_loop(workdir: Path, tiny_model_dir: str, loss_type: str) -> None:
    """The loop with the two loss types TRL 1.16 added (parity with TRL's loss
    code: tests/unit/test_loss_parity.py): on the tiny model, two steps over one
    batch (num_iterations = 2), so the second step's ratios differ from 1 and
    VESPO's weight moves off 1; each logs TRL's metrics for it."""
    level = "sequence" if loss_type == "luspo" else "token"
    cfg = validate(
        tiny_config(
            workdir,
            tiny_model_dir,
            adapter=None,
            learning_rate=1e-3,
            trl={
                "loss_type": loss_type,
                "importance_sampling_level": level,
                "num_iterations": 2,
                "reward_funcs": ["tiny_rewards.first_id_even"],  # what the tiny model can vary
                "reward_weights": [1.0],
            },
        )
    )
    assert run_training(cfg) == "completed"
    records = metrics(workdir / "out")
    assert len(records) == 2 and all(r["grad_norm"] > 0 for r in records)
    if loss_type == "vespo":
        assert records[0]["vespo/phi_seq_mean"] == pytest.approx(1.0)  # on-policy: w = 1, phi(1) = 1
        assert records[1]["vespo/phi_seq_mean"] != pytest.approx(1.0, abs=1e-6)
        assert not any(k.startswith("clip_ratio") for k in records[1])
    else:
        assert "clip_ratio/region_mean" in records[1] and "vespo/phi_seq_mean" not in records[1]

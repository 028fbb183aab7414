"""Reward functions that fail inside a real run.

With ``trl.reward_error_policy = "raise"`` (the default) a failing function
stops the run after a checkpoint, naming the function, the step and one
sample, and the run resumes from that checkpoint. With ``"none"`` the
failing call is scored ``None`` with a warning and training goes on.
``trl.reward_timeout`` runs the functions in a worker process, so a function
that hangs or kills its process is survived too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fault_harness import Runner, assert_clean_failure, checkpoint_step, last_per_step, metrics, resume_hint
from helpers import no_traceback


def _stopped_at(runner: Runner, code: int, output: str, step: int, fragments: list[str]) -> str:
    """Check a stop by a reward fault after ``step`` finished steps; return
    the checkpoint the message says to resume from."""
    assert_clean_failure(code, output)
    for fragment in fragments:
        assert fragment in output, output[-6000:]
    assert f"at step {step}. Sample 0: prompt '" in output  # names the step and one sample
    assert f"Training stopped at step {step}; checkpoint saved to" in output
    checkpoint = Path(resume_hint(output))
    assert checkpoint == runner.workdir / "out" / f"checkpoint-{step}"
    assert checkpoint_step(checkpoint) == step
    assert (checkpoint / "model" / "adapter_model.safetensors").is_file()
    assert sorted(last_per_step(runner.workdir / "out")) == list(range(1, step + 1))
    assert not [p for p in (runner.workdir / "out").iterdir() if p.name.startswith(".")]  # no half-written leftovers
    return str(checkpoint)


@pytest.mark.extended  # ~70 s; test_reward_faults_scored_none_and_the_run_goes_on (reward faults in a real run) and
# test_plugin_contract_vllm's raising-hook test (stop with one error and a checkpoint) run in the default tier
def test_reward_faults_stop_with_a_checkpoint_that_resumes(runner: Runner) -> None:
    """Three faults in a row, each stopping a run that resumed from the
    checkpoint the previous one left and trained on: a function that raises
    (in process), one that hangs past reward_timeout, one whose worker
    process exits."""
    funcs = lambda name: {
        "reward_funcs": ["faulty_rewards.good", f"faulty_rewards.{name}"],
        "reward_weights": [1.0, 0.5],
    }  # noqa: E731
    config = runner.config(max_steps=4, save_steps=1, trl=funcs("reward_raises"))
    code, output = runner.run(config, env={"FAULT_AT_RAISES": "2"})
    checkpoint = _stopped_at(
        runner, code, output, 1, ["reward function 'reward_raises' raised ValueError: injected failure"]
    )

    config = runner.config(max_steps=4, save_steps=1, trl={**funcs("reward_hangs"), "reward_timeout": 3})
    code, output = runner.run(config, f'resume_from_checkpoint="{checkpoint}"', env={"FAULT_AT_HANGS": "2"})
    assert "resumed from" in output and "checkpoint-1 at step 1" in output
    checkpoint = _stopped_at(
        runner,
        code,
        output,
        2,
        ["reward function 'reward_hangs' took longer than trl.reward_timeout = 3.0s; its worker was killed"],
    )

    config = runner.config(max_steps=4, save_steps=1, trl={**funcs("reward_exits"), "reward_timeout": 60})
    code, output = runner.run(config, f'resume_from_checkpoint="{checkpoint}"', env={"FAULT_AT_EXITS": "2"})
    assert "checkpoint-2 at step 2" in output
    _stopped_at(
        runner,
        code,
        output,
        3,
        ["reward function 'reward_exits' crashed: its reward worker process died (exit code 17)"],
    )
    records = last_per_step(runner.workdir / "out")
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records.values())


def test_reward_faults_scored_none_and_the_run_goes_on(runner: Runner) -> None:
    """reward_error_policy = "none": every kind of fault in one run, each
    reported with the function's name; all steps train with finite losses."""
    faulty = ["reward_raises", "reward_nan", "reward_short", "reward_string", "reward_hangs", "reward_exits"]
    config = runner.config(
        max_steps=3,
        trl={
            "reward_funcs": ["faulty_rewards.good", *(f"faulty_rewards.{name}" for name in faulty)],
            "reward_weights": [1.0] + [0.1] * len(faulty),
            "reward_error_policy": "none",
            "reward_timeout": 3,
        },
    )
    # Step 1: four value faults at once. Step 2: a hang (the worker is killed,
    # so reward_exits after it is not run). Step 3: reward_exits kills its worker.
    env = {
        "FAULT_AT_RAISES": "1",
        "FAULT_AT_NAN": "1",
        "FAULT_AT_SHORT": "1",
        "FAULT_AT_STRING": "1",
        "FAULT_AT_HANGS": "2",
        "FAULT_AT_EXITS": "2",
    }
    code, output = runner.run(config, env=env)
    assert code == 0, output[-6000:]
    no_traceback(output)
    expected = [
        "warning: reward function 'reward_raises' raised ValueError: injected failure at step 0. Sample 0:",
        "warning: reward function 'reward_nan' returned nan as value 1 (rewards must be finite; use None to abstain) "
        "at step 0. Sample 1:",
        "warning: reward function 'reward_short' returned 3 values for 4 completions (one per completion expected) at "
        "step 0.",
        "warning: reward function 'reward_string' returned a non-number (str 'high') as value 0 at step 0. Sample 0:",
        "warning: reward function 'reward_hangs' took longer than trl.reward_timeout = 3.0s; its worker was killed at "
        "step 1.",
        "warning: reward function 'reward_exits' was not run (its worker was lost) at step 1.",
        "warning: reward function 'reward_exits' crashed: its reward worker process died (exit code 17) at step 2.",
    ]
    for line in expected:
        assert line in output, f"missing: {line}\n{output[-8000:]}"
    assert output.count("Scored None (trl.reward_error_policy = 'none').") == len(expected)
    records = metrics(runner.workdir / "out")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records)
    assert all(math.isfinite(r["reward"]) for r in records)

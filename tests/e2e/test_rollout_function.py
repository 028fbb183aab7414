"""`trl.rollout_func`: a user function generates; its extra fields reach
the reward functions; bad output is reported by name. The tiny model
(tests/tiny_model.py): the function, not the model, makes the completions."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import metrics, raw_config, run_workdir

from grpo_core.config.loader import validate
from grpo_core.contract.errors import GrpoError
from grpo_core.training.run import run_training

ENV = """
def rollout(prompts, trainer):
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_score": []}
    for p in prompts:
        ids = tok.encode(
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        for k in range(trainer.num_generations):
            answer = tok.encode(str(k), add_special_tokens=False) + [tok.eos_token_id]
            out["prompt_ids"].append(list(ids))
            out["completion_ids"].append(answer)
            out["logprobs"].append(None)
            out["env_score"].append(float(k))
    return out

def short(prompts, trainer):
    return {"prompt_ids": [], "completion_ids": [], "logprobs": []}

def env_reward(completions, env_score, **kwargs):
    return list(env_score)
"""


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"Pick a number {i}"}]} for i in range(4)]
    return run_workdir(tmp_path, rows, {"env_mod": ENV}, monkeypatch)


def config(workdir: Path, model: str, func: str) -> dict:
    return raw_config(
        model,
        workdir,
        adapter="lora",
        lora_r=4,
        micro_batch_size=4,
        max_steps=1,
        learning_rate=1e-3,
        trl={
            "num_generations": 4,
            "max_completion_length": 8,
            "rollout_func": func,
            "reward_funcs": ["env_mod.env_reward"],
        },
    )


def test_rollout_func_drives_generation_and_feeds_rewards(workdir: Path, tiny_model_dir: str) -> None:
    assert run_training(validate(config(workdir, tiny_model_dir, "env_mod.rollout"))) == "completed"
    record = metrics(workdir / "out")[0]
    # env_score 0, 1, 2, 3 per group: the reward function saw the extra field
    assert record["rewards/env_reward/mean"] == pytest.approx(1.5)
    assert record["completions/mean_length"] == pytest.approx(2.0)  # one digit + EOS


def test_rollout_func_wrong_output_is_named(workdir: Path, tiny_model_dir: str) -> None:
    with pytest.raises(
        GrpoError, match=r"trl.rollout_func 'env_mod.short' returned 0 'prompt_ids' entries; expected 4"
    ):
        run_training(validate(config(workdir, tiny_model_dir, "env_mod.short")))

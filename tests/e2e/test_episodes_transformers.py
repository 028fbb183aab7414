"""Episodes through the transformers rollout (the trainer's own model samples
each turn, no server), with a chat template that rewrites earlier turns.

The template below drops the content of every assistant message that is not
the last one, as reasoning models' templates drop earlier thinking: the
conversation it renders is then not the ids the model was given. grpo must
notice, say so, count it, and still train on the ids as sampled. The model
is the tiny one of tests/tiny_model.py (SmolLM2's tokenizer and chat tokens):
the episode plumbing is the point, not what the model says.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, metrics, raw_config

from grpo_core.config.loader import validate
from grpo_core.host import plugin_host
from grpo_core.training.run import run_training

ROOT = REPO
GUESS = ROOT / "examples" / "guess-number"

FORGETFUL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "('' if (message['role'] == 'assistant' and not loop.last) else message['content']) + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def guess_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pip_target import install_into_target

    return install_into_target(GUESS, tmp_path_factory.mktemp("guess"))


def test_transformers_rollout_runs_episodes_and_a_rewriting_template_is_counted(
    tiny_model_dir: str, tmp_path: Path, guess_site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = validate(
        raw_config(
            tiny_model_dir,
            tmp_path,
            dataset=str(GUESS / "data" / "train.jsonl"),
            adapter="lora",
            lora_r=8,
            sequence_len=256,
            chat_template=FORGETFUL_TEMPLATE,
            micro_batch_size=4,
            max_steps=1,
            learning_rate=1e-4,
            seed=2,
            plugins={"environment": "guess_number"},
            episodes={"max_turns": 2, "max_tokens_per_turn": 5},
            trl={"num_generations": 4, "max_completion_length": 64},
        )
    )
    sys.path.insert(0, str(guess_site))
    plugin_host.rescan()
    try:
        assert run_training(cfg) == "completed"
    finally:
        sys.path.remove(str(guess_site))
        sys.modules.pop("grpo_guess_number", None)
        plugin_host.rescan()
    row = metrics(tmp_path / "out")[0]
    assert row["episodes/turns_mean"] > 1  # the environment answered, so the model had further turns
    replied = row["episodes/environment_tokens_mean"] > 0
    assert replied and row["episodes/template_mismatch"] >= 1
    assert "grpo trains on the ids as the engine sampled them" in capsys.readouterr().out


def test_turn_credit_trains_guessing_games_end_to_end(
    smollm2_dir: str, tmp_path: Path, guess_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``advantage_aggregation = "turn_returns"`` through a real run: SmolLM2
    plays the guessing game through the transformers rollout, the environment
    rewards each guess the hints allow (``hint_reward``, at its own turn), and
    the loss receives one advantage per token, different turns of one episode
    getting different ones (docs/turn-credit.md)."""
    import grpo_plugins.policy_loss as builtin_loss

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = builtin_loss.policy_loss

    def recording(settings, logps, advantages, mask, **kwargs):
        seen.append((advantages.detach().clone(), mask.detach().clone()))
        return real(settings, logps, advantages, mask, **kwargs)

    monkeypatch.setattr(builtin_loss, "policy_loss", recording)
    cfg = validate(
        raw_config(
            smollm2_dir,
            tmp_path,
            dataset=str(GUESS / "data" / "train.jsonl"),
            adapter="lora",
            lora_r=8,
            sequence_len=256,
            micro_batch_size=4,
            max_steps=1,
            learning_rate=1e-4,
            seed=5,
            plugins={
                "environment": "guess_number",
                "advantage_aggregation": "turn_returns",
                "guess_number": {"hint_reward": 0.2, "closeness": 0.5},
            },
            episodes={"max_turns": 3, "max_tokens_per_turn": 4},
            trl={"num_generations": 4, "max_completion_length": 48, "scale_rewards": "none"},
        )
    )
    sys.path.insert(0, str(guess_site))
    plugin_host.rescan()
    try:
        assert run_training(cfg) == "completed"
    finally:
        sys.path.remove(str(guess_site))
        sys.modules.pop("grpo_guess_number", None)
        plugin_host.rescan()
    rows = metrics(tmp_path / "out")
    assert len(rows) == 1 and rows[0]["episodes/turns_mean"] > 1 and rows[0]["grad_norm"] > 0
    assert seen and all(advantages.dim() == 2 for advantages, _ in seen)  # [B, C]: per token
    credited = 0
    for advantages, mask in seen:
        for row, row_mask in zip(advantages, mask, strict=True):
            values = {round(float(a), 6) for a, m in zip(row, row_mask, strict=True) if m}
            credited += len(values) > 1  # this episode's turns were credited apart
    assert credited > 0, "no trained episode had turns with different advantages"

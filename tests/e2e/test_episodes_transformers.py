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

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO

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
    out = tmp_path / "out"
    cfg = validate(
        {
            "base_model": tiny_model_dir,
            "adapter": "lora",
            "lora_r": 8,
            "sequence_len": 256,
            "chat_template": FORGETFUL_TEMPLATE,
            "datasets": [{"path": str(GUESS / "data" / "train.jsonl")}],
            "micro_batch_size": 4,
            "max_steps": 1,
            "learning_rate": 1e-4,
            "output_dir": str(out),
            "seed": 2,
            "plugins": {"environment": "guess_number"},
            "episodes": {"max_turns": 2, "max_tokens_per_turn": 5},
            "trl": {"num_generations": 4, "max_completion_length": 64},
        }
    )
    sys.path.insert(0, str(guess_site))
    plugin_host.rescan()
    try:
        assert run_training(cfg) == "completed"
    finally:
        sys.path.remove(str(guess_site))
        sys.modules.pop("grpo_guess_number", None)
        plugin_host.rescan()
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["episodes/turns_mean"] > 1  # the environment answered, so the model had further turns
    replied = row["episodes/environment_tokens_mean"] > 0
    assert replied and row["episodes/template_mismatch"] >= 1
    assert "grpo trains on the ids as the engine sampled them" in capsys.readouterr().out

"""Several environments in one run, rows routed by their ``environment`` column.

TRL 1.16's ``environment_factory`` dict (two classes by table) and an
environment of another kind (the agent) in one run, on the tiny model with
the transformers rollout (the point is the routing, not learning); an
unknown name is refused before the model loads, with TRL's words, the row
and the names. The same through the real vLLM server on SmolLM2:
tests/e2e/vllm/test_agent_vllm.py::test_a_mixed_run_trains_each_environment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import metrics, raw_config, write_rows

from grpo_core.config.environment_names import route_table
from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.training.run import run_training

ENVS = '''
import openai


class Counter:
    """Counts the model's calls."""

    def reset(self, **row):
        self.calls = 0
        return " (counter)"

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.calls += 1
        return str(self.calls)

    def get_reward(self):
        return 1.0


class Echo:
    """Repeats what it is told."""

    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: The text.
        """
        return text


def agent(row, *, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    return 0.5 if reply.choices[0].message.content else 0.0
'''


def mixed_config(tmp_path: Path, model_dir: str, rows: list[dict]) -> dict:
    write_rows(tmp_path / "train.jsonl", rows)
    return raw_config(
        model_dir,
        tmp_path,
        sequence_len=256,
        micro_batch_size=6,
        max_steps=1,
        learning_rate=1e-3,
        shuffle_dataset=False,
        plugins={"environment": ["tools", "agent"], "agent": {"function": "mixed_envs.agent"}},
        episodes={"max_turns": 2, "max_tokens_per_turn": 6},
        trl={
            "num_generations": 2,
            "max_completion_length": 40,
            "environment_factory": {"counter": "mixed_envs.Counter", "echo": "mixed_envs.Echo"},
        },
    )


def rows(*names: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Task {i}."}], "environment": n} for i, n in enumerate(names)]


@pytest.fixture
def mixed_envs(tmp_path: Path):
    (tmp_path / "mixed_envs.py").write_text(ENVS)
    sys.path.insert(0, str(tmp_path))
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop("mixed_envs", None)


def test_rows_choose_among_factory_classes_and_an_agent(tiny_model_dir: str, tmp_path: Path, mixed_envs) -> None:
    cfg = validate(mixed_config(tmp_path, tiny_model_dir, rows("counter", "echo", "agent")))
    assert run_training(cfg) == "completed"
    assert cfg.trl.reward_funcs == ["environment"]
    row = metrics(tmp_path / "out")[0]
    for name in ("counter", "echo", "agent"):
        assert row[f"environments/{name}/episodes"] == 2.0, name
        assert row[f"environments/{name}/failures"] == 0.0
        assert f"environments/{name}/turns_mean" in row and f"environments/{name}/solve_rate" in row
    assert row["environments/counter/reward_mean"] == 1.0  # get_reward of its own class
    assert row["environments/agent/reward_mean"] in (0.0, 0.25, 0.5)
    assert row["environments/agent/turns_mean"] == 1.0


def test_an_unknown_environment_is_refused_before_the_model_loads(
    smollm2_dir: str, tmp_path: Path, mixed_envs, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = validate(mixed_config(tmp_path, smollm2_dir, rows("counter", "chess")))
    with pytest.raises(DataError) as refused:
        run_training(cfg)
    message = str(refused.value)
    assert "row 1 has `environment='chess'`, which is not among the environments of this run" in message
    assert "Expected one of: ['counter', 'echo', 'agent']" in message
    cfg = validate(mixed_config(tmp_path, smollm2_dir, [{"prompt": "no column"}]))
    with pytest.raises(DataError, match="row 0 has no 'environment' column"):
        run_training(cfg)
    assert "loading model" not in capsys.readouterr().out


def test_one_name_served_twice_is_a_config_error() -> None:
    cfg = validate({"base_model": "m", "trl": {"environment_factory": {"agent": "m.C"}}})

    class Tools:
        names = staticmethod(lambda config: ["agent"])

    with pytest.raises(ConfigError, match="'agent' is served by both 'tools' and 'agent'"):
        route_table(cfg, [("tools", Tools), ("agent", object)])
    assert route_table(cfg, [("agent", object)]).routed is False  # one environment: the column is not read

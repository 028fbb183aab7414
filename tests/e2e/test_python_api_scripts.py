"""``grpo.train`` from a user's script, for real: the example of
docs/from-trl.md runs as written, a script in TRL's style (reward function
objects, a ``datasets.Dataset``) trains end to end, and a script hands its own
environment class and tools as objects. The transformers rollout, separate
Python processes started as a user would start their script; the example on
SmolLM2 as the page names it, the other two on the tiny random model (what they
check is plumbing: the arguments taken, the files and metrics written). What
``grpo.train`` refuses before loading anything is tests/unit/test_python_api.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import REPO

ROOT = REPO


def readme_example() -> str:
    page = (ROOT / "docs" / "from-trl.md").read_text(encoding="utf-8")
    section = page.split("## From a Python script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def run_script(path: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(path), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


# ------------------------------------------------------------ real runs


def test_readme_python_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(readme_example(), encoding="utf-8")
    result = run_script(script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    status, output_dir, reward = result.stdout.strip().splitlines()[-1].split(" ")
    assert status == "completed"
    out = tmp_path / output_dir
    assert (out / "adapter_model.safetensors").is_file()
    assert (out / "train_dataset").is_dir()  # what was trained on stays beside the model
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert float(reward) == records[-1]["reward"]
    assert "rewards/correct_sum/mean" in records[-1]


TRL_STYLE = '''
"""A script as a TRL user writes one: reward function objects and a datasets.Dataset."""
import json
import sys

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer

import grpo


class LengthReward:
    """A reward function object (TRL accepts any callable)."""

    __name__ = "length_reward"

    def __init__(self, target: int) -> None:
        self.target = target

    def __call__(self, completions, **kwargs):
        return [-abs(len(c[0]["content"]) - self.target) / 10 for c in completions]


def correct(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


train_dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "What is 4 + 3?"}]],
        "answer": ["5", "7"],
    }
)
eval_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1 + 1?"}]], "answer": ["2"]})
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
tokenizer.chat_template = tokenizer.chat_template + "{# this script's template #}"
config = grpo.load_config(sys.argv[1])  # a validated config object, as TRL scripts build a GRPOConfig
result = grpo.train(
    config,
    reward_funcs=[correct, LengthReward(20)],
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,  # GRPOTrainer's arguments, as a TRL script passes them
    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    processing_class=tokenizer,
)
print(json.dumps({"status": result.status, "output_dir": str(result.output_dir), "metrics": result.metrics(),
                  "checkpoints": [str(p) for p in result.checkpoints],
                  "tokenizer_config": result.config.tokenizer_config}))
'''


def test_trl_style_script_trains_end_to_end(tmp_path: Path, tiny_model_dir: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            base_model = {json.dumps(tiny_model_dir)}
            adapter = "lora"
            micro_batch_size = 8        # 2 prompts x 4 completions: the whole dataset per step
            num_epochs = 1              # no max_steps: one epoch of 2 prompts = 1 step
            learning_rate = 1.0e-4
            output_dir = {json.dumps(str(tmp_path / "out"))}

            [trl]
            num_generations = 4
            max_completion_length = 8
            reward_funcs = ["rewards.never_loaded"]   # replaced by the callables the script passes
            """
        )
    )
    script = tmp_path / "train_trl_style.py"
    script.write_text(TRL_STYLE, encoding="utf-8")
    result = run_script(script, tmp_path, str(config), tiny_model_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["status"] == "completed"
    assert [m["step"] for m in report["metrics"] if "loss" in m] == [1]  # num_epochs = 1 over 2 prompts
    # GRPOTrainer's eval_dataset, peft_config and processing_class took effect
    assert any(m.get("eval/num_samples") == 1.0 for m in report["metrics"]), report["metrics"]
    adapter = json.loads((Path(report["output_dir"]) / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    saved = Path(report["tokenizer_config"])
    assert saved == tmp_path / "out" / "processing_class"
    assert "this script's template" in (Path(report["output_dir"]) / "chat_template.jinja").read_text()
    last = [m for m in report["metrics"] if "loss" in m][-1]
    assert {"rewards/correct/mean", "rewards/length_reward/mean"} <= set(last)
    assert last["rewards/length_reward/mean"] < 0  # the object's own scoring ran
    assert (Path(report["output_dir"]) / "adapter_model.safetensors").is_file()
    assert report["checkpoints"] and report["checkpoints"][-1].endswith("checkpoint-1")


TOOLS_SCRIPT = '''
import json, sys
import grpo

class Counter:
    """TRL's environment_factory: one per episode; its public methods are tools."""
    def reset(self, **row):
        self.calls = 0
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return str(a + b)

def shout(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: What to repeat.
    """
    return text.upper()

def short(completions, **kwargs):
    return [-len(str(c)) / 100 for c in completions]

result = grpo.train(sys.argv[1], reward_funcs=[short], environment_factory=Counter, tools=[shout])
print(json.dumps({"status": result.status, "metrics": result.metrics(),
                  "factory": result.config.trl.environment_factory, "tools": result.config.trl.tools}))
'''


def test_a_script_passes_its_own_environment_class_and_tools_as_objects(tmp_path: Path, tiny_model_dir: str) -> None:
    """TRL scripts pass ``environment_factory=MyEnv, tools=[f]`` defined in the
    script itself (``__main__``); grpo.train takes them as TRL does, through
    the tools environment and the transformers rollout."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} + {i}? Use the add tool."}) for i in range(2)))
    config = tmp_path / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        base_model = {json.dumps(tiny_model_dir)}
        adapter = "lora"
        lora_r = 4
        sequence_len = 512
        micro_batch_size = 4
        max_steps = 1
        learning_rate = 1.0e-4
        output_dir = {json.dumps(str(tmp_path / "out"))}
        [[datasets]]
        path = {json.dumps(str(data))}
        [episodes]
        max_turns = 2
        max_tokens_per_turn = 8
        [trl]
        num_generations = 4
        max_completion_length = 32
        reward_funcs = ["rewards.never_loaded"]
        """)
    )
    script = tmp_path / "train_with_tools.py"
    script.write_text(TOOLS_SCRIPT, encoding="utf-8")
    result = run_script(script, tmp_path, str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["status"] == "completed"
    assert report["factory"] == "grpo_core.host.script_objects.Counter"
    assert report["tools"] == ["grpo_core.host.script_objects.shout"]
    row = report["metrics"][-1]
    assert row["step"] == 1 and "episodes/turns_mean" in row  # the tools environment ran the episodes

"""The shipped examples run as written (one short step each, transformers
rollout so no server is needed; the vLLM path is covered in tests/e2e/vllm).
The model is swapped for the tiny one of tests/tiny_model.py: what is checked
is that each config, its data and its rewards run, not what the model learns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO

from grpo_core.config.loader import load_config
from grpo_core.training.run import run_training

EXAMPLES = REPO / "examples"


@pytest.mark.parametrize("name", ["arithmetic", "gsm8k", "gdpo"])
def test_example_trains_one_step(
    name: str, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the config must find its data and rewards beside itself
    # Several examples have a `rewards.py`, and loading a config puts its folder
    # on sys.path for the rest of the process: put this example's folder first.
    monkeypatch.setattr(sys, "path", [str(EXAMPLES / name), *sys.path])
    monkeypatch.delitem(sys.modules, "rewards", raising=False)
    cfg = load_config(
        EXAMPLES / name / "config.toml",
        [
            f"base_model={json.dumps(tiny_model_dir)}",
            "trl.use_vllm=false",
            "max_steps=1",
            "micro_batch_size=8",
            "gradient_accumulation_steps=1",
            "trl.max_completion_length=8",
            f"output_dir={json.dumps(str(tmp_path / 'out'))}",
        ],
    )
    assert run_training(cfg) == "completed"
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    reward_keys = [k for k in record if k.startswith("rewards/") and k.endswith("/mean")]
    assert len(reward_keys) == 2, reward_keys
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()

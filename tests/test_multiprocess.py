"""Several training processes (accelerate / torchrun, gloo on CPU).

Real processes, real launchers, the tiny model (tests/tiny_model.py: the
properties here are the loop's arithmetic and its collectives, not the
model's size) and the transformers rollout (rank 0 samples with its own
replica). NCCL and GPUs cannot run here; gloo runs the same collectives.

* 2 processes x (micro_batch_size 2, gradient_accumulation_steps 1) train
  on the same global batch as 1 process x (2, 2): the losses, gradient
  norms and weights after 2 steps match (float32 tolerances below; the
  summation order differs, nothing else).
* Every rank trains on its own share of each batch, of whole groups: the
  prompts each rank saw are disjoint and together cover the batch.
* With async prefetch on (the producer thread issues no collectives) the
  run finishes, and a run resumed from a mid-run checkpoint with 2
  processes repeats the straight run exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_core.config.convert import to_toml_text
from tiny_model import build_tiny_model

REWARDS = "def parity(completion_ids, **kwargs):\n    return [float(sum(ids) % 2) for ids in completion_ids]\n"
TESTS = Path(__file__).parent
ROOT = TESTS.parent
TIMEOUT = 240


def write_config(tmp: Path, name: str, model: str, **top) -> Path:
    trl = {"num_generations": 2, "max_completion_length": 4, "reward_funcs": ["mp_rewards.parity"], "temperature": 1.0,
           "skip_zero_advantage_batches": False, **top.pop("trl", {})}  # fmt: skip
    raw = {"base_model": model, "adapter": None, "datasets": [{"path": str(tmp / "train.jsonl")}], "sequence_len": 64,
           "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2, "learning_rate": 5e-3,
           "lr_scheduler": "constant", "output_dir": str(tmp / name), "seed": 7, "save_steps": 100, **top, "trl": trl}  # fmt: skip
    path = tmp / f"{name}.toml"
    path.write_text(to_toml_text(raw))
    return path


def run_grpo(tmp: Path, args: list[str], launcher: list[str] | None = None, shares: Path | None = None) -> None:
    """``grpo <args>`` in its own process(es) (``launcher``: e.g. torchrun),
    from ``tmp`` so the reward module imports."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(TESTS), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    if shares is not None:
        shares.mkdir(exist_ok=True)
        env["GRPO_TEST_SHARES"] = str(shares)
    entry = ["-m", "multiproc_entry"] if shares is not None else ["-m", "grpo_core.cli"]
    cmd = [*(launcher or [sys.executable]), *entry, *args]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.fixture
def workdir(smollm2_dir: str, tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "mp_rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"Item {i}:"}) for i in range(12)))
    return tmp_path, build_tiny_model(smollm2_dir, tmp_path / "tiny")


def test_two_processes_match_one_on_the_same_global_batch(workdir: tuple[Path, str]) -> None:
    tmp, model = workdir
    one = write_config(tmp, "one", model, gradient_accumulation_steps=2)  # 1 x 2 x 2 = 4 completions per step
    two = write_config(tmp, "two", model)  # 2 processes x 2 x 1 = 4
    run_grpo(tmp, ["run", str(one)])
    run_grpo(tmp, ["run", str(two), "--num-processes", "2"])

    a, b = metrics(tmp / "one"), metrics(tmp / "two")
    assert [r["step"] for r in b] == [1, 2], "rank 0 alone writes metrics.jsonl: one line per step"
    assert [r["world_size"] for r in a] == [1, 1] and [r["world_size"] for r in b] == [2, 2]
    for ra, rb in zip(a, b, strict=True):
        assert rb["reward"] == ra["reward"], "rank 0 samples and scores the same batch"
        assert rb["num_tokens"] == ra["num_tokens"], "tokens summed over ranks"
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
        assert ra["grad_norm"] > 0
    wa, wb = weights(tmp / "one"), weights(tmp / "two")
    moved = 0.0
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-6)
        moved = max(moved, float((wa[key] - weights_at_start(model)[key]).abs().max()))
    assert moved > 1e-4, "the weights did not move: the comparison proves nothing"


_START: dict[str, dict[str, torch.Tensor]] = {}


def weights_at_start(model: str) -> dict[str, torch.Tensor]:
    if model not in _START:
        from safetensors.torch import load_file

        _START[model] = load_file(str(Path(model) / "model.safetensors"))
    return _START[model]

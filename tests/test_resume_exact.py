"""Resume is exact: a run resumed from a checkpoint trains the same steps,
to the same metrics and weights, as the run that never stopped.

On the tiny model (tests/tiny_model.py), with everything that carries
state across steps switched on: warmup + cosine schedule,
``adamw_torch_fused`` (torch's fused AdamW, which runs on CPU too), the
replay buffer, re-rolling from step 0, and ``num_iterations = 2`` with the
checkpoint taken in the middle of a batch (the pending batch and its old
log-probs must come back as they were).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo_core.config.loader import validate
from grpo_core.training.run import run_training
from tiny_model import build_tiny_model

# Rare reward: most groups are all-zero, so the replay buffer substitutes
# groups and re-roll queues prompts at every step.
REWARDS = "def rare(completion_ids, **kwargs):\n    return [float(ids[0] % 5 == 0) if ids else 0.0 for ids in completion_ids]\n"


def config(tmp: Path, model: str, out: str, **top):
    return validate({
        "base_model": model, "adapter": None, "datasets": [{"path": str(tmp / "train.jsonl")}], "sequence_len": 64,
        "micro_batch_size": 8, "gradient_accumulation_steps": 2, "max_steps": 7, "learning_rate": 5e-3,
        "lr_scheduler": "cosine", "warmup_steps": 2, "optimizer": "adamw_torch_fused", "weight_decay": 0.01,
        "output_dir": str(tmp / out), "seed": 5, "save_steps": 3, **top,
        "trl": {"num_generations": 4, "max_completion_length": 4, "reward_funcs": ["resume_rewards.rare"],
                "temperature": 1.0, "num_iterations": 2, "replay_buffer_size": 4, "reroll_start_fraction": 0.0,
                "reroll_max_groups": 1},
    })  # fmt: skip


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_split_run_equals_straight_run(smollm2_dir: str, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "resume_rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"Item {i}:"}) for i in range(10)))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_model(smollm2_dir, tmp_path / "tiny")

    assert run_training(config(tmp_path, model, "straight")) == "completed"
    # checkpoint-3: after the first iteration of the second batch (num_iterations = 2)
    resumed = config(tmp_path, model, "resumed", resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    assert run_training(resumed) == "completed"

    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in split] == [4, 5, 6, 7]
    assert any(r.get("replay/replayed_groups", 0) > 0 for r in straight), "replay never engaged: the test proves less"
    # Same process kind, same CPU kernels, same seeds: the math allows bit-exact, so that is what is asserted.
    def math(record: dict) -> dict:  # everything but wall-clock timings
        return {k: v for k, v in record.items() if k != "step_time" and not k.startswith("time/")}

    for a, b in zip(straight[3:], split, strict=True):
        assert math(a) == math(b)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "straight" / "model.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key

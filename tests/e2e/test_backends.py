"""Training backends (grpo_core/parallel): the table picks one by
config and process count, each implements the whole interface, and a new
backend needs nothing but its class and a table entry: the trainer calls
the interface and never asks which backend runs (a real run on the tiny
model, with a backend the trainer has never heard of)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from helpers import metrics, raw_config, write_rows

from grpo_core import parallel as backends
from grpo_core.config.loader import validate
from grpo_core.parallel import BACKENDS, backend_for
from grpo_core.parallel.base import TrainingBackend
from grpo_core.parallel.replicated import ReplicatedBackend
from grpo_core.training.run import run_training

REWARD = """
def even(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]
"""


RUN = {
    "adapter": "lora",
    "lora_r": 4,
    "sequence_len": 64,
    "micro_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "max_steps": 2,
    "learning_rate": 1e-2,
    "lr_scheduler": "constant",
    "seed": 1,
}


def _config(tmp_path: Path, model_dir: str, name: str = "out", **top: object):
    write_rows(tmp_path / "train.jsonl", [{"prompt": f"Write token number {i}:"} for i in range(8)])
    trl = {"num_generations": 8, "max_completion_length": 4, "reward_funcs": ["backend_rewards.even"]}
    return validate(raw_config(model_dir, tmp_path, out=name, **(RUN | {"trl": trl} | top)))


@pytest.mark.parametrize(
    ("top", "world", "chosen", "described"),
    [
        ({}, 1, "replicated", "one process"),
        ({}, 2, "replicated", "DDP: a full replica per process"),
        ({"fsdp": ["full_shard", "auto_wrap"]}, 2, "fsdp", "FSDP full_shard auto_wrap"),
        ({"fsdp": ["full_shard", "auto_wrap"]}, 1, "replicated", "one process (fsdp has nothing to shard over"),
        ({"deepspeed": "ZERO"}, 1, "deepspeed", "DeepSpeed ZeRO-2 ("),
        ({"deepspeed": "ZERO"}, 2, "deepspeed", "DeepSpeed ZeRO-2 ("),
    ],
)
def test_the_table_picks_the_backend_by_config_and_process_count(
    tmp_path: Path, top: dict, world: int, chosen: str, described: str
) -> None:
    if top.get("deepspeed") == "ZERO":
        (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
        top = {"deepspeed": str(tmp_path / "zero2.json")}
    cfg = _config(tmp_path, "unused-model", **top)
    backend = backend_for(cfg, world)
    assert backend.name == chosen
    assert backend.describe(cfg, world).startswith(described)  # the run's log line and `grpo config check` say it


def _interface() -> set[str]:
    return {name for name, _ in inspect.getmembers(TrainingBackend) if not name.startswith("_")} | {"name"}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_backend_implements_the_whole_interface(backend: type) -> None:
    missing = {name for name in _interface() if not hasattr(backend, name)}
    assert missing == set()
    for name in _interface() - {"name"}:  # with the interface's arguments
        ours, theirs = inspect.signature(getattr(backend, name)), inspect.signature(getattr(TrainingBackend, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    assert BACKENDS[-1] is ReplicatedBackend  # the fallback comes last: it takes every config


class RefusingBackend(ReplicatedBackend):
    """A backend with a rule of its own: it refuses ``seed = 13``."""

    name = "refusing"

    @classmethod
    def config_problems(cls, cfg, traits):
        return (
            [f"backend 'refusing' cannot run seed = {cfg.seed} (policy '{traits.names['policy_loss']}'): change seed."]
            if cfg.seed == 13
            else []
        )


def test_a_new_backends_config_rules_reach_the_check_with_no_change_elsewhere(tmp_path: Path, monkeypatch) -> None:
    """``grpo run`` and ``grpo config check`` (check_run_config) ask every
    backend in the table, each with the chosen implementations' traits; the
    config layer's check_config knows no backend and asks none unless told."""
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.checks import check_config
    from grpo_core.validation.run_check import check_run_config

    (tmp_path / "backend_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backends, "BACKENDS", (RefusingBackend, *BACKENDS))
    refused = _config(tmp_path, "org/model", seed=13)  # a hub id: the check does not look for it offline
    with pytest.raises(ConfigError, match=r"backend 'refusing' cannot run seed = 13 \(policy 'grpo'\)"):
        check_run_config(refused)
    assert check_run_config(_config(tmp_path, "org/model", seed=12)) == []
    assert check_config(refused) == []  # the config layer alone: no backend's rules


def test_the_built_in_backends_answer_only_for_their_own_keys(tmp_path: Path) -> None:
    """Each rule moved out of the config layer with its backend, and runs
    whatever the process count (``grpo config check`` starts no process)."""
    from grpo_core.validation.checks import chosen_traits

    traits = chosen_traits({"policy_loss": "grpo"}, {})
    (tmp_path / "backend_rewards.py").write_text(REWARD)
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    deepspeed = _config(
        tmp_path,
        str(tmp_path),
        deepspeed=str(zero3),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    fsdp = _config(tmp_path, str(tmp_path), fsdp=["full_shard", "hybrid_shard"])
    by_backend = {b.name: (b.config_problems(deepspeed, traits), b.config_problems(fsdp, traits)) for b in BACKENDS}
    assert [p.split(" fails")[0] for p in by_backend["deepspeed"][0]] == [
        "DeepSpeed ZeRO-3 with gradient_checkpointing_kwargs.use_reentrant = false"
    ]
    assert by_backend["deepspeed"][1] == []
    assert by_backend["fsdp"][0] == [] and ["hybrid_shard" in p for p in by_backend["fsdp"][1]] == [True]
    assert by_backend["replicated"] == ([], [])


class RecordingBackend(ReplicatedBackend):
    """A "fourth" backend: the replicated one, recording what the trainer asks of it."""

    name = "recording"
    calls: list[str] = []

    @classmethod
    def applies(cls, cfg, world) -> bool:
        return True

    def backward(self, loss, last):
        self.calls.append(f"backward(last={last})")
        super().backward(loss, last)

    def optimizer_step(self, max_grad_norm):
        self.calls.append("optimizer_step")
        return super().optimizer_step(max_grad_norm)

    def full_model(self, version):
        self.calls.append(f"full_model({version})")
        return super().full_model(version)

    def checkpoint_parts(self, staging, version):
        self.calls.append(f"checkpoint_parts({staging.name})")
        return super().checkpoint_parts(staging, version)

    def resume(self, path, loaded):
        self.calls.append(f"resume({path.name})")
        super().resume(path, loaded)


def test_a_new_backend_is_its_class_and_a_table_entry(tmp_path: Path, tiny_model_dir: str, monkeypatch) -> None:
    (tmp_path / "backend_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    tiny = tiny_model_dir
    monkeypatch.setattr(backends, "BACKENDS", (RecordingBackend, *BACKENDS))
    RecordingBackend.calls = []
    assert run_training(_config(tmp_path, tiny, save_steps=1)) == "completed"
    calls = RecordingBackend.calls
    steps = metrics(tmp_path / "out")
    trained = sum(1 for s in steps if s["grad_norm"] > 0)
    assert trained >= 1, steps  # the reward varies within groups: something trained
    # every trained step: backward per trained micro-batch, the last one flagged, then one optimizer step
    assert calls.count("optimizer_step") == trained
    assert calls.count("backward(last=True)") == trained
    # the syncs and saves read the full weights through it; the checkpoint at step 1 and the final one
    assert calls[0] == "full_model(0)"  # the first sync, before step 1
    assert "checkpoint_parts(.tmp-checkpoint-1-recording)" in calls
    assert (tmp_path / "out" / "checkpoint-1" / "model").is_dir()

    RecordingBackend.calls = []
    resumed = _config(tmp_path, tiny, max_steps=3, resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert run_training(resumed) == "completed"
    assert RecordingBackend.calls[0] == "resume(checkpoint-1)"

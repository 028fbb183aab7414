"""Checkpoints load without running code from them.

Each test writes a real checkpoint with :func:`save_checkpoint` (a tiny
randomly initialised Llama, a real AdamW after one step, the LR schedule
grpo builds), then tampers with it the way an attacker who shares a
checkpoint could. The end-to-end refusal through ``grpo run`` on the real
SmolLM2 is in ``tests/e2e/reliability/test_untrusted_checkpoint.py``.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tiny_model import random_llama

from grpo_core.checkpointing import checkpoint as ckpt
from grpo_core.checkpointing.safe_load import FORMER_MODULES, UnsafeCheckpoint, unloadable_reason
from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, ScoredGroup
from grpo_core.generation.producer import ScoredBatch

STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pt", "extra_state.pt")


class WritesMarker:
    """Unpickling this object writes a file: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@dataclasses.dataclass
class Foreign:
    """A plugin's own class: loading would have to trust and rebuild it."""

    value: int


def tiny_parts() -> tuple[Any, torch.optim.Optimizer, Any]:
    from transformers import get_scheduler

    model = random_llama(vocab_size=32, max_position_embeddings=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=2, num_training_steps=5)
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def a_batch(column: Any = "7") -> ScoredBatch:
    prompt = Prompt(
        prompt=[{"role": "user", "content": "What is 3 + 4?"}],
        prompt_ids=[1, 2, 3],
        columns={"answer": column},
        index=5,
    )
    group = RolloutGroup(prompt, [Completion([4, 5], "7", [-0.5, -0.25], False, {"tool": [1, 2]})], policy_version=3)
    return ScoredBatch(
        [ScoredGroup(group, [[1.0, None]], [0.5], replayed=True)],
        policy_version=3,
        metrics={"reward": 1.0},
        stream_state={"epoch": 1, "position": 2},
    )


def save(tmp_path: Path, extra: dict[str, Any] | None = None) -> tuple[Path, torch.optim.Optimizer, Any]:
    model, optimizer, scheduler = tiny_parts()
    extra = (
        {"replay": {"version": 1, "buffer": [], "totals": {"replayed": 2}}, "pending_batch": a_batch()}
        if extra is None
        else extra
    )
    path = ckpt.save_checkpoint(tmp_path / "out", 1, model, None, optimizer, scheduler, {"policy_version": 1}, extra)
    return path, optimizer, scheduler


def written_before_the_manifest(path: Path) -> Path:
    """The checkpoint as grpo wrote it before each one carried manifest.json
    (the state files below are rewritten the old way, which its checksums
    would rightly call damaged)."""
    (path / "manifest.json").unlink()
    return path


def test_a_checkpoint_reads_back_whole_without_unpickling(tmp_path: Path) -> None:
    path, optimizer, scheduler = save(tmp_path)
    draws_after_save = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    loaded = ckpt.read_checkpoint(path)
    _, fresh_optimizer, fresh_scheduler = tiny_parts()
    ckpt.restore_checkpoint(loaded, fresh_optimizer, fresh_scheduler)

    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws_after_save
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for key, state in saved["state"].items():
        torch.testing.assert_close(restored["state"][key]["exp_avg"], state["exp_avg"])
    assert loaded.extra["pending_batch"] == a_batch()  # grpo's dataclasses come back as themselves
    assert loaded.extra["replay"]["totals"] == {"replayed": 2}
    assert loaded.trainer_state["step"] == 1


@pytest.mark.parametrize("name", STATE_FILES)
def test_a_file_that_would_run_code_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    path, _, _ = save(tmp_path)
    marker = tmp_path / "marker"
    torch.save({"state": WritesMarker(marker)}, path / name)

    with pytest.raises(UnsafeCheckpoint) as refused:
        ckpt.read_checkpoint(path)
    assert str(path / name) in str(refused.value)
    assert "exec" in str(refused.value)  # the refused global is named
    assert not marker.exists()

    torch.load(path / name, weights_only=False)  # the control: unpickling it for real does run the code
    assert marker.read_text() == "code ran"


def test_a_plain_pickle_file_is_refused_too(tmp_path: Path) -> None:
    import pickle

    path, _, _ = save(tmp_path)
    marker = tmp_path / "marker"
    (path / "extra_state.pt").write_bytes(pickle.dumps({"x": WritesMarker(marker)}))
    with pytest.raises(UnsafeCheckpoint, match="extra_state.pt"):
        ckpt.read_checkpoint(path)
    assert not marker.exists()


def test_a_checkpoint_from_before_safe_loading_still_loads(tmp_path: Path) -> None:
    """The previous format: numpy's RNG state as an array, the pending batch
    pickled as grpo dataclasses; both are data, so it loads under the rules."""
    path = written_before_the_manifest(save(tmp_path)[0])
    random.seed(3)
    np.random.seed(3)
    old_rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    torch.save(old_rng, path / "rng_state.pt")
    torch.save({"pending_batch": a_batch()}, path / "extra_state.pt")
    expected = (random.random(), float(np.random.rand()))

    loaded = ckpt.read_checkpoint(path)
    ckpt.set_rng_state(loaded.rng)
    assert (random.random(), float(np.random.rand())) == expected
    assert loaded.extra["pending_batch"] == a_batch()


def test_a_checkpoint_from_before_the_modules_moved_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before grpo_core's modules moved into layer folders
    name grpo's types by their old module (``grpo_core.types.Completion``): they
    load as the same classes (safe_load.FORMER_MODULES), though no module of
    that name exists any more, and nothing else is let through by the old name."""
    import sys

    from grpo_core.contract import types as contract_types

    path = written_before_the_manifest(save(tmp_path)[0])
    monkeypatch.setitem(sys.modules, "grpo_core.types", contract_types)  # what pickling by the old name needs
    for kind in (Prompt, Completion, RolloutGroup, ScoredGroup):
        monkeypatch.setattr(kind, "__module__", "grpo_core.types")
    torch.save({"pending_batch": a_batch()}, path / "extra_state.pt")
    monkeypatch.undo()
    assert b"grpo_core.types" in (path / "extra_state.pt").read_bytes()
    assert "grpo_core.types" not in sys.modules and FORMER_MODULES["grpo_core.contract.types"] == ("grpo_core.types",)

    assert ckpt.read_checkpoint(path).extra["pending_batch"] == a_batch()


def test_a_pending_batch_from_before_training_was_split_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer's batch type was ``grpo_core.training.producer.ScoredBatch``
    until the loop's modules moved into role packages: such a checkpoint loads
    as today's class."""
    path = written_before_the_manifest(save(tmp_path)[0])
    monkeypatch.setattr(ScoredBatch, "__module__", "grpo_core.training.producer")
    monkeypatch.setitem(sys.modules, "grpo_core.training.producer", SimpleNamespace(ScoredBatch=ScoredBatch))
    torch.save({"pending_batch": a_batch()}, path / "extra_state.pt")
    monkeypatch.undo()
    assert b"grpo_core.training.producer" in (path / "extra_state.pt").read_bytes()
    assert ckpt.read_checkpoint(path).extra["pending_batch"] == a_batch()


def test_plugin_state_that_is_not_plain_data_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(GrpoError, match="state of 'my_plugin'") as refused:
        save(tmp_path, {"my_plugin": {"thing": Foreign(1)}, "pending_batch": None})
    assert "Foreign" in str(refused.value)
    assert not list((tmp_path / "out").glob("*checkpoint-*"))
    with pytest.raises(GrpoError, match="state of 'other'.*cannot be saved at all"):
        save(tmp_path, {"other": {"callback": lambda: 1}})


def test_a_batch_with_a_column_loading_cannot_rebuild_is_named() -> None:
    assert unloadable_reason(a_batch()) is None
    reason = unloadable_reason(a_batch(column=datetime.date(2026, 1, 1)))
    assert reason is not None and "datetime.date" in reason


def test_a_damaged_or_incomplete_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path, _, _ = save(tmp_path)
    (path / "optimizer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(GrpoError, match="optimizer.pt"):
        ckpt.read_checkpoint(path)
    (path / "scheduler.pt").unlink()
    with pytest.raises(GrpoError, match="scheduler.pt missing"):
        ckpt.read_checkpoint(path)
    (path / "trainer_state.json").write_text(json.dumps({"no": "step"}))
    with pytest.raises(GrpoError, match="integer 'step'"):
        ckpt.read_checkpoint(path)


# ---------------------------------------------------------------- a plugin's state is JSON data


def a_scored_group() -> ScoredGroup:
    from grpo_core.contract.types import EpisodeStats

    episode = Completion(
        [5, 6, 7], "ab", logprobs=[-0.5, 0.0, -1.0], loss_mask=[1, 0, 1], episode=EpisodeStats(turns=2, reward=1.0)
    )
    episode.environment = object()  # live while scored: never saved
    group = RolloutGroup(Prompt([{"role": "user", "content": "hi"}], [1, 2], {"answer": "3"}, 4), [episode], 3)
    return ScoredGroup(group, rewards=[[1.0, None]], advantages=[0.5], replayed=True)


def test_a_scored_group_survives_a_json_round_trip() -> None:
    group = a_scored_group()
    data = json.loads(json.dumps(group.to_dict()))
    assert "environment" not in data["group"]["completions"][0]
    back = ScoredGroup.from_dict(data)
    assert back == group  # the live environment is not compared, and not saved
    assert back.group.completions[0].episode is not None and back.group.completions[0].episode.turns == 2
    assert back.group.completions[0].environment is None and back.group.prompt.columns == {"answer": "3"}


class _Stateful:
    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_plugin_state_must_be_json_data_and_the_fix_is_named() -> None:
    good = {"buffer": [a_scored_group().to_dict()], "totals": {"replayed": 1}}
    assert ckpt.plugin_state("replay", _Stateful(good)) is good
    with pytest.raises(
        GrpoError,
        match=r"state of 'replay': state_dict\(\)\['buffer'\]\[0\] is a "
        r"grpo_core\.contract\.types\.ScoredGroup.*group\.to_dict\(\)",
    ):
        ckpt.plugin_state("replay", _Stateful({"buffer": [a_scored_group()]}))
    with pytest.raises(GrpoError, match=r"state_dict\(\) has the key 3, a int, not a string"):
        ckpt.plugin_state("replay", _Stateful({3: "three"}))
    with pytest.raises(GrpoError, match=r"state_dict\(\)\['w'\] is a torch\.Tensor.*\.tolist\(\)"):
        ckpt.plugin_state("schedule", _Stateful({"w": torch.zeros(2)}))

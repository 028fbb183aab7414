"""The safety net's rules, in process: which phase an exception is charged
to, when a checkpoint may be saved after it, what the one line says, the
exit code of each class of failure, and the same net around every ``grpo``
command and ``grpo.train``. The end-to-end runs (real faults in real
``grpo run`` processes) are in ``tests/e2e/reliability/test_safety_net.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from grpo_core.contract.errors import (
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_OUT_OF_MEMORY,
    EXIT_SYSTEM,
    EngineUnavailable,
    GrpoError,
    PluginError,
    TrainingInterrupted,
    UnexpectedFailure,
)
from grpo_core.runtime import failure
from grpo_core.training.safety_net import SafetyNet


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as if code had raised it."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_each_class_of_failure_has_its_exit_code() -> None:
    assert failure.exit_code_of(MemoryError()) == EXIT_OUT_OF_MEMORY
    assert failure.exit_code_of(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == EXIT_OUT_OF_MEMORY
    assert failure.exit_code_of(RuntimeError("CUDA out of memory. Tried to allocate")) == EXIT_OUT_OF_MEMORY
    assert failure.exit_code_of(PermissionError(13, "denied")) == EXIT_SYSTEM
    assert failure.exit_code_of(KeyError("x")) == EXIT_INTERNAL
    documented = {GrpoError().exit_code, EngineUnavailable().exit_code, TrainingInterrupted().exit_code}
    assert documented | {EXIT_OUT_OF_MEMORY, EXIT_SYSTEM, EXIT_INTERNAL, 0} == set(EXIT_CODES)


def test_the_innermost_phase_is_the_one_named() -> None:
    inner = raised(RuntimeError("boom"))
    failure.tag(inner, "step 3, scoring", True)
    failure.tag(inner, "step 3, generating", True)  # an outer phase does not overwrite
    try:
        raise PluginError("wrapped") from inner
    except PluginError as outer:
        failure.tag(outer, "step 3, between steps", False)
        assert failure.where_of(outer) == "step 3, scoring"
        assert failure.can_save_after(outer)


def test_a_grpo_error_raised_by_code_gets_its_phase_and_traceback_file(tmp_path: Path) -> None:
    cause = raised(ValueError("deep inside"))
    try:
        raise PluginError("hook x of y raised ValueError: deep inside.") from cause
    except PluginError as exc:
        error = exc
    annotated = failure.annotate(error, tmp_path, "loading data")
    assert annotated is error and annotated.exit_code == 2
    log = tmp_path / failure.TRACEBACK_FILE
    assert str(error) == f"hook x of y raised ValueError: deep inside. (phase: loading data; full traceback in {log})"
    assert "deep inside" in log.read_text() and "Traceback (most recent call last)" in log.read_text()
    plain = GrpoError("unknown key 'trl.x'")
    assert str(failure.annotate(plain, tmp_path, "checking the config")) == "unknown key 'trl.x'"  # nothing raised it


def test_an_unexpected_exception_is_one_line_with_its_class(tmp_path: Path) -> None:
    report = failure.unexpected(raised(KeyError("column")), tmp_path, "step 4, reporting (logging, evaluating)")
    assert isinstance(report, UnexpectedFailure) and report.exit_code == EXIT_INTERNAL
    text = str(report)
    assert "\n" not in text and text.startswith("step 4, reporting (logging, evaluating): KeyError: 'column'.")
    assert f"Full traceback: {tmp_path / failure.TRACEBACK_FILE}." in text
    assert isinstance(report.original, KeyError)
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    report = failure.unexpected(raised(MemoryError()), unwritable / "out", None)  # output_dir under a file
    assert report.exit_code == EXIT_OUT_OF_MEMORY and "Full traceback: " in str(report)  # the temporary directory


class FakeTrainer:
    """What the net reads of a trainer: its step, its processes, save()."""

    def __init__(self, step: int, active: bool = False) -> None:
        self.step = step
        self.dist = SimpleNamespace(active=active)
        self.saves: list[int] = []
        self.parts = SimpleNamespace(producer=SimpleNamespace(produce=self.produce), scorer=None, observer=None)

    def produce(self) -> None:
        raise RuntimeError("engine answered garbage")

    def _train_step(self) -> None:
        raise RuntimeError("bad shape")

    def sync_weights(self) -> None:
        raise RuntimeError("sync")

    def save(self) -> Path:
        self.saves.append(self.step)
        return Path(f"out/checkpoint-{self.step}")

    def train(self) -> str:
        return "completed"


def failed(net: SafetyNet, call: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    net.on_failure(info.value)
    return info.value


@pytest.mark.parametrize(
    ("method", "saves"),
    [("produce", True), ("_train_step", False), ("sync_weights", True)],
)
def test_a_checkpoint_is_saved_only_between_steps(tmp_path: Path, method: str, saves: bool) -> None:
    trainer = FakeTrainer(step=5)
    net = SafetyNet(tmp_path)
    net.watch(trainer)
    trainer.step = 7  # two steps trained in this run
    target = trainer.parts.producer.produce if method == "produce" else getattr(trainer, method)
    exc = failed(net, target)
    assert trainer.saves == ([7] if saves else [])
    report = str(net.report(exc))
    if saves:
        assert (
            'Checkpoint of step 7 saved to out/checkpoint-7: resume with resume_from_checkpoint = "out/checkpoint-7"'
            in report
        )
    else:
        assert "step 8, training: RuntimeError: bad shape." in report and "middle of step 8's update" in report


def test_no_checkpoint_twice_nor_before_training_nor_across_processes(tmp_path: Path) -> None:
    trainer = FakeTrainer(step=3)
    net = SafetyNet(tmp_path)
    net.watch(trainer)
    failed(net, trainer.sync_weights)  # nothing trained since the resume at step 3
    assert trainer.saves == [] and "nothing was trained" in net.not_saved
    trainer.step = 4
    trainer.save()  # save_steps saved step 4 (through the watched save)
    failed(net, trainer.sync_weights)
    assert trainer.saves == [4]
    several = FakeTrainer(step=0, active=True)
    net = SafetyNet(tmp_path)
    net.watch(several)
    several.step = 2
    failed(net, several.sync_weights)
    assert several.saves == [] and "several processes" in net.not_saved


def test_every_command_ends_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A bug in a command other than ``run`` (here ``grpo plugins``): one
    line naming the command, exit 70, the traceback in a file."""
    from grpo_core.interface import cli

    def broken() -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "list_plugins", broken)
    assert cli.main(["plugins"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        "error: running `grpo plugins`: ZeroDivisionError: division by zero."
    )
    assert "Traceback" not in err
    log = Path(lines[0].rsplit("Full traceback: ", 1)[1].rstrip("."))
    assert "ZeroDivisionError" in log.read_text()
    log.unlink()


def test_grpo_train_raises_one_grpo_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import grpo_core.training.run as run
    from grpo_core.interface.api import train

    def broken(*args: Any, **kwargs: Any) -> str:
        raise IndexError("list index out of range")

    monkeypatch.setattr(run, "run_training", broken)
    config = {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "output_dir": str(tmp_path / "out")}
    with pytest.raises(UnexpectedFailure) as info:
        train(config, reward_funcs=["think_answer_format"], micro_batch_size=8)
    assert info.value.exit_code == EXIT_INTERNAL and isinstance(info.value.original, IndexError)
    assert str(info.value).startswith("grpo.train: IndexError: list index out of range.")
    assert info.value.__suppress_context__  # printed alone if a script does not catch it

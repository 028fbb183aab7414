"""Exceptions raised on purpose where no message was written for them: each
run ends in one ``error:`` line naming the phase and the exception, the
full traceback in ``output_dir/grpo-error.log`` (its path printed), the exit
code of its class, a checkpoint where the phase allows one, and no traceback
on the terminal.

The faults: an always-on plugin whose ``grpo_step_end`` hook raises, a reward
module that raises while it is imported, a weight sync that raises, a
replay implementation whose ``state_dict()`` raises while a checkpoint is
saved, and an exception inside grpo's own training step (the one place the
fault is patched in, by a driver around the real command line: nothing else
in grpo raises there on purpose). Plugins are a real distribution with real
entry points, put on ``PYTHONPATH`` (tests/plugin_set.py). The tiny model
(tests/tiny_model.py) runs them: the plumbing is the point.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import Runner, assert_clean_failure, populate
from plugin_set import write_distribution

from grpo_core.checkpointing.checkpoint import list_checkpoints, read_checkpoint

PLUGINS = '''
"""Plugins that raise on purpose."""
from pathlib import Path

from grpo_core.plugin_api import hookimpl
from grpo_plugins.replay import SignalReplay
from grpo_plugins.weight_sync_in_process import InProcessSync


class RaisesAtStepEnd:
    def __init__(self, context=None):
        self.armed = Path("step_end.armed").exists()

    @hookimpl
    def grpo_step_end(self, progress, metrics):
        if self.armed and progress.step == 2:
            raise RuntimeError("injected in grpo_step_end")


class SyncRaises(InProcessSync):
    @hookimpl
    def grpo_sync_weights(self, model, version, engine):
        if version == 2:
            raise RuntimeError("injected in the weight sync")
        return super().grpo_sync_weights(model, version, engine)


class StateRaises(SignalReplay):
    saves = 0

    def state_dict(self):
        StateRaises.saves += 1
        if StateRaises.saves == 2:
            raise RuntimeError("injected in state_dict")
        return super().state_dict()
'''
ENTRY_POINTS = """[grpo.plugins]
raises_at_step_end = grpo_faulty_plugins:RaisesAtStepEnd
[grpo.weight_sync]
sync_raises = grpo_faulty_plugins:SyncRaises
[grpo.replay]
state_raises = grpo_faulty_plugins:StateRaises
"""
DRIVER = """
import sys

import grpo_core.training.trainer as trainer

real = trainer.advance_schedule
calls = []


def advance_schedule(scheduler):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("injected in the training step")
    return real(scheduler)


trainer.advance_schedule = advance_schedule
from grpo_core.interface.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir: str) -> str:
    return tiny_model_dir  # the session's (read only): these runs write in their own output_dir


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_distribution(
        tmp_path_factory.mktemp("site"), "grpo_faulty_plugins", PLUGINS, "grpo-faulty-plugins", ENTRY_POINTS
    )


@pytest.fixture()
def net_runner(tmp_path: Path, tiny_dir: str) -> Iterator[Runner]:
    runner = Runner(populate(tmp_path / "work"), tiny_dir)
    yield runner
    runner.close()


def one_line_with_traceback(code: int, output: str, expected_code: int = 2) -> tuple[str, Path]:
    """The run's single error line, and the traceback file it names (which exists)."""
    assert_clean_failure(code, output, expected_code)
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output[-6000:]
    found = re.search(r"(?:full traceback in |Full traceback: |The traceback is in )(\S+grpo-error[^ ]*\.log)", output)
    assert found, output[-3000:]
    path = Path(found.group(1).rstrip(".);"))
    assert path.is_file(), path
    return lines[0], path


def test_a_plugin_hook_that_raises(net_runner: Runner, site: Path) -> None:
    (net_runner.workdir / "step_end.armed").write_text("")
    config = net_runner.config(max_steps=3)
    code, output = net_runner.run(config, env={"PYTHONPATH": str(site)})
    line, traceback_file = one_line_with_traceback(code, output)
    assert "hook grpo_step_end of plugins implementation 'raises_at_step_end'" in line, line
    assert "raised RuntimeError: injected in grpo_step_end" in line, line
    out = net_runner.workdir / "out"
    assert (
        "phase: step 2, between steps" in output and f"Checkpoint of step 2 saved to {out / 'checkpoint-2'}" in output
    )
    assert read_checkpoint(out / "checkpoint-2").trainer_state["step"] == 2  # whole, and it reads back
    assert "injected in grpo_step_end" in traceback_file.read_text() and traceback_file.parent == out


def test_a_reward_module_that_raises_while_imported(net_runner: Runner) -> None:
    source = (
        'raise RuntimeError("injected at import")\n\n\n'
        "def f(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    (net_runner.workdir / "broken_rewards.py").write_text(source)
    code, output = net_runner.run(net_runner.config(trl={"reward_funcs": ["broken_rewards.f"]}))
    line, traceback_file = one_line_with_traceback(code, output)
    assert (
        "reward function 'broken_rewards.f': importing 'broken_rewards' raised RuntimeError: injected at import" in line
    )
    assert "phase: loading the reward functions" in line, line
    text = traceback_file.read_text()
    assert 'raise RuntimeError("injected at import")' in text and "broken_rewards.py" in text
    assert not list_checkpoints(net_runner.workdir / "out")


def test_a_weight_sync_that_raises(net_runner: Runner, site: Path) -> None:
    config = net_runner.config(max_steps=4, plugins={"weight_sync": "sync_raises"})
    code, output = net_runner.run(config, env={"PYTHONPATH": str(site)})
    _, traceback_file = one_line_with_traceback(code, output)
    out = net_runner.workdir / "out"
    assert "hook grpo_sync_weights of weight_sync implementation 'sync_raises'" in output
    step = int(re.search(r"Training stopped at step (\d+); checkpoint saved to", output).group(1))  # policy version 2
    assert f"checkpoint saved to {out / f'checkpoint-{step}'}" in output
    assert f"phase: step {step}, syncing the weights" in output
    assert read_checkpoint(out / f"checkpoint-{step}").trainer_state["step"] == step
    assert "injected in the weight sync" in traceback_file.read_text()


def test_a_checkpoint_save_that_raises_keeps_the_checkpoint_before(net_runner: Runner, site: Path) -> None:
    """The second save fails inside it: no checkpoint-2, no half-written
    folder, checkpoint-1 still whole (its files match its manifest)."""
    config = net_runner.config(max_steps=3, save_steps=1, plugins={"replay": "state_raises"})
    code, output = net_runner.run(config, env={"PYTHONPATH": str(site)})
    line, traceback_file = one_line_with_traceback(code, output)
    out = net_runner.workdir / "out"
    assert "the replay implementation (StateRaises) raised RuntimeError in state_dict()" in line, line
    assert (
        "phase: step 2, saving a checkpoint" in line
        and "No checkpoint was saved (the checkpoint save itself failed)" in line
    )
    assert f"The latest checkpoint is {out / 'checkpoint-1'}" in line, line
    assert list_checkpoints(out) == [out / "checkpoint-1"]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert read_checkpoint(out / "checkpoint-1").notes == []  # every file as its manifest recorded it
    assert "injected in state_dict" in traceback_file.read_text()


def test_an_exception_inside_grpos_own_training_step(net_runner: Runner) -> None:
    """Not a plugin, not user code: what no rule foresaw. Exit 70, the phase
    (step 2, training: no checkpoint of a half-made update), the traceback
    file; step 1's metrics kept."""
    driver = net_runner.workdir / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    config = net_runner.config(max_steps=3, save_steps=2)
    process = net_runner.start(config, argv=[sys.executable, str(driver), "run", str(config)])
    code = process.finish()
    line, traceback_file = one_line_with_traceback(code, process.output, expected_code=70)
    out = net_runner.workdir / "out"
    assert "error: step 2, training: RuntimeError: injected in the training step." in line, line
    assert "No checkpoint was saved (the failure came in the middle of step 2's update" in line, line
    assert "a bug in grpo" in line, line
    assert list_checkpoints(out) == []
    assert "injected in the training step" in traceback_file.read_text()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1

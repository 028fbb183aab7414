"""One way to launch: ``python -m grpo`` is the ``grpo`` command, directly and
under a launcher, and no old module path dies with a traceback.

Real subprocesses and the tiny model (tests/tiny_model.py), one step each:
what is tested is the entry point, not training. ``grpo run
--num-processes`` starts ``accelerate launch ... -m grpo`` itself
(tests/e2e/test_multiprocess.py runs it); test_observability runs ``python -m
grpo run`` on SmolLM2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_workdir
from test_multiprocess import REWARDS, write_config

ROOT = REPO


@pytest.fixture(scope="module")
def workdir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    rows = [{"prompt": f"Item {i}:"} for i in range(4)]
    return run_workdir(tmp_path_factory.mktemp("launch"), rows, {"mp_rewards": REWARDS}), tiny_model_dir


def launch(tmp: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(list(command), cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "launcher",
    [
        [sys.executable, "-m", "grpo"],
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "1", "-m", "grpo"],
    ],
    ids=["python", "torchrun"],
)
def test_python_m_grpo_run_trains(workdir: tuple[Path, str], launcher: list[str]) -> None:
    tmp, model = workdir
    name = Path(launcher[0]).name
    config = write_config(tmp, name, model, max_steps=1)
    done = launch(tmp, *launcher, "run", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert steps(tmp / name) == [1]


def test_help_lists_the_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "grpo", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "run" in done.stdout and "config" in done.stdout


def test_an_old_module_path_says_so_without_a_traceback(tmp_path: Path) -> None:
    """``python -m grpo_core.cli run`` (the README's line before the modules
    moved into layer folders) is one line from Python, exit 1."""
    done = launch(tmp_path, sys.executable, "-m", "grpo_core.cli", "run", "config.toml")
    assert done.returncode == 1 and "No module named grpo_core.cli" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout

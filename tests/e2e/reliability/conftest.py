"""Fixtures of the reliability tests (the harness is in ``fault_harness.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import Runner, populate


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    """A working directory with ``faulty_rewards.py`` and ``train.jsonl``."""
    return populate(tmp_path / "work")


@pytest.fixture()
def run_model(tiny_model_dir: str) -> str:
    """The model the runs train: the tiny one (tests/tiny_model.py), since a
    fault's handling is plumbing, not learning. A module whose runs talk to
    the session's vLLM server overrides it with ``smollm2_dir`` (the server
    serves SmolLM2, so a LoRA of another model cannot load there)."""
    return tiny_model_dir


@pytest.fixture()
def runner(workdir: Path, run_model: str) -> Iterator[Runner]:
    """Starts ``grpo run`` processes in ``workdir``; kills leftovers at the end."""
    runs = Runner(workdir, run_model)
    yield runs
    runs.close()

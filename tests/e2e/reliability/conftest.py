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
def runner(workdir: Path, smollm2_dir: str) -> Iterator[Runner]:
    """Starts ``grpo run`` processes in ``workdir``; kills leftovers at the end."""
    runs = Runner(workdir, smollm2_dir)
    yield runs
    runs.close()

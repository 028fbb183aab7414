"""The tree passes ruff: ``ruff check`` and ``ruff format --check`` (configured in pyproject.toml).

CI runs ``pytest tests``, so this test is what makes CI fail on a lint or format violation.
ruff is pinned in the ``test`` extra: another version formats a few constructs differently, so
a failure names the version that ran. Both commands take well under a second on the whole tree.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from helpers import REPO

ROOT = REPO
FIX = "run `ruff format . && ruff check .` in the repository root (CONTRIBUTING.md, 'Style')"


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def ruff_version() -> str:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: it is in the test extra (pip install -e '.[test]')")
    return _ruff("--version").stdout.strip()


def test_ruff_check_passes(ruff_version: str) -> None:
    result = _ruff("check", "--output-format", "concise")
    assert result.returncode == 0, f"{ruff_version}: `ruff check .` failed; {FIX}.\n{result.stdout}{result.stderr}"


def test_ruff_format_check_passes(ruff_version: str) -> None:
    result = _ruff("format", "--check")
    assert result.returncode == 0, (
        f"{ruff_version}: `ruff format --check .` would reformat files; {FIX}.\n{result.stdout}{result.stderr}"
    )

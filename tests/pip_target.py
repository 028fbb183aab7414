"""Installing a plugin package the way a user would (pip), into a private
folder, so the shared test environment stays clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def install_into_target(package: Path, root: Path) -> Path:
    """``pip install`` ``package`` into ``root/site`` (built from a copy, so
    no build/ or egg-info lands in the repository); returns the site folder
    to put on ``PYTHONPATH``."""
    source = root / "src"
    shutil.copytree(package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return site

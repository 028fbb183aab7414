"""A chosen set of plugins, whatever else is installed in the environment.

Tests that count plugins ("rank is not there", "the available names are
normalize_then_sum, sum_then_normalize") must not depend on what a developer
happened to ``pip install`` into the venv (the example package's README tells
them to install it). These helpers hide every distribution that publishes a
``grpo.*`` entry point except grpo itself and those found in the given site
folders; distributions publishing no grpo entry point (torch, pytest, ...)
stay visible. Nothing is mocked: the index is built from the real metadata of
the real distributions that remain.

* In this process: ``with only_plugins_from(site): ...``.
* In a ``grpo`` subprocess: run this file as the program
  (``python -P tests/plugin_set.py ARGS``) with :data:`SITES_ENV` naming the
  sites; it installs the same filter, then runs grpo's command line.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SITES_ENV = "GRPO_TEST_PLUGIN_SITES"
PROGRAM = Path(__file__).resolve()
GROUP_PREFIX = "grpo."  # the entry point groups grpo reads (grpo_core.host.plugin_host.GROUP_PREFIX)
OWN_DIST = "grpo"


def _publishes_plugins(dist: importlib.metadata.Distribution) -> bool:
    return any(ep.group.startswith(GROUP_PREFIX) for ep in dist.entry_points)


def _inside(dist: importlib.metadata.Distribution, sites: Sequence[Path]) -> bool:
    where = Path(str(dist.locate_file(""))).resolve()
    return any(where == site or site in where.parents for site in sites)


def write_distribution(site: Path, module: str, source: str, dist: str, entry_points: str) -> Path:
    """Install ``source`` as ``site/<module>.py`` with a real ``.dist-info``
    (``dist`` 0.1, ``entry_points``: an ``entry_points.txt`` body) into the
    folder ``site`` (made if missing): a plugin package as pip would leave
    it, for a test to put on ``sys.path``. Returns ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source, encoding="utf-8")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    return site


def filtered(
    real: Callable[..., Iterable[importlib.metadata.Distribution]], sites: Sequence[Path]
) -> Callable[..., Iterator[importlib.metadata.Distribution]]:
    """``importlib.metadata.distributions`` limited to grpo's own plugins and
    those installed in ``sites``."""
    resolved = [Path(s).resolve() for s in sites]

    def distributions(**kwargs: Any) -> Iterator[importlib.metadata.Distribution]:
        for dist in real(**kwargs):
            name = (dist.metadata["Name"] or "").lower()
            if not _publishes_plugins(dist) or name == OWN_DIST or _inside(dist, resolved):
                yield dist

    return distributions


@contextmanager
def only_plugins_from(*sites: Path) -> Iterator[None]:
    """In this process, see only grpo's own plugins and those in ``sites``
    (which the caller puts on ``sys.path``); restored afterwards."""
    from grpo_core.host import plugin_host

    real = importlib.metadata.distributions
    importlib.metadata.distributions = filtered(real, sites)  # type: ignore[assignment]
    plugin_host.rescan()
    try:
        yield
    finally:
        importlib.metadata.distributions = real  # type: ignore[assignment]
        plugin_host.rescan()


def subprocess_command(args: Sequence[str]) -> list[str]:
    """The command line running ``grpo ARGS`` under the filter (set
    :data:`SITES_ENV` in its environment, ``os.pathsep``-separated)."""
    return [sys.executable, "-P", str(PROGRAM), *args]


def main() -> int:
    sites = [Path(p) for p in os.environ.get(SITES_ENV, "").split(os.pathsep) if p]
    importlib.metadata.distributions = filtered(importlib.metadata.distributions, sites)  # type: ignore[assignment]
    from grpo_core.interface.cli import main as grpo_main

    return grpo_main()


if __name__ == "__main__":
    raise SystemExit(main())


def failing_sync_source(version: int) -> str:
    """Source of a weight sync plugin module whose class ``FailsAt`` syncs
    every policy version but ``version``, where it raises as an engine lost
    mid-load does (tests of what a failed sync leaves behind)."""
    return f'''
from grpo_core.plugin_api import SAMPLES_TRAINER_MODEL, SyncResult, hookimpl


class FailsAt:
    """A sync that works, except for policy version {version}."""

    required_capabilities = frozenset({{SAMPLES_TRAINER_MODEL}})

    def __init__(self, context):
        self.context = context

    @hookimpl
    def grpo_sync_weights(self, model, version, engine):
        if version == {version}:
            raise RuntimeError("the engine went away while loading version {version}")
        return SyncResult(version=version, seconds=0.0, detail="test")
'''

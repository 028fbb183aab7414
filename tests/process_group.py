"""The processes of a process group, read from /proc: a vLLM server's API
process and its engine core and worker share the group its launcher made."""

from __future__ import annotations

import os
from pathlib import Path


def _stats(pgid: int) -> list[tuple[int, list[str]]]:
    """``(pid, the stat fields after the command name)`` of each live process of group ``pgid``."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append((int(stat_file.parent.name), fields))
    return found


def process_group(pgid: int) -> list[int]:
    """Every live process of group ``pgid``."""
    return [pid for pid, _ in _stats(pgid)]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds used so far by the live processes of group ``pgid``."""
    return sum(int(fields[11]) + int(fields[12]) for _, fields in _stats(pgid)) / os.sysconf("SC_CLK_TCK")

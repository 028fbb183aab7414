"""What the machine was doing while a benchmark's run ran (for bench_turn_credit.py and bench_inflight.py).

On a machine shared with other developers' work, a run's wall time says as much about the others as
about the run. :class:`RunMeter` records, around one child process, its wall seconds, the CPU seconds
it and its children used (``RUSAGE_CHILDREN``: the trainer, the vLLM server and its engine), the CPU
seconds the whole machine was busy (``/proc/stat``), so the CPU seconds *others* took meanwhile, the
hypervisor's steal, and the load average at both ends.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def cpu_description() -> dict[str, Any]:
    """The CPU's model and its vector/matrix flags (they decide bf16 against float32 speed here)."""
    if platform.system() != "Linux":
        return {"model": platform.processor(), "flags": [], "cores": os.cpu_count()}
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags"))
    return {"model": model, "flags": sorted(f for f in flags if f.startswith(("avx", "amx"))), "cores": os.cpu_count()}


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) jiffies of every CPU since boot; busy includes steal."""
    if platform.system() != "Linux":
        return 0, 0
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, steal


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metered_run(
    argv: list[str], output_dir: Path, cwd: Path, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one ``grpo run`` (``argv``) to its end under a :class:`RunMeter`:
    the records of its ``output_dir/metrics.jsonl`` and the meter's record."""
    with RunMeter() as meter:
        subprocess.run(argv, check=True, env=env, cwd=cwd)  # noqa: S603
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return records, meter.record


class RunMeter:
    """``with RunMeter() as meter: subprocess.run(...)``; then ``meter.record``."""

    def __enter__(self) -> RunMeter:
        self.started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.load_before = os.getloadavg()
        self._ticks = _machine_ticks()
        self._cpu = _children_cpu()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        own = _children_cpu() - self._cpu
        busy, steal = (now - before for now, before in zip(_machine_ticks(), self._ticks, strict=True))
        self.record = {
            "started_at": self.started_at,
            "wall_seconds": wall,
            "run_cpu_seconds": own,  # the run's processes (waited for), all of them
            "machine_busy_cpu_seconds": busy / TICK,
            "others_cpu_seconds": max(0.0, busy / TICK - own),  # what other work took meanwhile
            "others_cores_mean": max(0.0, busy / TICK - own) / wall if wall > 0 else 0.0,
            "steal_seconds": steal / TICK,
            "load_average_before": list(self.load_before),
            "load_average_after": list(os.getloadavg()),
        }

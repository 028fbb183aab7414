"""Freed memory kept for reuse while a run trains (grpo_core.runtime.heap,
``reuse_freed_memory``): the calls made to the C library, the choice of
'auto', page faults in a real process with and without it, and a real run."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_workdir

from grpo_core.config.loader import validate
from grpo_core.runtime import heap
from grpo_core.runtime.heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, TRIM_DEFAULT, TRIM_NEVER, RetainedHeap

ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class RecordingLibc:
    """mallopt/malloc_trim as glibc answers them, recorded; ``refuse``: mmap thresholds it refuses."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 0 if param == M_MMAP_THRESHOLD and value in self.refuse else 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_the_run_raises_both_thresholds_and_hands_back_on_leaving() -> None:
    libc = RecordingLibc()
    with RetainedHeap(True, libc) as retained:
        assert retained.mmap_threshold == 1 << 30
        assert libc.calls == [("mallopt", M_MMAP_THRESHOLD, 1 << 30), ("mallopt", M_TRIM_THRESHOLD, TRIM_NEVER)]
    assert libc.calls[2:] == [("mallopt", M_TRIM_THRESHOLD, TRIM_DEFAULT), ("malloc_trim", 0)]


def test_a_glibc_that_caps_the_mmap_threshold_gets_its_largest() -> None:
    libc = RecordingLibc(refuse=(1 << 30,))
    with RetainedHeap(True, libc) as retained:
        assert retained.mmap_threshold == 32 << 20
    assert ("mallopt", M_TRIM_THRESHOLD, TRIM_NEVER) in libc.calls


def test_nothing_changes_when_refused_disabled_or_not_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = RecordingLibc(refuse=heap.MMAP_THRESHOLDS)
    with RetainedHeap(True, refusing) as retained:
        assert retained.mmap_threshold is None
    assert all(call[1] == M_MMAP_THRESHOLD for call in refusing.calls)  # no trim threshold, no trim on leaving

    untouched = RecordingLibc()
    with RetainedHeap(False, untouched) as retained:
        assert retained.mmap_threshold is None
    assert untouched.calls == []

    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert heap.glibc() is None
    with RetainedHeap(True) as retained:
        assert retained.mmap_threshold is None


@pytest.mark.parametrize(
    ("setting", "cuda", "expected"),
    [
        ("auto", False, True),
        ("auto", True, False),
        (True, True, True),
        (False, False, False),
    ],
)
def test_auto_keeps_freed_memory_where_the_trainer_computes_on_a_cpu(
    monkeypatch: pytest.MonkeyPatch, setting, cuda: bool, expected: bool
) -> None:
    from grpo_core.training import run

    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: cuda)  # no GPU here: the answer is faked
    cfg = validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}], "reuse_freed_memory": setting})
    assert run.retains_freed_memory(cfg) is expected


def test_a_bad_value_names_the_key() -> None:
    from grpo_core.contract.errors import ConfigError

    with pytest.raises(ConfigError, match="reuse_freed_memory"):
        validate({"base_model": "m", "datasets": [{"path": "d.jsonl"}], "reuse_freed_memory": "sometimes"})


def churn_faults(rounds: int = 24, elements: int = 10 << 20) -> list[int]:
    """Minor page faults of each of ``rounds`` rounds that allocate a buffer (40 MiB of float32 by
    default, as a step's large buffers), touch it and free it."""
    import resource

    import torch

    counts = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty(elements)
        buffer.fill_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del buffer
    return counts


CHURN = textwrap.dedent(f"""
    import json, sys
    sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}, {str(Path(__file__).resolve().parents[1])!r}]
    from grpo_core.runtime.heap import RetainedHeap
    from test_heap import churn_faults

    with RetainedHeap(sys.argv[1] == "on") as retained:
        print(json.dumps({{"threshold": retained.mmap_threshold, "faults": churn_faults()}}))
""")


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's malloc is what this changes")
def test_page_faults_stop_once_freed_buffers_are_kept(tmp_path: Path) -> None:
    """Real processes (the setting is process-wide): a 40 MiB buffer allocated,
    touched and freed over and over faults in every page each time by default,
    and not at all once the first rounds have grown the heap."""
    script = tmp_path / "churn.py"
    script.write_text(CHURN)
    results = {}
    for mode in ("off", "on"):
        done = subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=120, check=True
        )
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    pages = (40 << 20) // 4096
    assert results["off"]["threshold"] is None
    assert all(count >= pages * 0.9 for count in results["off"]["faults"]), results
    assert results["on"]["threshold"] == 1 << 30
    assert sum(results["on"]["faults"][-3:]) < pages * 0.05, results


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's malloc is what this changes")
def test_a_real_run_keeps_freed_memory_while_it_trains(
    tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_training
    import torch

    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.plugin_api import hookimpl
    from grpo_core.training.run import run_training

    seen: list[int] = []

    class Churn:
        @hookimpl
        def grpo_step_end(self, progress, metrics) -> None:
            seen.extend(churn_faults())

    monkeypatch.chdir(tmp_path)  # the same tiny run as test_training's
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a + 1}?"}]} for a in range(1, 9)]
    run_workdir(tmp_path, rows, {"tiny_rewards": test_training.REWARDS}, monkeypatch)
    host = PluginHost()
    host.pm.register(Churn(), name="test.churn")
    cfg = validate(test_training.tiny_config(tmp_path, tiny_model_dir, max_steps=1))
    assert cfg.reuse_freed_memory == "auto" and not torch.cuda.is_available()
    assert run_training(cfg, host) == "completed"
    assert len(seen) == 24 and sum(seen[-3:]) < (40 << 20) // 4096 * 0.05, seen

"""Separate cores for a managed vLLM server's engine and the trainer under
``async_prefetch``: the plan, the server's environment, and the trainer's own
threads. The core sets are faked (never this machine's); the confinement is
checked in a child process so this one keeps its cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo_core.contract.errors import ConfigError
from grpo_plugins.vllm.command_line import managed_spec
from grpo_plugins.vllm.cpus import parse_cpu_list, plan_cpu_split

TWO = frozenset({0, 1})
EIGHT = frozenset(range(8))


@pytest.fixture
def cfg(smollm2_dir, tmp_path, config_for):
    return config_for(smollm2_dir, tmp_path, async_prefetch=True)


def test_async_prefetch_splits_the_cores_in_half(cfg) -> None:
    split = plan_cpu_split(cfg, TWO, cuda=False)
    assert split is not None and split.engine == {0} and split.trainer == {1}
    split = plan_cpu_split(cfg, EIGHT, cuda=False)
    assert split.engine == {0, 1, 2, 3} and split.trainer == {4, 5, 6, 7}
    # an affinity mask that is not 0..n-1 (taskset, a cgroup) is split as given
    split = plan_cpu_split(cfg, frozenset({3, 5, 9}), cuda=False)
    assert split.engine == {3} and split.trainer == {5, 9}


def test_no_split_where_it_cannot_pay(cfg) -> None:
    assert plan_cpu_split(cfg, frozenset({0}), cuda=False) is None  # one core: nothing to split
    assert plan_cpu_split(cfg, EIGHT, cuda=True) is None  # a GPU engine computes elsewhere
    cfg.vllm.engine_cpus = "all"
    assert plan_cpu_split(cfg, EIGHT, cuda=False) is None
    cfg.vllm.engine_cpus = None
    cfg.trl.async_prefetch = False  # each side idles while the other computes: both want every core
    assert plan_cpu_split(cfg, EIGHT, cuda=False) is None


def test_engine_cpus_names_the_engine_cores(cfg) -> None:
    cfg.vllm.engine_cpus = "2-3,6"
    split = plan_cpu_split(cfg, EIGHT, cuda=False)
    assert split.engine == {2, 3, 6} and split.trainer == {0, 1, 4, 5, 7}
    for bad, words in (("0-7", "leaves the trainer no core"), ("7-9", "cannot use (8,9)"), ("two", "core ids like")):
        cfg.vllm.engine_cpus = bad
        with pytest.raises(ConfigError, match="vllm.engine_cpus") as err:
            plan_cpu_split(cfg, EIGHT, cuda=False)
        assert words in str(err.value)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,5, 7") == [0, 1, 2, 5, 7]
    for bad in ("", "3-1", "a", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_managed_server_is_bound_to_the_engine_cores(cfg, monkeypatch) -> None:
    monkeypatch.setattr("grpo_plugins.vllm.command_line.process_cpus", lambda: EIGHT)
    monkeypatch.setattr("grpo_plugins.vllm.machine.cuda_available", lambda: False)
    spec = managed_spec(cfg)
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3" and spec.engine_cpus == {0, 1, 2, 3}
    assert spec.spawn_cpus == EIGHT  # a restart starts from grpo's own mask, not the trainer's
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in spec.env
    spec.remove_private_socket_dir()  # made for a server this test never starts
    cfg.trl.async_prefetch = False
    spec = managed_spec(cfg)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env and spec.engine_cpus is None
    assert spec.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # synchronous: the engine gets every core
    spec.remove_private_socket_dir()  # made for a server this test never starts


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to split")
def test_trainer_threads_leave_the_engine_cores() -> None:
    """Every thread of the trainer, the ones already running and the ones
    started afterwards, runs only on the cores the engine does not use, and
    torch's pool is sized to them."""
    code = textwrap.dedent("""
        import json, os, threading, torch
        from grpo_core.runtime.cpu_affinity import keep_off_engine_cores
        usable = sorted(os.sched_getaffinity(0))
        engine = frozenset(usable[:1])
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        applied = keep_off_engine_cores(engine)
        threading.Thread(target=stop.wait, daemon=True).start()
        masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
        print(json.dumps({"applied": sorted(applied), "expected": sorted(set(usable) - engine),
                          "threads": torch.get_num_threads(), "masks": masks}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["applied"] == report["expected"] and report["threads"] == len(report["expected"])
    assert len(report["masks"]) >= 3 and all(mask == report["expected"] for mask in report["masks"]), report

"""No automatic garbage collection while a run starts, the heap frozen for
the engine's start and the training loop, everything as it was afterwards
(grpo_core.runtime.collector): the collector itself, and a real run."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from helpers import run_workdir

from grpo_core.runtime.collector import StartupCollector


@pytest.fixture(autouse=True)
def collector_restored():
    """Each test leaves Python's collector as it found it, whatever it asserts."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def test_start_up_runs_without_automatic_collection_and_ends_as_found() -> None:
    gc.enable()
    gc.unfreeze()
    with StartupCollector() as collector:
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]  # objects of the start-up that live for the run
        collector.settle()
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        assert not gc.isenabled()  # still starting: the engine loads next
        collector.started()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_turned_off_by_the_caller_stays_off() -> None:
    gc.disable()
    with StartupCollector() as collector:
        collector.started()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_a_failed_start_unfreezes_and_restores() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="engine"):
        with StartupCollector() as collector:
            collector.settle()
            raise RuntimeError("the engine did not start")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_cyclic_garbage_of_the_training_loop_is_still_collected() -> None:
    gc.enable()
    with StartupCollector() as collector:
        collector.started()
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # made after the freeze: collected as usual


def test_a_real_run_starts_without_collections_and_trains_with_them(
    tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_training

    from grpo_core.config.loader import validate
    from grpo_core.host.plugin_host import PluginHost
    from grpo_core.plugin_api import hookimpl
    from grpo_core.training.run import run_training

    seen: dict[str, tuple[bool, int]] = {}

    class Watch:
        @hookimpl
        def grpo_train_start(self, context) -> None:
            seen["engine start"] = (gc.isenabled(), gc.get_freeze_count())

        @hookimpl
        def grpo_step_end(self, progress, metrics) -> None:
            seen["step"] = (gc.isenabled(), gc.get_freeze_count())

    monkeypatch.chdir(tmp_path)  # the same tiny run as test_training's
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a + 1}?"}]} for a in range(1, 9)]
    run_workdir(tmp_path, rows, {"tiny_rewards": test_training.REWARDS}, monkeypatch)
    gc.enable()
    host = PluginHost()
    host.pm.register(Watch(), name="test.watch")
    assert run_training(validate(test_training.tiny_config(tmp_path, tiny_model_dir, max_steps=1)), host) == "completed"
    enabled, frozen = seen["engine start"]
    assert not enabled and frozen > 100_000  # torch, transformers and the model: out of every scan
    enabled, frozen = seen["step"]
    assert enabled and frozen > 100_000  # (a frozen object that dies leaves the count)
    assert gc.isenabled() and gc.get_freeze_count() == 0

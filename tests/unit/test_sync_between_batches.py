"""Plain ``async_prefetch``: a weight sync's load waits for the batch the
producer thread is making (grpo_core/sync/between_batches.py), so every
batch is sampled by the one version it is labelled with. The real thread
and PolicySync; the engine is a stand-in that records which weights it
held when a batch started and ended (the real server: tests/e2e/vllm/test_async_sync_order.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from grpo_core.contract.types import TrainingProgress
from grpo_core.generation.producer import PrefetchingProducer, ScoredBatch
from grpo_core.sync.policy_sync import PolicySync

GENERATION_S = 0.4


class Engine:
    def __init__(self) -> None:
        self.weights = 0  # the version the engine samples from
        self.loaded_at: list[float] = []

    def load_adapter(self, version: int) -> None:
        self.weights = version
        self.loaded_at.append(time.monotonic())

    def control_endpoints(self) -> list[Engine]:
        return [self]


class Batches:
    """Stands in for RolloutProducer: labels a batch with the version it was
    told of last, and records the engine's weights when it starts and ends."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.version = engine, 0
        self.finished_at: list[float] = []

    def weights_synced(self, version: int) -> None:
        self.version = version

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        label, start = self.version, self.engine.weights
        time.sleep(GENERATION_S)
        self.finished_at.append(time.monotonic())
        return ScoredBatch(groups=[], policy_version=label, metrics={"start": start, "end": self.engine.weights})

    def prefetched(self) -> list[ScoredBatch]:
        return []


def syncer(engine: Engine | None, producer: PrefetchingProducer, load, prepared: list[float]) -> PolicySync:
    def grpo_sync_weights(model, version, engine):
        prepared.append(time.monotonic())  # merging, writing files: overlaps the batch being made
        load(engine, version)

    return PolicySync(
        SimpleNamespace(grpo_sync_weights=grpo_sync_weights),
        engine,
        backend=SimpleNamespace(full_model=lambda version: "model"),
        dist=SimpleNamespace(is_main=True, active=False),
        producer=producer,
        verifier=SimpleNamespace(sync=lambda run, model, version: run()),
    )


def through_load_adapter(engine, version) -> None:
    engine.load_adapter(version)


def through_control_endpoints(engine, version) -> None:
    (server,) = engine.control_endpoints()  # a sync that drives the server itself (nccl)
    time.sleep(0.05)
    server.weights = version


@pytest.mark.parametrize("load", [through_load_adapter, through_control_endpoints])
def test_the_load_waits_for_the_batch_being_made_and_the_next_batch_has_the_new_version(load) -> None:
    engine = Engine()
    batches = Batches(engine)
    prefetch = PrefetchingProducer(batches, 1, steps_per_batch=1, max_steps=10)
    prepared: list[float] = []
    sync = syncer(engine, prefetch, load, prepared)
    try:
        prefetch.start(0)
        time.sleep(GENERATION_S / 4)  # batch 0 is being made
        sync.sync(1)  # the trainer's sync after step 1
        first = prefetch.produce(TrainingProgress(0, 10))
        second = prefetch.produce(TrainingProgress(1, 10))
    finally:
        prefetch.close()
    # one mutation: the load lands in the middle of batch 0, which then ends on version 1 (its "end" is 1)
    assert (first.policy_version, first.metrics) == (0, {"start": 0, "end": 0})
    assert (second.policy_version, second.metrics) == (1, {"start": 1, "end": 1})
    assert prepared[0] < batches.finished_at[0]  # the sync's own work did not wait
    if engine.loaded_at:
        assert engine.loaded_at[0] >= batches.finished_at[0]


def test_a_sync_without_an_engine_waits_for_the_batch_whole() -> None:
    engine = Engine()  # the weights change behind the sync's back (no engine handle)
    batches = Batches(engine)
    prefetch = PrefetchingProducer(batches, 1, steps_per_batch=1, max_steps=10)
    prepared: list[float] = []
    sync = syncer(None, prefetch, lambda _, version: setattr(engine, "weights", version), prepared)
    try:
        prefetch.start(0)
        time.sleep(GENERATION_S / 4)
        sync.sync(1)
        first = prefetch.produce(TrainingProgress(0, 10))
        second = prefetch.produce(TrainingProgress(1, 10))
    finally:
        prefetch.close()
    assert (first.policy_version, first.metrics) == (0, {"start": 0, "end": 0})
    assert (second.policy_version, second.metrics) == (1, {"start": 1, "end": 1})
    assert prepared[0] >= batches.finished_at[0]


def test_a_failed_load_leaves_the_version_and_releases_the_thread() -> None:
    engine = Engine()
    batches = Batches(engine)
    prefetch = PrefetchingProducer(batches, 1, steps_per_batch=1, max_steps=10)

    def fails(engine, version) -> None:
        engine.load_adapter(version)
        raise OSError("disk full")

    sync = syncer(engine, prefetch, fails, [])
    try:
        prefetch.start(0)
        with pytest.raises(OSError, match="disk full"):
            sync.sync(1)
        assert batches.version == 0 and sync.last_version == -1
        done = threading.Event()
        threading.Thread(target=lambda: (prefetch.produce(TrainingProgress(0, 10)), done.set()), daemon=True).start()
        assert done.wait(5), "the producer thread stayed paused after the failed sync"
    finally:
        prefetch.close()

"""Scheduling of the producer side: prefetch depth bounds staleness, errors
in the background thread reach the trainer, the prompt stream resumes."""

from __future__ import annotations

import threading
import time

import pytest

from grpo_core.contract.types import Prompt, TrainingProgress
from grpo_core.generation.producer import PrefetchingProducer, PromptStream, ScoredBatch


class VersionStampingProducer:
    """Stands in for RolloutProducer: stamps each batch with the policy
    version current when generation *started* (as the real one does)."""

    def __init__(self, fail_at: int | None = None, seconds: float = 0.01) -> None:
        self.version = 0
        self.lock = threading.Lock()
        self.calls = 0
        self.fail_at = fail_at
        self.seconds = seconds

    def produce(self, progress: TrainingProgress) -> ScoredBatch:
        with self.lock:
            version = self.version
            self.calls += 1
            if self.fail_at is not None and self.calls == self.fail_at:
                raise RuntimeError("engine exploded")
        time.sleep(self.seconds)  # generation takes a while
        return ScoredBatch(groups=[], policy_version=version, metrics={"call": float(self.calls)})

    def prefetched(self) -> list[ScoredBatch]:
        return []


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_depth_bounds_staleness(depth: int) -> None:
    inner = VersionStampingProducer()
    prefetch = PrefetchingProducer(inner, depth, steps_per_batch=1, max_steps=10)
    stalest = 0
    try:
        for step in range(8):
            batch = prefetch.produce(TrainingProgress(step, 8))
            time.sleep(0.05)  # training is slower than generation: the thread runs ahead
            stalest = max(stalest, inner.version - batch.policy_version)
            with inner.lock:
                inner.version += 1  # optimizer step + weight sync
    finally:
        prefetch.close()
    assert stalest == depth  # it really ran ahead, and never further than depth
    assert inner.calls <= 8 + depth


def test_a_checkpoint_waits_for_the_batch_being_made() -> None:
    """Inside ``paused()`` no batch is half made: the one in progress when
    a checkpoint starts is finished and listed, and none starts meanwhile."""
    inner = VersionStampingProducer(seconds=0.3)
    prefetch = PrefetchingProducer(inner, 2, steps_per_batch=1, max_steps=10)
    try:
        prefetch.produce(TrainingProgress(0, 5))  # the thread starts the second batch now
        time.sleep(0.05)
        with prefetch.paused():
            made = prefetch.prefetched()
            time.sleep(0.4)  # a slot is free for a third batch, which waits for the checkpoint
            assert inner.calls == 2
        assert [b.metrics["call"] for b in made] == [2.0]
        assert prefetch.produce(TrainingProgress(1, 5)).metrics["call"] == 2.0
    finally:
        prefetch.close()


def test_errors_in_the_thread_reach_the_trainer() -> None:
    prefetch = PrefetchingProducer(VersionStampingProducer(fail_at=2), 1, steps_per_batch=1, max_steps=10)
    try:
        prefetch.produce(TrainingProgress(0, 5))
        with pytest.raises(RuntimeError, match="engine exploded"):
            prefetch.produce(TrainingProgress(1, 5))
    finally:
        prefetch.close()


def test_prompt_stream_resumes_where_it_stopped() -> None:
    prompts = [Prompt(prompt=str(i), prompt_ids=[i]) for i in range(5)]
    a = PromptStream(prompts, seed=3, shuffle=True)
    first = [p.prompt for p in a.take(7)]  # crosses an epoch boundary
    state = a.state_dict()
    rest = [p.prompt for p in a.take(6)]
    b = PromptStream(prompts, seed=3, shuffle=True)
    b.load_state_dict(state)
    assert [p.prompt for p in b.take(6)] == rest
    assert sorted(first[:5]) == [str(i) for i in range(5)]  # each epoch is a permutation


def test_sampling_options_reach_the_engine_fields() -> None:
    """trl.top_p / min_p / repetition_penalty / top_k go from the config into
    what vLLM is asked for (their effect on real sampling:
    tests/e2e/vllm/test_vllm_server.py::test_sampling_settings_reach_the_server)."""
    from grpo_core.config.loader import validate
    from grpo_core.generation.producer import sampling_from_config
    from grpo_plugins.vllm.sampling import sampling_fields

    cfg = validate(
        {
            "base_model": "unused/model",
            "trl": {
                "reward_funcs": ["x.y"],
                "top_p": 0.9,
                "min_p": 0.05,
                "repetition_penalty": 1.3,
                "top_k": 20,
                "temperature": 0.7,
            },
        }
    )
    fields = sampling_fields(sampling_from_config(cfg, [2]), n=4, call_index=0)
    assert {k: fields[k] for k in ("top_p", "min_p", "repetition_penalty", "top_k", "temperature", "n")} == {
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.3,
        "top_k": 20,
        "temperature": 0.7,
        "n": 4,
    }
    assert fields["stop_token_ids"] == [2]

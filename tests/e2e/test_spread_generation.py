"""Generation spread over the training processes (grpo_core.generation.spread),
in two real processes joined over gloo, with the real ScatteringProducer on each.

Only the rollout is a stand-in (it records what it was asked and may fail on
one rank); the producer, the collectives and the error path are the run's
own. The two-process FSDP/ZeRO-3/DDP runs of tests/e2e/test_multiprocess.py
cover the same path with the real transformers rollout and backends.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
from pathlib import Path
from typing import Any

import pytest

TIMEOUT = 120


class Rollout:
    """Returns, for each prompt, completions whose ids say who sampled them
    and where: [rank, prompt index in the whole call, generation]."""

    def __init__(self, rank: int, sampled: Any, fail_on: int | None) -> None:
        self.rank, self.sampled, self.fail_on = rank, sampled, fail_on
        self.calls: list[tuple[list[int], int, str]] = []

    def grpo_rollout_generate(self, prompts, num_generations, sampling, policy_version):
        from grpo_core.contract.errors import PluginError
        from grpo_core.contract.types import Completion, RolloutGroup

        self.calls.append(([p.index for p in prompts], sampling.prompt_offset, self.sampled()))
        if self.rank == self.fail_on:
            raise PluginError(f"test: rank {self.rank} cannot generate")
        return [
            RolloutGroup(
                p,
                [
                    Completion([self.rank, sampling.prompt_offset + i, g], "", None, False)
                    for g in range(num_generations)
                ],
                policy_version,
            )
            for i, p in enumerate(prompts)
        ]


class Producer:
    """Rank 0's inner producer: two generation calls per batch (as an episode's turns make),
    3 prompts then 1, through the spread relay it is given as its hook."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def produce(self, progress: Any) -> Any:
        from grpo_core.contract.types import Prompt, SamplingSettings, ScoredGroup
        from grpo_core.generation.producer import ScoredBatch

        sampling = SamplingSettings(max_tokens=4, seed=1)
        first = self.hook.grpo_rollout_generate(
            prompts=[Prompt(f"p{i}", [i], {}, i) for i in range(4)],
            num_generations=2,
            sampling=sampling,
            policy_version=3,
        )
        second = self.hook.grpo_rollout_generate(
            prompts=[Prompt("q", [9], {}, 9)], num_generations=2, sampling=sampling, policy_version=3
        )
        groups = [first[2], second[0]]  # 2 groups: one per rank
        return ScoredBatch([ScoredGroup(g, [[0.0], [1.0]], [0.0, 0.0]) for g in groups], 3, {"reward": 0.5})


def _process(rank: int, rendezvous: str, fail_on: int | None, out: Any) -> None:
    import torch.distributed

    from grpo_core.contract.types import TrainingProgress
    from grpo_core.generation.producer import ScatteringProducer
    from grpo_core.generation.spread import SampledModel, SpreadGeneration
    from grpo_core.runtime.distributed import Distributed

    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dist = Distributed(rank, 2)
    entered: list[str] = []

    @contextlib.contextmanager
    def generation_model():  # a collective on entry, as FSDP's unshard is
        torch.distributed.barrier()
        entered.append("in")
        try:
            yield f"whole policy on rank {rank}"
        finally:
            entered.append("out")

    sampled = SampledModel(lambda: f"rank 0's copy (asked on rank {rank})")
    rollout = Rollout(rank, sampled, fail_on)
    spread = SpreadGeneration(rollout, dist, generation_model, sampled, log=lambda line: None)
    producer = ScatteringProducer(Producer(spread) if rank == 0 else None, dist, spread)
    result: dict[str, Any] = {"rank": rank}
    try:
        batch = producer.produce(TrainingProgress(0, 1))
        result["batch"] = {
            "tokens": [[c.token_ids for c in s.group.completions] for s in batch.groups],
            "metrics": batch.metrics,
        }
    except Exception as exc:
        result["error"] = (type(exc).__name__, str(exc))
    finally:
        result["calls"] = rollout.calls
        result["entered"] = entered
        result["alone"] = sampled()  # outside a spread call: the model for sampling alone
        out.put(result)
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()


def run_two(tmp_path: Path, fail_on: int | None) -> dict[int, dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(rank, str(tmp_path / "rendezvous"), fail_on, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            result = out.get(timeout=TIMEOUT)  # a hang fails here
            results[result["rank"]] = result
    except queue.Empty:
        pytest.fail(f"a process hung: answers from {sorted(results)} only")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return results


def test_each_process_samples_its_share_and_rank_0_gets_the_groups_in_order(tmp_path: Path) -> None:
    results = run_two(tmp_path, fail_on=None)
    r0, r1 = results[0], results[1]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    # the first call's 4 prompts: 0-1 on rank 0, 2-3 on rank 1 (offset 2); the second's single prompt on rank 0
    assert r0["calls"] == [([0, 1], 0, "whole policy on rank 0"), ([9], 0, "whole policy on rank 0")]
    assert r1["calls"] == [([2, 3], 2, "whole policy on rank 1")]  # rank 1 had no prompt of the second call
    assert r1["entered"] == ["in", "out"] * 2, "a rank with an empty share still joins the backend's collective"
    # the groups came back in prompt order: the first call's third prompt (sampled on rank 1, at 2) trains
    # on rank 0, the second call's (sampled on rank 0) on rank 1
    assert r0["batch"]["tokens"] == [[[1, 2, 0], [1, 2, 1]]]
    assert r1["batch"]["tokens"] == [[[0, 0, 0], [0, 0, 1]]]
    metrics = r0["batch"]["metrics"]
    assert metrics["completions/sampled_on_rank_0"] == 6.0 and metrics["completions/sampled_on_rank_1"] == 4.0
    assert r1["batch"]["metrics"] == metrics, "every rank's share carries the whole batch's metrics"
    assert r0["alone"] == "rank 0's copy (asked on rank 0)", (
        "outside a spread call get_model() is the model for sampling alone"
    )


def test_a_process_that_fails_to_generate_stops_every_process_with_its_error(tmp_path: Path) -> None:
    """Rank 1's rollout raises: rank 0 raises that error (type and message) after every rank
    answered, and hands it to rank 1 through the producer's failure path; nobody hangs."""
    results = run_two(tmp_path, fail_on=1)
    assert results[0]["error"] == ("PluginError", "test: rank 1 cannot generate"), results[0]
    assert results[1]["error"] == ("PluginError", "on rank 0: test: rank 1 cannot generate"), results[1]
    assert results[1]["entered"] == ["in", "out"], "rank 1 left the backend's context before answering"
    assert len(results[0]["calls"]) == 1, "rank 0 stopped at the failed call"

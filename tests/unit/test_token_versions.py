"""Per-token policy versions in the trainer (grpo_core/generation/token_versions.py):
the staleness metrics and the per-token staleness bound, on hand-made
batches whose every number is computed here by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, ScoredGroup
from grpo_core.generation.token_versions import drop_stale, staleness_metrics, versions_of
from grpo_core.validation.run_check import check_run_config


def group(version: int, *completions: Completion) -> ScoredGroup:
    return ScoredGroup(
        group=RolloutGroup(Prompt("p", [1, 2]), list(completions), policy_version=version),
        rewards=[[1.0] for _ in completions],
        advantages=[0.5 for _ in completions],
    )


def completion(versions: list[int] | None, length: int = 4, mask: list[int] | None = None) -> Completion:
    return Completion(list(range(10, 10 + length)), "t", [-1.0] * length, loss_mask=mask, token_versions=versions)


def test_staleness_is_counted_per_token_not_per_sample() -> None:
    # trainer at version 5; a batch begun at version 3 whose first sample crossed one update after 2 tokens
    batch = [group(3, completion([3, 3, 4, 4]), completion(None)), group(4, completion([4, 4, 4, 4]))]
    m = staleness_metrics(batch, 5)
    # stalenesses: [2, 2, 1, 1] + [2, 2, 2, 2] + [1, 1, 1, 1] -> 18 / 12
    assert m["token_staleness/mean"] == pytest.approx(18 / 12)
    assert m["token_staleness/max"] == 2.0
    assert m["inflight/tokens_across_update"] == 2.0
    assert m["inflight/samples_across_update"] == 1.0


def test_tokens_the_policy_did_not_sample_are_not_counted() -> None:
    # an episode: the environment's tokens (mask 0) carry no policy version that matters
    episode = completion([2, 2, 9, 3], mask=[1, 1, 0, 1])
    m = staleness_metrics([group(2, episode)], 4)
    assert m["token_staleness/mean"] == pytest.approx((2 + 2 + 1) / 3)
    assert m["inflight/tokens_across_update"] == 1.0


def test_a_sample_whose_oldest_token_is_too_old_is_dropped_and_counted() -> None:
    keep = completion([4, 4, 5, 5])  # oldest token 1 version behind the trainer at 5
    old = completion([3, 3, 4, 5])  # oldest token 2 behind: over a bound of 1
    batch = [group(3, keep, old)]
    batch[0].token_advantages = [[0.5] * 4, [0.5] * 4]
    out, dropped = drop_stale(batch, 5, bound=1)
    assert dropped == 1
    kept, gone = out[0].group.completions
    assert kept.loss_mask is None and out[0].advantages[0] == 0.5
    assert gone.loss_mask == [0, 0, 0, 0] and out[0].advantages[1] == 0.0 and out[0].token_advantages[1] == [0.0] * 4
    assert batch[0].group.completions[1].loss_mask is None  # the batch handed in is left as it was
    # a sample recorded with one version for all its tokens (its newest) would wrongly be kept
    assert drop_stale([group(3, completion([5, 5, 5, 5]))], 5, bound=1)[1] == 0
    assert drop_stale(batch, 5, bound=2)[1] == 0
    replayed = group(3, completion([1, 1, 1, 1]))
    replayed.replayed = True  # old on purpose: the replay's own rule corrects it
    assert drop_stale([replayed], 5, bound=1)[1] == 0
    assert staleness_metrics([replayed], 5)["token_staleness/max"] == 0.0


def test_versions_must_cover_every_token() -> None:
    with pytest.raises(ValueError, match="3 token versions for 4 tokens"):
        versions_of(completion([1, 1, 1]), 1)


def config(tmp_path: Path, **trl: object):
    return validate(
        {
            "base_model": "org/model",
            "micro_batch_size": 8,
            "datasets": [{"path": "org/data"}],
            "output_dir": str(tmp_path / "out"),
            "trl": {"reward_funcs": ["last_number_match"], **trl},
        }
    )


@pytest.mark.parametrize(
    ("trl", "fragment"),
    [
        ({"use_vllm": True}, "needs trl.async_prefetch = true"),
        ({"use_vllm": False, "async_prefetch": True}, "rollout 'transformers'"),
        ({"use_vllm": True, "vllm_mode": "colocate", "async_prefetch": True}, "rollout 'vllm_colocate'"),
        ({"use_vllm": True, "async_prefetch": True, "vllm_guided_decoding_regex": "[0-9]+"}, "guided_decoding_regex"),
        ({"use_vllm": True, "async_prefetch": True, "generation_kwargs": {"presence_penalty": 0.5}}, "presence_pen"),
    ],
)
def test_engines_and_settings_that_cannot_update_in_flight_are_refused_by_name(
    tmp_path: Path, trl: dict, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_run_config(config(tmp_path, in_flight_weight_updates=True, **trl), trains=False)
    assert "trl.in_flight_weight_updates" in str(info.value) and fragment in str(info.value)


def test_the_nccl_sync_is_refused_and_a_vllm_server_is_accepted(tmp_path: Path) -> None:
    ok = config(tmp_path, in_flight_weight_updates=True, use_vllm=True, async_prefetch=True)
    check_run_config(ok, trains=False)
    nccl = config(tmp_path, in_flight_weight_updates=True, use_vllm=True, async_prefetch=True)
    nccl.plugins.weight_sync = "nccl"
    with pytest.raises(ConfigError, match="weight sync 'nccl'"):
        check_run_config(nccl, trains=False)


class _Engine:
    """An engine that records what the sync did inside its in-flight update."""

    def __init__(self, capabilities: frozenset[str]) -> None:
        self.capabilities = capabilities
        self.description = "fake engine"
        self.events: list[str] = []

    def update_in_flight(self, version: int, load) -> None:
        self.events.append(f"pause for {version}")
        load()
        self.events.append("resume")


def _sync_with(engine: _Engine, in_flight: bool):
    from types import SimpleNamespace

    from grpo_core.sync.policy_sync import PolicySync

    hook = SimpleNamespace(grpo_sync_weights=lambda model, version, engine: engine.events.append(f"load {version}"))
    return PolicySync(
        hook,
        engine,
        backend=SimpleNamespace(full_model=lambda version: "model"),
        dist=SimpleNamespace(is_main=True, active=False),
        producer=SimpleNamespace(weights_synced=lambda version: engine.events.append(f"producer at {version}")),
        verifier=SimpleNamespace(sync=lambda run, model, version: run()),
        in_flight=in_flight,
    )


def test_with_in_flight_updates_the_sync_runs_inside_the_engines_update() -> None:
    from grpo_core.contract.types import PAUSES_GENERATION

    engine = _Engine(frozenset({PAUSES_GENERATION}))
    _sync_with(engine, in_flight=True).sync(4)
    assert engine.events == ["pause for 4", "load 4", "resume", "producer at 4"]
    plain = _Engine(frozenset({PAUSES_GENERATION}))
    _sync_with(plain, in_flight=False).sync(4)
    assert plain.events == ["load 4", "producer at 4"]


def test_an_engine_that_cannot_pause_is_refused_at_the_sync_too() -> None:
    from grpo_core.contract.errors import GrpoError

    with pytest.raises(GrpoError, match="does not declare 'pauses_generation'"):
        _sync_with(_Engine(frozenset()), in_flight=True).sync(1)

"""The default replay implementation: replay buffer and deferred re-rolling.

Pure Python: groups are built by hand with known rewards and advantages.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import GrpoError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, ScoredGroup, TrainingProgress
from grpo_core.host.plugin_host import PluginHost
from grpo_plugins.replay import SignalReplay, all_rewards_zero, prompt_key

EARLY = TrainingProgress(step=1, max_steps=10)
LATE = TrainingProgress(step=6, max_steps=10)


def context(**trl) -> RunContext:
    return RunContext(config=validate({"base_model": "unused", "trl": trl}), output_dir=Path("."))


def prompt(index: int) -> Prompt:
    return Prompt(prompt=f"question {index}", prompt_ids=[1, 2, index], columns={"answer": str(index)}, index=index)


def scored(p: Prompt | int, rewards: list[float | None], version: int = 0) -> ScoredGroup:
    """A group with one reward function; advantages = reward - group mean."""
    p = prompt(p) if isinstance(p, int) else p
    values = [0.0 if r is None else r for r in rewards]
    mean = sum(values) / len(values)
    completions = [Completion(token_ids=[7, i], text=f"c{i}", logprobs=[-0.5, -1.0]) for i in range(len(rewards))]
    return ScoredGroup(
        group=RolloutGroup(prompt=p, completions=completions, policy_version=version),
        rewards=[[r] for r in rewards],
        advantages=[v - mean for v in values],
    )


def ids(groups: list[ScoredGroup]) -> list[int]:
    return [g.group.prompt.index for g in groups]


# ---------------------------------------------------------------- off by default


def test_defaults_change_nothing_and_log_nothing():
    replay = SignalReplay(context())
    assert not replay.replay_enabled and not replay.reroll_enabled
    batch = [scored(0, [1.0, 0.0]), scored(1, [0.0, 0.0])]
    for _ in range(3):
        assert replay.grpo_replay_groups(groups=batch, progress=LATE) == batch
    prompts = [prompt(5), prompt(6)]
    assert replay.grpo_replay_prompts(prompts=prompts, progress=LATE) == prompts
    metrics: dict[str, float] = {}
    replay.grpo_step_end(metrics=metrics)
    assert metrics == {}


def test_all_rewards_zero():
    assert all_rewards_zero(scored(0, [0.0, None, float("nan")]))
    assert not all_rewards_zero(scored(0, [0.0, -1.0]))
    assert not all_rewards_zero(scored(0, [0.5, 0.5]))  # solved (no signal either), not deferred
    rollout = scored(0, [0.0, 0.0]).group
    two_funcs = ScoredGroup(group=rollout, rewards=[[0.0, None], [None, 2.0]], advantages=[0.0, 0.0])
    assert not all_rewards_zero(two_funcs)


# ---------------------------------------------------------------- replay buffer


def test_buffer_replaces_groups_without_signal_by_earlier_ones_with_signal():
    replay = SignalReplay(context(replay_buffer_size=4))
    a, b = scored(0, [1.0, 0.0], version=1), scored(1, [0.0, 0.0], version=1)
    out1 = replay.grpo_replay_groups(groups=[a, b], progress=EARLY)
    assert out1 == [a, b]  # nothing remembered yet, and never a group of the same batch

    c, d = scored(2, [1.0, 1.0], version=2), scored(3, [0.0, 2.0], version=2)
    out2 = replay.grpo_replay_groups(groups=[c, d], progress=EARLY)
    assert ids(out2) == [0, 3]
    assert out2[0].replayed and not a.replayed  # a copy is marked, the original is not
    assert out2[0].group.policy_version == 1  # the trainer can see how stale it is
    assert out2[0].advantages == a.advantages and out2[0].rewards == a.rewards
    assert out2[1] is d

    e, f = scored(4, [0.0, 0.0]), scored(5, [0.0, 0.0])
    out3 = replay.grpo_replay_groups(groups=[e, f], progress=EARLY)
    assert ids(out3) == [3, 5]  # a was used already: each group is replayed once
    assert [g.replayed for g in out3] == [True, False]
    assert replay.metrics()["replay/buffer_size"] == 0
    assert replay.metrics()["replay/replayed_total"] == 2


def test_newest_first_and_oldest_evicted():
    replay = SignalReplay(context(replay_buffer_size=2))
    replay.grpo_replay_groups(groups=[scored(i, [float(i), 0.0]) for i in (1, 2, 3)], progress=EARLY)
    assert replay.metrics()["replay/buffer_size"] == 2
    assert replay.metrics()["replay/evicted_total"] == 1  # group 1 was pushed out
    out = replay.grpo_replay_groups(groups=[scored(i, [0.0, 0.0]) for i in (10, 11, 12)], progress=EARLY)
    assert ids(out) == [3, 2, 12]


def test_groups_with_signal_and_replayed_inputs_are_never_replaced_or_remembered():
    replay = SignalReplay(context(replay_buffer_size=3))
    replay.grpo_replay_groups(groups=[scored(0, [1.0, 0.0])], progress=EARLY)
    incoming_replayed = scored(1, [0.0, 0.0])
    incoming_replayed.replayed = True
    signal = scored(2, [0.0, 1.0])
    out = replay.grpo_replay_groups(groups=[signal, incoming_replayed], progress=EARLY)
    assert out == [signal, incoming_replayed]
    # only `signal` joined the buffer; the replayed input was not remembered a second time
    assert replay.metrics()["replay/buffer_size"] == 2


# ---------------------------------------------------------------- deferred re-rolling


def test_reroll_defers_zero_reward_prompts_only_after_the_start_fraction():
    replay = SignalReplay(context(reroll_start_fraction=0.5, reroll_max_groups=1))
    failed = scored(0, [0.0, None])
    replay.grpo_replay_groups(groups=[failed, scored(1, [1.0, 0.0])], progress=EARLY)
    assert replay.metrics()["reroll/pending"] == 0  # before 50% of training

    replay.grpo_replay_groups(groups=[failed, scored(1, [1.0, 0.0]), scored(2, [0.0, 0.0])], progress=LATE)
    assert replay.metrics()["reroll/pending"] == 2

    batch = [prompt(10), prompt(11), prompt(12)]
    assert replay.grpo_replay_prompts(prompts=batch, progress=EARLY) == batch  # not yet
    out = replay.grpo_replay_prompts(prompts=batch, progress=LATE)
    assert [p.index for p in out] == [10, 11, 0]  # at most one, first in first out, at the end
    out = replay.grpo_replay_prompts(prompts=batch, progress=LATE)
    assert [p.index for p in out] == [10, 11, 2]
    assert replay.grpo_replay_prompts(prompts=batch, progress=LATE) == batch  # queue empty
    assert batch == [prompt(10), prompt(11), prompt(12)]  # the input list is not modified


def test_reroll_max_groups_per_batch_and_duplicates_wait():
    replay = SignalReplay(context(reroll_start_fraction=0.0, reroll_max_groups=2))
    replay.grpo_replay_groups(groups=[scored(i, [0.0, 0.0]) for i in (1, 2, 3)], progress=EARLY)
    out = replay.grpo_replay_prompts(prompts=[prompt(1), prompt(20), prompt(21), prompt(22)], progress=EARLY)
    # prompt 1 is already in the batch: it waits, 2 and 3 go in
    assert [p.index for p in out] == [1, 20, 3, 2]
    assert replay.metrics()["reroll/pending"] == 1
    out = replay.grpo_replay_prompts(prompts=[prompt(30)], progress=EARLY)
    assert [p.index for p in out] == [1]  # never more than the batch holds


def test_each_prompt_is_rerolled_a_bounded_number_of_times():
    replay = SignalReplay(context(reroll_start_fraction=0.0, reroll_max_groups=1), max_rerolls=2)
    hopeless = prompt(7)
    injected = 0
    replay.grpo_replay_groups(groups=[scored(hopeless, [0.0, 0.0])], progress=EARLY)
    for step in range(6):
        out = replay.grpo_replay_prompts(prompts=[prompt(100 + step)], progress=EARLY)
        injected += out[0].index == 7
        rewards = [0.0, 0.0] if out[0].index == 7 else [1.0, 0.0]  # only prompt 7 keeps failing
        replay.grpo_replay_groups(groups=[scored(out[0], rewards)], progress=EARLY)
    assert injected == 2
    metrics = replay.metrics()
    assert metrics["reroll/injected_total"] == 2 and metrics["reroll/pending"] == 0
    assert metrics["reroll/exhausted_total"] >= 1


def test_pending_queue_is_bounded():
    replay = SignalReplay(context(reroll_start_fraction=0.0, reroll_max_groups=1), max_pending=3)
    replay.grpo_replay_groups(groups=[scored(i, [0.0, 0.0]) for i in range(5)], progress=EARLY)
    assert replay.metrics()["reroll/pending"] == 3
    out = replay.grpo_replay_prompts(prompts=[prompt(50)], progress=EARLY)
    assert out[0].index == 2  # the two oldest were dropped


def test_prompt_key_uses_index_then_tokens():
    assert prompt_key(prompt(3)) == "i:3"
    anonymous = Prompt(prompt="x", prompt_ids=[4, 5])
    assert prompt_key(anonymous) == "t:4,5" != prompt_key(Prompt(prompt="x", prompt_ids=[4, 6]))


# ---------------------------------------------------------------- metrics and checkpoints


def test_step_end_adds_counters_and_resets_per_step_ones():
    replay = SignalReplay(context(replay_buffer_size=2, reroll_start_fraction=0.0, reroll_max_groups=1))
    replay.grpo_replay_groups(groups=[scored(0, [1.0, 0.0]), scored(1, [0.0, 0.0])], progress=EARLY)
    replay.grpo_replay_prompts(prompts=[prompt(9), prompt(8)], progress=EARLY)
    replay.grpo_replay_groups(groups=[scored(2, [0.0, 0.0]), scored(1, [0.0, 0.0])], progress=EARLY)
    metrics = {"loss": 1.0}
    replay.grpo_step_end(metrics=metrics)
    assert metrics["loss"] == 1.0
    assert metrics["replay/buffer_size"] == 0
    assert metrics["replay/replayed_groups"] == 1
    assert metrics["reroll/injected"] == 1
    assert metrics["reroll/pending"] == 2  # prompt 2 failed; re-rolled prompt 1 failed again (1 of 2 re-rolls used)
    after: dict[str, float] = {}
    replay.grpo_step_end(metrics=after)
    assert after["replay/replayed_groups"] == 0 and after["reroll/injected"] == 0
    assert after["replay/replayed_total"] == 1 and after["reroll/injected_total"] == 1


def test_state_dict_round_trip_is_plain_data():
    cfg = {"replay_buffer_size": 3, "reroll_start_fraction": 0.0, "reroll_max_groups": 1}
    replay = SignalReplay(context(**cfg))
    batch = [scored(0, [1.0, 0.0]), scored(1, [0.0, 2.0]), scored(2, [0.0, 0.0])]
    replay.grpo_replay_groups(groups=batch, progress=EARLY)
    state = replay.state_dict()
    assert json.loads(json.dumps(state)) == state  # nothing but dicts, lists, strings and numbers
    assert pickle.loads(pickle.dumps(state)) == state

    restored = SignalReplay(context(**cfg))
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.metrics() == replay.metrics()
    empty = [scored(i, [0.0, 0.0]) for i in (5, 6)]
    expected = replay.grpo_replay_groups(groups=empty, progress=EARLY)
    got = restored.grpo_replay_groups(groups=empty, progress=EARLY)
    assert got == expected and ids(got) == [1, 0]
    assert restored.grpo_replay_prompts(prompts=[prompt(9)], progress=EARLY)[0].index == 2

    smaller = SignalReplay(context(replay_buffer_size=1))
    smaller.load_state_dict(state)
    assert ids(smaller.grpo_replay_groups(groups=empty, progress=EARLY)) == [1, 6]  # newest kept


def test_load_state_dict_rejects_unknown_versions():
    replay = SignalReplay(context(replay_buffer_size=1))
    with pytest.raises(GrpoError, match="version 99"):
        replay.load_state_dict({"version": 99})
    with pytest.raises(GrpoError, match="resume_from_checkpoint"):
        replay.load_state_dict(["not", "a", "dict"])


def test_loads_through_the_entry_point_and_sees_lifecycle_hooks():
    host = PluginHost()
    obj = host.load_implementation("replay", "default", context(replay_buffer_size=2))
    assert isinstance(obj, SignalReplay)
    host.hook.grpo_replay_groups(groups=[scored(0, [1.0, 0.0])], progress=EARLY)
    out = host.hook.grpo_replay_groups(groups=[scored(1, [0.0, 0.0])], progress=EARLY)
    assert out[0].replayed and out[0].group.prompt.index == 0
    assert host.hook.grpo_replay_prompts(prompts=[prompt(3)], progress=EARLY) == [prompt(3)]
    metrics: dict[str, float] = {}
    host.hook.grpo_step_end(progress=EARLY, metrics=metrics)
    assert metrics["replay/replayed_groups"] == 1


# ---------------------------------------------------------------- property test


reward = st.one_of(st.none(), st.sampled_from([0.0, 0.0, 1.0, -1.0, 0.5]))


@settings(max_examples=150, deadline=None)
@given(
    buffer_size=st.integers(0, 4),
    reroll_max=st.integers(0, 2),
    start=st.sampled_from([0.0, 0.5, 1.0]),
    max_rerolls=st.integers(0, 2),
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.lists(reward, min_size=2, max_size=3)), min_size=1, max_size=5),
        min_size=1,
        max_size=12,
    ),
)
def test_random_runs_keep_the_invariants(buffer_size, reroll_max, start, max_rerolls, batches):
    replay = SignalReplay(
        context(replay_buffer_size=buffer_size, reroll_start_fraction=start, reroll_max_groups=reroll_max),
        max_rerolls=max_rerolls,
        max_pending=4,
    )
    fresh: list[ScoredGroup] = []  # every group the "trainer" scored, in order (kept alive: ids stay unique)
    uid_of_rollout: dict[int, int] = {}  # id(RolloutGroup) -> position in `fresh`
    replayed_uids: list[int] = []
    injections: dict[int, int] = {}
    for step, batch in enumerate(batches):
        progress = TrainingProgress(step=step, max_steps=len(batches))
        prompts = [prompt(p) for p, _ in batch]  # dataset prompts 0..5 recur across batches
        chosen = replay.grpo_replay_prompts(prompts=prompts, progress=progress)
        assert len(chosen) == len(prompts)
        swapped = [i for i, (a, b) in enumerate(zip(prompts, chosen, strict=True)) if a is not b]
        assert len(swapped) <= reroll_max
        if swapped:
            assert start < 1.0 and progress.fraction >= start
        for i in swapped:
            injections[chosen[i].index] = injections.get(chosen[i].index, 0) + 1
            assert injections[chosen[i].index] <= max_rerolls  # bounded re-rolls per prompt

        groups = [scored(p, rewards) for p, (_, rewards) in zip(chosen, batch, strict=True)]
        first_of_batch = len(fresh)
        out = replay.grpo_replay_groups(groups=groups, progress=progress)

        assert len(out) == len(groups)  # never changes the batch length
        for before, after in zip(groups, out, strict=True):
            if after is before:
                assert not after.replayed
                continue
            # only a group without signal is replaced, by a remembered one with signal from an earlier batch
            assert buffer_size > 0 and not before.has_signal
            assert after.replayed and after.has_signal
            uid = uid_of_rollout[id(after.group)]
            assert uid < first_of_batch and fresh[uid].has_signal
            assert after.rewards is fresh[uid].rewards and after.advantages is fresh[uid].advantages
            replayed_uids.append(uid)
        assert len(replayed_uids) == len(set(replayed_uids))  # never replays a group twice
        metrics = replay.metrics()
        assert metrics["replay/buffer_size"] <= buffer_size  # never exceeds the buffer size
        assert metrics["reroll/pending"] <= 4
        assert metrics["replay/replayed_total"] == len(replayed_uids)
        for g in groups:
            uid_of_rollout[id(g.group)] = len(fresh)
            fresh.append(g)


def test_replayed_copy_keeps_trainer_data():
    """What replay_recompute_logps needs: same tokens, logprobs and prompt, flagged."""
    replay = SignalReplay(context(replay_buffer_size=1))
    original = scored(0, [1.0, 0.0], version=3)
    replay.grpo_replay_groups(groups=[original], progress=EARLY)
    (copy,) = replay.grpo_replay_groups(groups=[scored(1, [0.0, 0.0], version=4)], progress=EARLY)
    assert copy.replayed and copy.group.completions == original.group.completions
    assert copy.group.prompt == original.group.prompt and copy.group.policy_version == 3
    assert all(math.isfinite(a) for a in copy.advantages)

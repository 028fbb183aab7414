"""Partial rollouts (grpo_core/generation/partial_rollouts.py): the budget per
batch, the buffer of open groups, and its checkpoint, against a fake engine
whose next token depends on the whole context.

The fake engine is a deterministic language model: each token is a function
of the ids before it. So a sample cut into pieces and continued from
``prompt + ids so far`` is the very sample generated in one piece, token
for token, only if every continuation starts from exactly the ids sampled:
a continuation that drops, repeats or reorders a token conditions on a
different context and the rest of the sample differs (the tests compare
against the sample generated whole, and check that by mutation).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from grpo_core.checkpointing.safe_load import safe_load
from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup, SamplingSettings, TrainingProgress
from grpo_core.generation import partial_rollouts as pr
from grpo_core.generation.partial_rollouts import PartialRollouts, piece_sampling, still_open
from grpo_core.generation.producer import ProducerOptions, PromptStream, RolloutProducer
from grpo_core.generation.token_versions import token_staleness_bound
from grpo_core.validation.run_check import check_run_config

EOS = 2
LIMIT = 10  # max_completion_length
N = 3  # num_generations


def next_token(context: list[int]) -> int:
    h = 0
    for t in context[-4:]:
        h = (h * 131 + t) % 1009
    h = (h + 7 * len(context)) % 1009
    return EOS if h % 9 == 0 else 10 + h % 90


def logprob(context: list[int], token: int) -> float:
    return -((len(context) * 37 + token) % 101) / 50.0


class FakeEngine:
    """``grpo_rollout_generate`` over :func:`next_token`. Sample ``i`` of a
    request with ``n > 1`` starts with token ``200 + i`` (so a group's samples
    differ); a request with ``n = 1`` is a plain continuation. Stops at EOS
    (checked first, as vLLM does) or at ``max_tokens`` (``truncated``)."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], int, int]] = []  # (prompt ids, n, max_tokens)

    def sample(self, prompt_ids: list[int], index: int, n: int, max_tokens: int) -> Completion:
        ids: list[int] = []
        logps: list[float] = []
        while len(ids) < max_tokens:
            context = prompt_ids + ids
            token = 200 + index if n > 1 and not ids else next_token(context)
            ids.append(token)
            logps.append(logprob(context, token))
            if token == EOS:
                return Completion(ids, "".join(f"<{t}>" for t in ids), logps, truncated=False)
        return Completion(ids, "".join(f"<{t}>" for t in ids), logps, truncated=True)

    def grpo_rollout_generate(
        self, prompts: list[Prompt], num_generations: int, sampling: SamplingSettings, policy_version: int
    ) -> list[RolloutGroup]:
        out = []
        for p in prompts:
            self.requests.append((list(p.prompt_ids), num_generations, sampling.max_tokens))
            completions = [
                self.sample(list(p.prompt_ids), i, num_generations, sampling.max_tokens) for i in range(num_generations)
            ]
            out.append(RolloutGroup(p, completions, policy_version))
        return out


def prompts(count: int, start: int = 0) -> list[Prompt]:
    return [Prompt(f"q{i}", [5, 6, 7 + i], index=i) for i in range(start, start + count)]


def whole(engine: FakeEngine, prompt: Prompt) -> list[Completion]:
    """The group generated in one piece: what partial rollouts must add up to."""
    return engine.grpo_rollout_generate([prompt], N, SamplingSettings(max_tokens=LIMIT), 0)[0].completions


def caller(engine: FakeEngine, version: int):
    return lambda requests, n, sampling, offset: engine.grpo_rollout_generate(requests, n, sampling, version)


def run_batches(buffer: PartialRollouts, engine: FakeEngine, batches: list[list[Prompt]], first_version: int = 0):
    """Each batch under the next version; every finished group with the batch it finished in."""
    done = []
    for b, new in enumerate(batches):
        finished, _ = buffer.generate(
            new, SamplingSettings(max_tokens=LIMIT), first_version + b, caller(engine, first_version + b), False
        )
        done += [(first_version + b, g) for g in finished]
    return done


def test_pieces_add_up_to_the_sample_generated_whole_token_by_token() -> None:
    engine = FakeEngine()
    buffer = PartialRollouts(budget=3, num_generations=N)
    batches = [prompts(2), prompts(2, start=2)] + [[] for _ in range(4)]
    done = run_batches(buffer, engine, batches)
    assert not buffer.groups and len(done) == 4  # every group finished within ceil(10 / 3) = 4 batches
    started = {p.index: b for b, new in enumerate(batches) for p in new}
    spans = []
    for finished_at, group in done:
        reference = whole(FakeEngine(), group.prompt)
        assert group.policy_version == finished_at
        for c, ref in zip(group.completions, reference, strict=True):
            assert c.token_ids == ref.token_ids  # exact ids: nothing dropped, repeated or moved
            assert c.logprobs == ref.logprobs  # the sampler's log-prob of every token, in order
            assert c.truncated == ref.truncated and c.text == ref.text
            # token k was sampled in the batch that asked for it: 3 per batch from the one the group began in
            s = started[group.prompt.index]
            assert c.token_versions == [s + k // 3 for k in range(len(c.token_ids))]
            spans.append(len(set(c.token_versions)))
        # a group trains in the batch where its longest member finishes
        assert finished_at == started[group.prompt.index] + math.ceil(max(len(c.token_ids) for c in reference) / 3) - 1
    assert max(spans) > 1 and min(spans) < max(spans)  # some samples crossed batches, some did not: both paths ran


def test_a_continuation_that_drops_or_repeats_a_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation check of the test above: the same comparison fails when
    the continuation's prompt is not exactly prompt + ids so far."""
    real = dataclasses.replace

    for mutate in (lambda ids: ids[:-1], lambda ids: ids + ids[-1:]):

        def replace(obj, mutate=mutate, **changes):
            if isinstance(obj, Prompt) and "prompt_ids" in changes and len(changes["prompt_ids"]) > len(obj.prompt_ids):
                changes["prompt_ids"] = mutate(changes["prompt_ids"])
            return real(obj, **changes)

        monkeypatch.setattr(pr.dataclasses, "replace", replace)
        engine = FakeEngine()
        done = run_batches(PartialRollouts(3, N), engine, [prompts(2)] + [[] for _ in range(4)])
        monkeypatch.setattr(pr.dataclasses, "replace", real)
        mismatched = [
            c.token_ids != ref.token_ids
            for _, g in done
            for c, ref in zip(g.completions, whole(FakeEngine(), g.prompt), strict=True)
        ]
        assert any(mismatched)


def test_finished_members_wait_unchanged_and_are_never_asked_again() -> None:
    engine = FakeEngine()
    buffer = PartialRollouts(budget=3, num_generations=N)
    p = prompts(8)
    pieces = {q.index: [math.ceil(len(c.token_ids) / 3) for c in whole(FakeEngine(), q)] for q in p}
    # a group with a member done in the first batch and one that goes on: the first waits for the second
    mixed = [q for q in p if min(pieces[q.index]) == 1 < max(pieces[q.index])]
    assert mixed, "the fake engine gives no group with a short and a long member: change next_token"
    q = mixed[0]
    finished, metrics = buffer.generate(p, SamplingSettings(max_tokens=LIMIT), 0, caller(engine, 0), False)
    assert metrics["partial/finished_groups"] == len(finished) and q.index not in [g.prompt.index for g in finished]
    assert metrics["partial/open_groups"] == len(buffer.groups) >= 1
    waiting = next(g for g in buffer.groups if g.prompt.index == q.index)
    m = waiting.open.index(False)
    early = waiting.completions[m]
    engine.requests.clear()
    done = []
    for v in range(1, 4):
        done += buffer.generate([], SamplingSettings(max_tokens=LIMIT), v, caller(engine, v), False)[0]
    prefix = list(q.prompt_ids) + early.token_ids
    assert not [r for r in engine.requests if r[0][: len(prefix)] == prefix]  # never continued
    group = next(g for g in done if g.prompt.index == q.index)
    assert group.completions[m] == early and group.policy_version == max(pieces[q.index]) - 1
    assert not buffer.groups


def test_a_piece_keeps_the_versions_the_engine_recorded() -> None:
    """With in-flight updates the rollout records a version per token inside a
    piece (an update landed mid-piece); they are kept, not overwritten by the batch's."""
    done = pr.fold(pr.empty_completion(), Completion([1, 2], "a", [-0.1, -0.2], truncated=True), 3)
    both = pr.fold(done, Completion([3, 4, 5], "b", [-0.3, -0.4, -0.5], token_versions=[4, 4, 5]), 4)
    assert both.token_ids == [1, 2, 3, 4, 5] and both.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert both.token_versions == [3, 3, 4, 4, 5] and both.text == "ab" and not both.truncated
    with pytest.raises(ValueError, match="2 token versions for 3 tokens"):
        pr.fold(done, Completion([3, 4, 5], "b", [-0.3] * 3, token_versions=[4, 4]), 4)
    assert pr.fold(done, Completion([3], "b", None), 4).logprobs is None  # an engine without log-probs: none


@pytest.mark.parametrize(
    ("piece", "asked", "total", "open_"),
    [
        (Completion([1, 2, 3], "", truncated=True), 3, 3, True),  # cut by the budget: goes on
        (Completion([1, 2, EOS], "", truncated=False), 3, 3, False),  # EOS as the last allowed token: a stop
        (Completion([1, 2, 3], "", truncated=True), 3, LIMIT, False),  # max_completion_length reached
        (Completion([1, 2], "", truncated=True), 3, 5, False),  # fewer than asked: the engine's context is full
    ],
)
def test_which_samples_go_on(piece: Completion, asked: int, total: int, open_: bool) -> None:
    assert still_open(piece, asked, total, LIMIT) is open_


def test_a_piece_asks_for_the_budget_or_what_is_left_and_min_tokens_counts_what_was_sampled() -> None:
    sampling = SamplingSettings(max_tokens=LIMIT, extra={"min_tokens": 5})
    assert piece_sampling(sampling, 0, 4).max_tokens == 4 and piece_sampling(sampling, 0, 4).extra["min_tokens"] == 4
    later = piece_sampling(sampling, 8, 4)
    assert later.max_tokens == 2 and later.extra["min_tokens"] == 0
    assert piece_sampling(sampling, 4, 4).extra["min_tokens"] == 1
    assert sampling.extra["min_tokens"] == 5  # the run's settings are left as they were


def test_the_buffer_survives_a_checkpoint_and_the_resumed_samples_are_the_same(tmp_path: Path) -> None:
    """Save the buffer as a checkpoint does (torch.save, read back with
    grpo's code-free loader), resume in a new buffer: the samples finish
    exactly as in the run that never stopped, none generated twice."""
    batches = [prompts(2), prompts(2, start=2), [], [], [], []]
    straight = run_batches(PartialRollouts(3, N), FakeEngine(), batches)

    engine = FakeEngine()
    first = PartialRollouts(3, N)
    before = run_batches(first, engine, batches[:2])
    assert first.groups, "nothing was open at the checkpoint: the test would prove nothing"
    torch.save({"partial_rollouts": first.state_dict()}, tmp_path / "extra_state.pt")
    state = safe_load(tmp_path / "extra_state.pt")["partial_rollouts"]  # read back without running code
    resumed = PartialRollouts(3, N)
    resumed.load_state_dict(state)
    engine.requests.clear()
    after = run_batches(resumed, engine, batches[2:], first_version=2)
    got = [
        (b, g.prompt.index, [c.token_ids for c in g.completions], [c.token_versions for c in g.completions])
        for b, g in before + after
    ]
    want = [
        (b, g.prompt.index, [c.token_ids for c in g.completions], [c.token_versions for c in g.completions])
        for b, g in straight
    ]
    assert got == want
    # nothing generated twice: after the resume only continuations were asked for, each from its saved ids
    saved_prefixes = {
        tuple(g["prompt"].prompt_ids) + tuple(c.token_ids)
        for g in state
        for c, o in zip(g["completions"], g["open"])
        if o
    }
    continued = {tuple(r[0]) for r in engine.requests if r[1] == 1}
    assert saved_prefixes <= continued
    assert all(r[1] == 1 for r in engine.requests)


def test_a_checkpoint_of_another_group_size_is_refused_by_name() -> None:
    buffer = PartialRollouts(3, N)
    run_batches(buffer, FakeEngine(), [prompts(2)])
    with pytest.raises(GrpoError, match="num_generations"):
        PartialRollouts(3, N + 1).load_state_dict(buffer.state_dict())


class Scorer:
    names = ["length"]
    weights = [1.0]

    def score(self, groups: list[RolloutGroup], step: int) -> list[list[list[float | None]]]:
        return [[[float(len(c.token_ids))] for c in g.completions] for g in groups]


class Hook(FakeEngine):
    def grpo_replay_prompts(self, prompts, progress):
        return None

    def grpo_replay_groups(self, groups, progress):
        return None

    def grpo_aggregate_advantages(self, rewards, weights, group_size, **_):
        r = (rewards * weights).sum(-1).view(-1, group_size)
        return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).flatten()


def producer(stream: PromptStream | None = None) -> RolloutProducer:
    stream = stream or PromptStream(prompts(8), seed=3, shuffle=True)
    return RolloutProducer(
        ProducerOptions(N, "group", partial_budget=3),
        Hook(),
        Scorer(),
        stream,
        prompts_per_batch=2,
        sampling=SamplingSettings(max_tokens=LIMIT),
        concurrent_rollout=True,
    )


def trained(batches) -> list[int]:
    return sorted(g.group.prompt.index for b in batches for g in b.groups)


def test_the_producer_trains_every_prompt_once_and_resumes_its_open_samples() -> None:
    """Four batches over an 8-row epoch: every prompt the stream handed out
    is trained once or still open, never both, never twice; a producer
    restored from a checkpoint's state (prompt stream + open groups) makes
    the same batches as the one that never stopped."""
    straight = producer()
    batches = []
    for step in range(6):
        straight.weights_synced(step)
        batches.append(straight.produce(TrainingProgress(step, 6)))
    open_now = [g["prompt"].index for g in straight.partial_state()]
    handed_out = [p.index for p in PromptStream(prompts(8), seed=3, shuffle=True).take(12)]  # 1.5 epochs
    assert Counter(trained(batches) + open_now) == Counter(handed_out)  # none lost, none twice
    assert open_now and trained(batches)  # both kinds present at the end: the check covers both
    assert batches[0].metrics["partial/open_groups"] >= 1 and "partial/continued_samples" in batches[1].metrics
    for b in batches:
        for g in b.groups:
            assert len(g.advantages) == N and len(g.group.completions) == N

    first = producer()
    for step in range(2):
        first.weights_synced(step)
        first.produce(TrainingProgress(step, 6))
    state = first.partial_state()
    stream = PromptStream(prompts(8), seed=3, shuffle=True)
    stream.load_state_dict(first.stream.state_dict())
    resumed = producer(stream)
    resumed.restore_partial(state)
    again = []
    for step in range(2, 6):
        resumed.weights_synced(step)
        again.append(resumed.produce(TrainingProgress(step, 6)))

    def key(batch):
        return [(g.group.prompt.index, [c.token_ids for c in g.group.completions]) for g in batch.groups]

    assert [key(b) for b in again] == [key(b) for b in batches[2:]]
    assert resumed.partial_state() == straight.partial_state()


def test_a_run_without_a_budget_refuses_a_checkpoint_with_open_samples() -> None:
    with_budget = producer()
    with_budget.produce(TrainingProgress(0, 2))
    plain = RolloutProducer(
        ProducerOptions(N, "group"),
        Hook(),
        Scorer(),
        PromptStream(prompts(8), 3, True),
        2,
        SamplingSettings(LIMIT),
        True,
    )
    with pytest.raises(GrpoError, match="trl.partial_rollout_token_budget"):
        plain.restore_partial(with_budget.partial_state())
    plain.restore_partial(None)  # a checkpoint without partial rollouts


def test_the_staleness_bound_grows_by_the_batches_a_sample_may_span() -> None:
    assert token_staleness_bound(1, 1, 256, None) == 1
    assert token_staleness_bound(1, 1, 256, 64) == 1 + 3  # 4 batches at most, 3 after the first
    assert token_staleness_bound(2, 2, 100, 30) == (2 + 3) * 2
    # a batch that feeds 3 optimizer steps is 3 versions old when trained, with or without in-flight updates
    assert token_staleness_bound(1, 3, 256, None) == 3
    assert token_staleness_bound(1, 1, 64, 64) == 1


def config(tmp_path: Path, **trl: object):
    return validate(
        {
            "base_model": "org/model",
            "micro_batch_size": 8,
            "datasets": [{"path": "org/data"}],
            "output_dir": str(tmp_path / "out"),
            "trl": {"reward_funcs": ["last_number_match"], "max_completion_length": 64, **trl},
        }
    )


@pytest.mark.parametrize(
    ("trl", "fragment"),
    [
        ({"use_vllm": False}, "rollout 'transformers'"),
        ({"use_vllm": True, "vllm_mode": "colocate"}, "rollout 'vllm_colocate'"),
        ({"use_vllm": True, "streaming_partial_batch": True}, "streaming_partial_batch = false"),
        ({"use_vllm": True, "vllm_guided_decoding_regex": "[0-9]+"}, "guided_decoding_regex"),
        ({"use_vllm": True, "generation_kwargs": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"use_vllm": True, "generation_kwargs": {"stop": ["\n\n"]}}, "stop strings"),
        ({"use_vllm": True, "rollout_func": "my_module.rollout"}, "trl.rollout_func"),
    ],
)
def test_engines_and_settings_that_cannot_continue_a_sample_are_refused_by_name(
    tmp_path: Path, trl: dict, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_run_config(config(tmp_path, partial_rollout_token_budget=16, **trl), trains=False)
    assert "trl.partial_rollout_token_budget" in str(info.value) and fragment in str(info.value)


def test_a_vllm_server_is_accepted_and_several_processes_are_refused(tmp_path: Path) -> None:
    ok = config(tmp_path, partial_rollout_token_budget=16, use_vllm=True)
    check_run_config(ok, trains=False)
    with_async = config(tmp_path, partial_rollout_token_budget=16, use_vllm=True, async_prefetch=True)
    check_run_config(with_async, trains=False)
    with pytest.raises(ConfigError, match="not implemented for 2 training processes"):
        check_run_config(ok, num_processes=2, trains=False)
    useless = config(tmp_path, partial_rollout_token_budget=64, use_vllm=True)
    assert any("nothing is carried over" in w for w in check_run_config(useless, trains=False))


def test_producer_options_read_the_budget(tmp_path: Path) -> None:
    assert ProducerOptions.of(config(tmp_path, partial_rollout_token_budget=16)).partial_budget == 16
    assert ProducerOptions.of(config(tmp_path)).partial_budget is None

"""Per-token policy versions in the trainer (grpo_core/generation/token_versions.py):
the staleness metrics and the per-token staleness bound, on hand-made
batches whose every number is computed here by hand."""

from __future__ import annotations

import contextlib
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
        ({"use_vllm": True, "async_prefetch": True, "generation_kwargs": {"stop": ["\n\n"]}}, "stop strings"),
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


@pytest.mark.parametrize(("mode", "warned"), [("every", True), ("every_probe", True), ("first", False)])
def test_a_sync_check_that_probes_every_update_is_warned_about(tmp_path: Path, mode: str, warned: bool) -> None:
    cfg = config(tmp_path, in_flight_weight_updates=True, use_vllm=True, async_prefetch=True)
    cfg.verify_weight_sync = mode
    said = [w for w in check_run_config(cfg, trains=False) if "waits for the batch being generated" in w]
    assert bool(said) == warned, said
    assert all(f"verify_weight_sync = '{mode}'" in w and "'first'" in w for w in said)


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
        producer=SimpleNamespace(
            weights_synced=lambda version: engine.events.append(f"producer at {version}"),
            paused=lambda: contextlib.nullcontext(engine.events.append("batch finished")),
        ),
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
    # without: the producer learns the version after the batch being made (this sync changes the weights behind the
    # engine's methods, so it is waited for at its end) and before the next one starts; test_sync_between_batches.py
    assert plain.events == ["load 4", "batch finished", "producer at 4", "producer at 4"]


def test_an_engine_that_cannot_pause_is_refused_at_the_sync_too() -> None:
    from grpo_core.contract.errors import GrpoError

    with pytest.raises(GrpoError, match="does not declare 'pauses_generation'"):
        _sync_with(_Engine(frozenset()), in_flight=True).sync(1)


class _CharTokenizer:
    """One id per character: what the episode driver needs of a tokenizer."""

    all_special_ids: list[int] = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids, skip_special_tokens=True, **kw):
        return "".join(chr(i) for i in ids)


# each model turn's tokens and the version the rollout recorded for each: turn 2 was cut by an update (3 -> 4)
TURNS = [("ab", [3, 3]), ("cde", [3, 4, 4]), ("fg", [4, 4])]


def _scripted_turns():
    calls: list[int] = []

    def generate(prompts, n, sampling):
        text, versions = TURNS[len(calls)]
        calls.append(n)
        return [
            RolloutGroup(p, [Completion([ord(c) for c in text], text, [-1.0] * len(text), token_versions=versions)] * n)
            for p in prompts
        ]

    return generate


def _policy_versions(completion: Completion) -> list[int]:
    return [v for v, m in zip(completion.token_versions, completion.loss_mask, strict=True) if m]


def test_an_episode_keeps_each_turns_token_versions() -> None:
    """Multi-turn episodes with in-flight updates: every model turn's tokens
    keep the versions the rollout recorded (an update between turns, one in
    the middle of a turn); the environment's tokens (mask 0) are not read."""
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import EnvironmentReply, SamplingSettings
    from grpo_core.generation.episodes import EpisodeDriver

    class Game:
        turn = 0

        def reset(self):
            return None

        def step(self, text):
            self.turn += 1
            return EnvironmentReply(done=self.turn == 3, messages=[{"role": "user", "content": "h"}])

    tok = _CharTokenizer()
    driver = EpisodeDriver(
        lambda p, s: Game(), tok, GRPOConfig(base_model="m", episodes={"max_turns": 5}), "game", print, False
    )
    prompt = Prompt(prompt=[{"role": "user", "content": "go"}], prompt_ids=tok("<user>go|<assistant>")["input_ids"])
    (group,) = driver.run([prompt], 2, SamplingSettings(max_tokens=200), _scripted_turns())
    group.policy_version = 3
    for c in group.completions:
        assert len(c.token_versions) == len(c.token_ids)
        assert _policy_versions(c) == [3, 3, 3, 4, 4, 4, 4]  # one version per episode ([3] * 7) fails here
        assert [c.token_ids[s] for s in c.episode.turn_starts] == [ord("a"), ord("c"), ord("f")]
    metrics = staleness_metrics([ScoredGroup(group, [[0.0]] * 2, [0.0, 0.0])], trainer_version=4)
    assert metrics["token_staleness/max"] == 1.0 and metrics["inflight/tokens_across_update"] == 2 * 4
    assert drop_stale([ScoredGroup(group, [[0.0]] * 2, [1.0, -1.0])], 5, bound=1)[1] == 2  # its oldest token: 3


def test_an_agents_episode_keeps_each_turns_token_versions() -> None:
    """The same for a driven episode (an agent calling the model itself)."""
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import SamplingSettings
    from grpo_core.generation.episodes import EpisodeDriver

    class Agent:
        def drive(self, model):
            turn = model.generate(model.render([{"role": "user", "content": "go"}]))
            for _ in range(2):
                turn = model.generate(model.render([{"role": "user", "content": "h"}], after=turn), after=turn)
            return 1.0

    tok = _CharTokenizer()
    driver = EpisodeDriver(
        lambda p, s: Agent(), tok, GRPOConfig(base_model="m", episodes={"max_turns": 5}), "agent", print, False
    )
    prompt = Prompt(prompt=[{"role": "user", "content": "go"}], prompt_ids=tok("<user>go|<assistant>")["input_ids"])
    (group,) = driver.run([prompt], 1, SamplingSettings(max_tokens=200), _scripted_turns())
    (c,) = group.completions
    assert len(c.token_versions) == len(c.token_ids)
    assert _policy_versions(c) == [3, 3, 3, 4, 4, 4, 4]


def test_rollout_func_is_refused_and_environments_are_accepted(tmp_path: Path) -> None:
    base = {"use_vllm": True, "async_prefetch": True, "in_flight_weight_updates": True}
    with pytest.raises(
        ConfigError, match="cannot run with trl.rollout_func.*run the multi-turn loop as an environment"
    ):
        check_run_config(config(tmp_path, rollout_func="my_rollout.run", **base), trains=False)
    (tmp_path / "my_tools.py").write_text("def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: x\n"
                                          "        b: y\n    '''\n    return a + b\n")  # fmt: skip
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        check_run_config(config(tmp_path, tools=["my_tools.add"], **base), trains=False)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_tools", None)

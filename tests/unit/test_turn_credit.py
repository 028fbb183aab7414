"""Per-turn credit assignment: ``advantage_aggregation = "turn_returns"``
(plugins/advantages.py, ``TurnReturns``; docs/turn-credit.md).

* hand-computed episodes: each turn's advantage, token by token, for
  ``scale_rewards`` none and group, including a turn no other episode
  reached and an unscorable episode; a mutation that gives every turn the
  episode's one advantage fails the same check;
* the unbiasedness statement of ``TurnReturns``'s docstring, by exact
  enumeration of every outcome of a group on a two-turn decision problem:
  with a fixed number of turns the expected update is the policy gradient,
  and with episodes that may end early it is ``g_0 + p_1 g_1``;
* the per-token path: scored groups -> samples -> ``[B, C]`` advantages
  aligned with the completion mask -> the loss;
* the refusals by name (single-turn runs, environments without per-turn
  rewards, the Liger loss, no ``environment`` reward function), and the
  episode driver's record of turn starts and rewards.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, merged, minimal_config

from grpo_core.contract.types import Completion, EpisodeStats, Prompt, RolloutGroup, ScoredGroup
from grpo_plugins.advantages import STD_EPS, SumThenNormalize, TurnReturns

NAMES = ["environment", "bonus"]
WEIGHTS = torch.tensor([1.0, 0.5])


def episode(turns: list[tuple[int, float | None]], env_tokens: int = 2, lead: int = 0) -> Completion:
    """An episode of ``turns`` (model tokens, the reply's reward), each reply
    ``env_tokens`` environment tokens (none after the last turn), after
    ``lead`` tokens of the episode's own prompt (mask 0)."""
    ids, mask, starts = [7] * lead, [0] * lead, []
    for k, (tokens, _reward) in enumerate(turns):
        starts.append(len(ids))
        ids += [100 + k] * tokens
        mask += [1] * tokens
        if k < len(turns) - 1:
            ids += [5] * env_tokens
            mask += [0] * env_tokens
    stats = EpisodeStats(turns=len(turns), turn_starts=starts, turn_rewards=[r for _, r in turns])
    return Completion(token_ids=ids, text="", loss_mask=mask, episode=stats)


def hand_batch() -> tuple[torch.Tensor, list[Completion]]:
    """Two groups of three. Group 1 (the worked example of docs/turn-credit.md):

    A: 3 turns, replies 0.0, 0.2, 1.0; environment reward 1.2; bonus 1 -> R = 1.2 + 0.5 = 1.7
    B: 2 turns, replies 0.2, none; environment reward 0.5 (0.3 from final_reward); bonus 0 -> R = 0.5
    C: 1 turn, reply 1.0; environment reward 1.0; bonus 1 -> R = 1.5

    Returns-to-go (R less the environment's rewards of earlier turns):
    A 1.7, 1.7, 1.5; B 0.5, 0.3; C 1.5.

    Group 2: D and E, 2 turns each with no per-turn rewards, and F unscorable
    (every reward None), which gets advantage 0 and is no one's baseline."""
    completions = [
        episode([(3, 0.0), (2, 0.2), (1, 1.0)]),
        episode([(2, 0.2), (2, None)], lead=1),
        episode([(4, 1.0)]),
        episode([(2, None), (1, None)]),
        episode([(1, None), (2, None)]),
        episode([(2, None)]),
    ]
    nan = math.nan
    rewards = torch.tensor(
        [[1.2, 1.0], [0.5, 0.0], [1.0, 1.0], [1.0, nan], [0.0, 1.0], [nan, nan]], dtype=torch.float32
    )
    return rewards, completions


# the hand-computed per-turn advantages, scale "none": each turn against the mean of the other
# episodes at that turn (leave-one-out)
NONE = {
    0: [1.7 - (0.5 + 1.5) / 2, 1.7 - 0.3, 0.0],  # turn 2: no other episode reached it -> 0
    1: [0.5 - (1.7 + 1.5) / 2, 0.3 - 1.7],
    2: [1.5 - (1.7 + 0.5) / 2],
    3: [1.0 - 0.5, 1.0 - 0.5],  # D: R = 1.0 (bonus None), E: R = 0.5 (environment 0, bonus 1 x 0.5)
    4: [0.5 - 1.0, 0.5 - 1.0],
    5: [],
}


def _sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


GROUP_SCALE = {  # the standard deviation of each turn's returns (Bessel), per (episode, turn)
    (0, 0): _sd([1.7, 0.5, 1.5]),
    (1, 0): _sd([1.7, 0.5, 1.5]),
    (2, 0): _sd([1.7, 0.5, 1.5]),
    (0, 1): _sd([1.7, 0.3]),
    (1, 1): _sd([1.7, 0.3]),
    (3, 0): _sd([1.0, 0.5]),
    (4, 0): _sd([1.0, 0.5]),
    (3, 1): _sd([1.0, 0.5]),
    (4, 1): _sd([1.0, 0.5]),
}


def expected_tokens(completions: list[Completion], per_turn: dict[int, list[float]]) -> list[list[float]]:
    rows = []
    for i, c in enumerate(completions):
        bounds = [*c.episode.turn_starts, len(c.token_ids)]
        row = [0.0] * len(c.token_ids)
        for t, a in enumerate(per_turn[i]):
            for k in range(bounds[t], bounds[t + 1]):
                row[k] = a if c.loss_mask[k] else 0.0
        rows.append(row)
    return rows


def check_turn_advantages(got: list[list[float]], completions: list[Completion], scale: str) -> None:
    """``got`` (one list per completion, one value per token) is the hand-computed answer."""
    per_turn = {
        i: [a / (GROUP_SCALE[(i, t)] + STD_EPS) if scale == "group" and a else a for t, a in enumerate(turns)]
        for i, turns in NONE.items()
    }
    want = expected_tokens(completions, per_turn)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), i
        for k, (a, b) in enumerate(zip(g, w, strict=True)):
            assert a == pytest.approx(b, abs=1e-5), (i, k, g, w)


@pytest.mark.parametrize("scale", ["none", "group"])
def test_hand_computed_episodes(scale: str) -> None:
    rewards, completions = hand_batch()
    got = TurnReturns(SimpleNamespace(log=lambda _m: None)).grpo_aggregate_advantages(
        rewards, WEIGHTS, 3, scale, completions=completions, reward_names=NAMES
    )
    check_turn_advantages(got, completions, scale)
    # the turns of one episode differ: A's second turn is credited against B's, not with A's episode
    a_tokens = got[0]
    assert a_tokens[0] != a_tokens[5] and a_tokens[9] == 0.0


def test_every_turn_given_the_episode_advantage_fails_the_check() -> None:
    """The mutation the issue names: each turn's tokens carry the episode's
    one (group-relative) advantage. The hand-computed check rejects it."""
    rewards, completions = hand_batch()
    episode_level = SumThenNormalize().grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none").tolist()
    mutated = [[a if m else 0.0 for m in c.loss_mask] for a, c in zip(episode_level, completions, strict=True)]
    with pytest.raises(AssertionError):
        check_turn_advantages(mutated, completions, "none")


def test_batch_scale_divides_by_the_spread_of_every_played_turn() -> None:
    rewards, completions = hand_batch()
    got = TurnReturns().grpo_aggregate_advantages(rewards, WEIGHTS, 3, "batch", completions, NAMES)
    played = [1.7, 1.7, 1.5, 0.5, 0.3, 1.5, 1.0, 1.0, 0.5, 0.5]  # every scorable episode's every turn
    scale = _sd(played) + STD_EPS
    want = expected_tokens(completions, {i: [a / scale for a in turns] for i, turns in NONE.items()})
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-5)


def test_a_lone_turn_is_said_once() -> None:
    rewards, completions = hand_batch()
    said: list[str] = []
    agg = TurnReturns(SimpleNamespace(log=said.append))
    agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", completions, NAMES)
    agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", completions, NAMES)
    lone = [m for m in said if "no other episode of their group reached" in m]
    assert len(lone) == 1 and "1 turn(s)" in lone[0]  # A's third turn


def test_refuses_what_it_cannot_credit() -> None:
    from grpo_core.contract.errors import GrpoError

    rewards, completions = hand_batch()
    agg = TurnReturns()
    with pytest.raises(GrpoError, match="no 'environment' reward function"):
        agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", completions, ["env", "bonus"])
    single = [Completion(token_ids=[1, 2], text="")] * 6
    with pytest.raises(GrpoError, match="completion 0 is not a multi-turn episode"):
        agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", single, NAMES)
    with pytest.raises(GrpoError, match="no completions or reward names"):
        agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none")
    broken = hand_batch()[1]
    broken[2].episode.turn_rewards.append(0.0)
    with pytest.raises(GrpoError, match="completion 2's episode record has 1 turn starts and 2 turn rewards"):
        agg.grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", broken, NAMES)


# ---------------------------------------------------------------- unbiasedness, by exact enumeration

R0 = [0.3, -0.2]  # the reply's reward to turn 0, by the action
R1 = [[0.5, -0.4], [0.1, 0.9]]  # to turn 1, by both actions
BONUS = [[1.0, 0.0], [0.0, 2.0]]  # another reward function on the whole episode (weight 0.5)
THETA0 = torch.tensor([0.4, -0.3], dtype=torch.float64)
THETA1 = torch.tensor([[0.2, -0.5], [-0.1, 0.6]], dtype=torch.float64)
G = 3


def _trajectories(ends_early: bool) -> list[tuple[int, ...]]:
    """Every episode: (a0,) alone when action 1 at turn 0 ends it (``ends_early``)."""
    out: list[tuple[int, ...]] = []
    for a0 in (0, 1):
        out += [(a0,)] if ends_early and a0 == 1 else [(a0, 0), (a0, 1)]
    return out


def _prob_and_score(traj: tuple[int, ...], theta0: torch.Tensor, theta1: torch.Tensor):
    """The trajectory's probability and each turn's score function
    (d log pi(a_t | history) / d (theta0, theta1)), flattened."""
    p0 = torch.softmax(theta0, 0)
    prob = p0[traj[0]]
    scores = []
    s0 = torch.zeros(6, dtype=torch.float64)
    s0[:2] = torch.nn.functional.one_hot(torch.tensor(traj[0]), 2).double() - p0
    scores.append(s0)
    if len(traj) > 1:
        p1 = torch.softmax(theta1[traj[0]], 0)
        prob = prob * p1[traj[1]]
        s1 = torch.zeros(6, dtype=torch.float64)
        at = 2 + 2 * traj[0]
        s1[at : at + 2] = torch.nn.functional.one_hot(torch.tensor(traj[1]), 2).double() - p1
        scores.append(s1)
    return prob, scores


def _episode(traj: tuple[int, ...]) -> tuple[Completion, list[float]]:
    """The episode as a completion (one token per turn, one environment token
    between turns) and its reward row (environment, bonus)."""
    turn_rewards = [R0[traj[0]]] + ([R1[traj[0]][traj[1]]] if len(traj) > 1 else [])
    bonus = BONUS[traj[0]][traj[1]] if len(traj) > 1 else 0.0
    completion = episode([(1, r) for r in turn_rewards], env_tokens=1)
    return completion, [sum(turn_rewards), bonus]


def _expected_update(ends_early: bool, scale: str) -> torch.Tensor:
    """E[(1/G) sum_i sum_t A_it grad log pi(turn t of i)] over every outcome of a group of G."""
    trajs = _trajectories(ends_early)
    agg = TurnReturns(SimpleNamespace(log=lambda _m: None))
    total = torch.zeros(6, dtype=torch.float64)
    for outcome in itertools.product(trajs, repeat=G):
        made = [_episode(t) for t in outcome]
        rewards = torch.tensor([row for _, row in made], dtype=torch.float32)
        completions = [c for c, _ in made]
        rows = agg.grpo_aggregate_advantages(rewards, WEIGHTS, G, scale, completions, NAMES)
        prob = torch.tensor(1.0, dtype=torch.float64)
        update = torch.zeros(6, dtype=torch.float64)
        for traj, completion, row in zip(outcome, completions, rows, strict=True):
            p, scores = _prob_and_score(traj, THETA0, THETA1)
            prob = prob * p
            for t, score in enumerate(scores):
                update += row[completion.episode.turn_starts[t]] * score  # the turn's advantage, on its token
        total += prob * update / G
    return total


def _true_terms(ends_early: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """g_0 and g_1: each turn's term of the policy gradient of E[R], R the
    weighted episode reward, as autograd gives the whole of it."""
    theta0, theta1 = THETA0.clone().requires_grad_(True), THETA1.clone().requires_grad_(True)
    terms = [torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)]
    objective = torch.zeros((), dtype=torch.float64)
    for traj in _trajectories(ends_early):
        prob, scores = _prob_and_score(traj, theta0, theta1)
        _, (env, bonus) = _episode(traj)
        reward = env + 0.5 * bonus
        objective = objective + prob * reward
        returns = [reward, reward - R0[traj[0]]]  # rewards before turn t cannot be caused by it
        for t, score in enumerate(scores):
            terms[t] += prob.detach() * score.detach() * returns[t]
    grad = torch.autograd.grad(objective, (theta0, theta1))
    torch.testing.assert_close(terms[0] + terms[1], torch.cat([grad[0], grad[1].reshape(-1)]))  # the split is exact
    return terms[0], terms[1]


def test_fixed_length_episodes_give_the_policy_gradient_exactly() -> None:
    g0, g1 = _true_terms(ends_early=False)
    expected = _expected_update(ends_early=False, scale="none")
    torch.testing.assert_close(expected, g0 + g1, atol=2e-6, rtol=1e-5)
    assert float((g0 + g1).abs().max()) > 0.05  # a gradient worth comparing


def test_episodes_that_end_early_scale_each_turn_by_the_chance_a_peer_reached_it() -> None:
    """Action 1 at turn 0 ends the episode. Turn 1's term is then counted
    only when another episode of the group also reached turn 1:
    E = g_0 + p_1 g_1, p_1 = 1 - P(a0 = 1)^(G - 1), not the whole gradient."""
    g0, g1 = _true_terms(ends_early=True)
    p_end = float(torch.softmax(THETA0, 0)[1])
    p1 = 1.0 - p_end ** (G - 1)
    expected = _expected_update(ends_early=True, scale="none")
    torch.testing.assert_close(expected, g0 + p1 * g1, atol=2e-6, rtol=1e-5)
    assert float((expected - (g0 + g1)).abs().max()) > 1e-3  # the statement is tight: it is not g_0 + g_1


def test_standard_deviation_scaling_is_biased_as_grpo_is() -> None:
    g0, g1 = _true_terms(ends_early=False)
    scaled = _expected_update(ends_early=False, scale="group")
    direction = (g0 + g1) / (g0 + g1).norm()
    assert float((scaled / scaled.norm() - direction).abs().max()) > 1e-3


# ---------------------------------------------------------------- the per-token path


def test_per_token_advantages_reach_the_micro_batch_aligned_with_the_mask() -> None:
    from grpo_core.generation.producer import per_completion_advantages
    from grpo_core.optimization.batch import collate, flatten

    rewards, completions = hand_batch()
    rows = TurnReturns().grpo_aggregate_advantages(rewards, WEIGHTS, 3, "none", completions, NAMES)
    means, per_token = per_completion_advantages(rows, completions)
    assert per_token == rows
    policy = [a for a, m in zip(rows[0], completions[0].loss_mask, strict=True) if m]
    assert means[0] == pytest.approx(sum(policy) / len(policy))
    prompt = Prompt(prompt=[{"role": "user", "content": "hi"}], prompt_ids=[1, 2, 3])
    scored = ScoredGroup(
        group=RolloutGroup(prompt, completions[:3]),
        rewards=[[1.0, 1.0]] * 3,
        advantages=means[:3],
        token_advantages=per_token[:3],
    )
    samples = flatten([scored])
    mb = collate(samples, pad_id=0, mask_truncated=False)
    c = mb.num_completion_tokens
    assert mb.advantages.shape == (3, c) == mb.completion_mask.shape
    for row, completion in enumerate(completions[:3]):
        n = len(completion.token_ids)
        torch.testing.assert_close(mb.advantages[row, :n], torch.tensor(per_token[row]))
        assert (mb.advantages[row, n:] == 0).all()
    # a single-advantage row in the same micro-batch repeats its value along the row
    plain = flatten([ScoredGroup(RolloutGroup(prompt, completions[3:4]), [[1.0, 1.0]], [0.25])])
    mixed = collate([samples[0], plain[0]], pad_id=0, mask_truncated=False)
    assert (mixed.advantages[1] == 0.25).all()


def test_a_turn_credited_completion_has_signal_though_its_mean_is_zero() -> None:
    from grpo_core.optimization.batch import Sample

    balanced = Sample(prompt_ids=[1], completion_ids=[2, 3], advantage=0.0, token_advantages=[1.0, -1.0])
    assert balanced.has_signal
    assert not Sample(prompt_ids=[1], completion_ids=[2, 3], advantage=0.0, token_advantages=[0.0, 0.0]).has_signal
    prompt = Prompt(prompt="p", prompt_ids=[1])
    group = ScoredGroup(RolloutGroup(prompt, [Completion([2, 3], "")]), [[1.0]], [0.0], token_advantages=[[1.0, -1.0]])
    assert group.has_signal


def test_a_contract_breaking_aggregation_is_named() -> None:
    from grpo_core.contract.errors import PluginError
    from grpo_core.generation.producer import per_completion_advantages

    _, completions = hand_batch()
    with pytest.raises(PluginError, match="completion 0 got 2 per-token advantages for 10 tokens"):
        per_completion_advantages([[0.0, 0.0]] * 6, completions)
    with pytest.raises(PluginError, match="returned dict"):
        per_completion_advantages({}, completions)
    assert per_completion_advantages([0.5] * 6, completions) == ([0.5] * 6, None)


def test_the_loss_trains_each_turn_with_its_own_advantage() -> None:
    """policy_loss with [B, C] advantages (dapo, on-policy): d loss / d logp
    of each policy token is -A_token / tokens, so each turn's tokens move by
    their own turn's advantage."""
    from grpo_core.optimization.loss import LossSettings, policy_loss

    advantages = torch.tensor([[0.7, 0.7, 0.0, 1.4], [-1.1, 0.0, -1.4, -1.4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]])
    logps = torch.full((2, 4), -1.0, requires_grad=True)
    loss, _ = policy_loss(LossSettings(loss_type="dapo"), logps, advantages, mask)
    loss.backward()
    torch.testing.assert_close(logps.grad, -advantages * mask / mask.sum())


# ---------------------------------------------------------------- refusals before training


def _config(tmp_path, **over):
    from grpo_core.config.loader import validate

    return validate(merged(minimal_config(plugins={"advantage_aggregation": "turn_returns"}), **over))


def test_config_check_refuses_turn_credit_by_name(tmp_path) -> None:
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    with pytest.raises(ConfigError, match="'turn_returns' credits each turn.*this run is single-turn"):
        check_run_config(_config(tmp_path))
    tool = [
        "def add(a: int, b: int) -> int:",
        "    '''Add.",
        "",
        "    Args:",
        "        a: x",
        "        b: y",
        "    '''",
    ]
    (tmp_path / "my_tools.py").write_text("\n".join([*tool, "    return a + b", ""]))
    with pytest.raises(ConfigError, match="environment 'tools'.*does not declare turn_rewards"):
        check_run_config(_config(tmp_path, trl={"tools": ["my_tools.add"]}))
    openenv = {"plugins": {"environment": "openenv", "openenv": {"base_url": "http://127.0.0.1:9"}}}
    check_run_config(_config(tmp_path, **openenv))  # an environment whose replies carry rewards: accepted
    with pytest.raises(ConfigError, match="policy loss 'liger'.*cannot take: set trl.use_liger_loss = false"):
        check_run_config(_config(tmp_path, trl={"use_liger_loss": True}, **openenv))


def test_agent_episodes_with_turn_credit_are_refused_by_name(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent returns one reward per episode, never one per turn: turn
    credit is refused naming the agent environment, alone or beside an
    environment that does give per-turn rewards (each is checked)."""
    from grpo_core.contract.errors import ConfigError
    from grpo_core.validation.run_check import check_run_config

    (tmp_path / "my_agent.py").write_text("def run(row, *, base_url, api_key, model):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    agent = {"environment": "agent", "agent": {"function": "my_agent.run"}}
    with pytest.raises(ConfigError, match="environment 'agent'.*does not declare turn_rewards.*an agent's episodes"):
        check_run_config(_config(tmp_path, plugins=agent, trl={"reward_funcs": ["environment"]}))
    mixed = {
        "environment": ["openenv", "agent"],
        "openenv": {"base_url": "http://127.0.0.1:9"},
        "agent": {"function": "my_agent.run"},
    }
    with pytest.raises(ConfigError) as refused:
        check_run_config(_config(tmp_path, plugins=mixed))
    assert "environment 'agent'" in str(refused.value)
    assert "environment 'openenv'" not in str(refused.value)  # its replies carry rewards: not refused


def test_the_environment_reward_function_must_be_listed(tmp_path) -> None:
    """An environment declaring turn_rewards but not provides_reward gets no
    ``environment`` reward function added: the check names the fix."""
    from grpo_core.validation.checks import _turn_credit_checks
    from grpo_plugins.policy_loss import GRPOPolicyLoss

    class Quiet:  # episodic, per-turn rewards, but no environment reward function of its own
        turn_rewards = True

    classes = {
        "advantage_aggregation": (SimpleNamespace(name="turn_returns"), TurnReturns),
        "environment": (SimpleNamespace(name="quiet"), Quiet),
        "policy_loss": (SimpleNamespace(name="grpo"), GRPOPolicyLoss),
    }
    errors: list[str] = []
    _turn_credit_checks(_config(tmp_path), classes, errors)
    assert errors == [
        "plugins.advantage_aggregation = 'turn_returns' reads the per-turn rewards through the 'environment' reward "
        "function, which trl.reward_funcs does not list: add 'environment' to trl.reward_funcs."
    ]


# ---------------------------------------------------------------- what the episode driver records


def test_the_driver_records_each_turns_start_and_reward() -> None:
    """Through the real driver with a scripted rollout: turn starts index the
    completion's token_ids (after its own prompt tail), each reply's reward
    lands on the turn it answered, a turn without a reward is None."""
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.contract.types import EnvironmentReply, SamplingSettings
    from grpo_core.generation.episodes import EpisodeDriver

    class Tok:
        all_special_ids: list[int] = []

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
            text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
            return text + ("<assistant>" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

        def decode(self, ids, skip_special_tokens=True, **kw):
            return "".join(chr(i) for i in ids)

    class Game:
        def __init__(self):
            self.turn = 0

        def reset(self):
            return None

        def step(self, text):
            self.turn += 1
            if self.turn == 1:
                return EnvironmentReply(messages=[{"role": "user", "content": "h"}], reward=0.25)
            if self.turn == 2:
                return EnvironmentReply(messages=[{"role": "user", "content": "l"}])
            return EnvironmentReply(done=True, reward=1.0)

    def generate(prompts, n, sampling):
        return [RolloutGroup(p, [Completion([ord("x"), ord("y")], "xy") for _ in range(n)]) for p in prompts]

    tok = Tok()
    cfg = GRPOConfig(base_model="m", episodes={"max_turns": 5})
    driver = EpisodeDriver(lambda p, s: Game(), tok, cfg, "game", lambda m: None, concurrent_turns=False)
    prompt = Prompt(prompt=[{"role": "user", "content": "go"}], prompt_ids=tok("<user>go|<assistant>")["input_ids"])
    (group,) = driver.run([prompt], 2, SamplingSettings(max_tokens=200), generate)
    for c in group.completions:
        stats = c.episode
        assert stats.turns == 3 and stats.turn_rewards == [0.25, None, 1.0] and stats.reward == 1.25
        for start in stats.turn_starts:
            assert c.token_ids[start : start + 2] == [ord("x"), ord("y")] and c.loss_mask[start : start + 2] == [1, 1]
        assert c.loss_mask[stats.turn_starts[0] + 2] == 0  # the reply follows the turn


def test_guess_number_rewards_each_guess_the_hints_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/guess-number's ``hint_reward``: a per-turn reward at each guess
    inside what the hints so far allow, the win on top; 0 by default (the
    game as before)."""
    import sys

    monkeypatch.syspath_prepend(str(REPO / "examples" / "guess-number" / "src"))
    try:  # from the source tree, and forgotten after: other tests install the package and import it
        from grpo_guess_number import GuessEpisode, GuessNumber, Settings
    finally:
        sys.modules.pop("grpo_guess_number", None)

    assert GuessNumber.turn_rewards is True
    game = GuessEpisode(10, Settings(hint_reward=0.2, turn_penalty=0.1))
    replies = [game.step(text) for text in ("5", "3", "12", "no idea", "10")]
    assert [r.reward for r in replies] == [0.2, 0.0, 0.2, None, pytest.approx(1.0 - 0.3 + 0.2)]
    assert [r.messages[0]["content"] for r in replies[:4]] == [
        "Higher.",
        "Higher.",
        "Lower.",
        "Answer with one number.",
    ]
    assert replies[-1].done
    plain = GuessEpisode(10, Settings())
    assert [plain.step(t).reward for t in ("5", "10")] == [0.0, pytest.approx(0.9)]  # the second guess: 1 - 0.1

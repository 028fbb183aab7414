"""The pure helpers of benchmarks/bench_episodes_vs_trl.py and its game."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import REPO

BENCH = REPO / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a dataclass resolves its string annotations through its module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


bench = _load("bench_episodes_vs_trl")
env = _load("episode_guess_env")


def test_moving_mean_crossing_waits_for_a_full_window():
    rewards, seconds = [0.9, 0.1, 0.2, 0.8, 0.9, 0.7], [10.0] * 6
    # step 1 alone is 0.9, but the first full window (steps 1-3) is 0.4
    assert bench.moving_mean_crossing(rewards, seconds, 0.6, 3) == (5, 50.0)
    assert bench.moving_mean_crossing(rewards, seconds, 0.95, 3) is None
    assert bench.moving_mean_crossing(rewards, seconds, 0.9, 1) == (1, 10.0)


def test_summarise_keeps_steps_that_skipped_completions_out_of_the_mean():
    steps = [
        {"seconds": 99.0, "model_tokens": 100, "turns": 10, "episodes": 16},  # warm-up
        {"seconds": 10.0, "model_tokens": 500, "turns": 20, "episodes": 16},
        {"seconds": 4.0, "model_tokens": 500, "turns": 20, "episodes": 16, "skipped": 8},
        {"seconds": 20.0, "model_tokens": 1500, "turns": 40, "episodes": 16, "skipped": 0},
    ]
    s = bench.summarise(steps)
    full = s["trained_every_completion"]
    assert full["steps"] == 2 and full["sec_per_step"] == pytest.approx(15.0)
    assert full["sec_per_1k_model_tokens"] == pytest.approx(1000 * 30 / 2000)
    assert full["turns_per_step"] == pytest.approx(30.0)
    assert s["left_completions_out"]["steps"] == 1 and s["skipped_completions"] == 8


def test_rows_demonstrate_calls_in_the_template_form_and_suffix_only_the_system():
    rows = bench.game_rows(5, seed=1)
    assert rows == bench.game_rows(5, seed=1) and all(1 <= r["secret"] <= 16 for r in rows)
    assert (
        rows[0]["prompt"][2]["content"]
        == 'I guess 8.\n<tool_call>\n{"name": "guess", "arguments": {"number": 8}}\n</tool_call>'
    )
    suffixed = bench.with_system_suffix(rows, "TOOLS")
    assert suffixed[0]["prompt"][0]["content"].endswith("\n\nTOOLS")
    assert suffixed[0]["prompt"][1:] == rows[0]["prompt"][1:]
    assert not rows[0]["prompt"][0]["content"].endswith("TOOLS")  # the input is left alone


def test_game_answers_and_scores():
    game = env.GuessNumberEnv()
    assert game.reset(secret=6, prompt=[]) is None
    assert game.get_reward() == 0.0
    assert [game.guess(8), game.guess(4), game.guess(6)] == ["Lower.", "Higher.", "Correct!"]
    assert game.get_reward() == pytest.approx(0.8)
    game.reset(secret=16)
    game.guess(1)
    assert game.get_reward() == pytest.approx(0.0)
    game.guess(13)
    assert game.get_reward() == pytest.approx(0.5 * (1 - 3 / 15))


def test_calculator_rows_demonstrate_other_operations_and_keep_the_answer():
    rows = bench.calculator_rows(4, seed=3)
    assert rows == bench.calculator_rows(4, seed=3) and len(rows) == 4
    prompt = rows[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert (
        prompt[2]["content"]
        == '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 34"}}\n</tool_call>'
    )
    question = prompt[-1]["content"]
    a, b = (int(x) for x in question.split("What is ")[1].split("?")[0].split(" * "))
    assert int(rows[0]["answer"]) == a * b  # the training set's own row, answer kept for the reward


def _args(**kw):
    import argparse

    base = {"trl_budget_factor": None, "trl_budget": None, "threshold": 0.6, "window": 2}
    return argparse.Namespace(**{**base, **kw})


def test_trls_budget_is_a_multiple_of_grpos_time_to_the_threshold():
    grpo = {
        "steps": [{"seconds": 10.0, "reward": 0.2}, {"seconds": 20.0, "reward": 0.9}, {"seconds": 30.0, "reward": 0.9}]
    }
    assert bench.trl_budget(grpo, _args()) is None  # no factor: TRL runs --steps
    assert bench.trl_budget(grpo, _args(trl_budget_factor=3)) == pytest.approx(3 * 60.0)  # crossed at step 3 (window 2)
    never = {"steps": [{"seconds": 10.0, "reward": 0.1}, {"seconds": 20.0, "reward": 0.1}]}
    assert bench.trl_budget(never, _args(trl_budget_factor=2)) == pytest.approx(60.0)  # all of grpo's steps
    assert bench.trl_budget(None, _args(trl_budget_factor=2)) is None  # TRL ran first


def test_trl_stops_when_its_budget_is_spent_or_it_crossed():
    a = _args(trl_budget=100.0)
    assert not bench.budget_spent([{"seconds": 60.0, "reward": 0.1}], a)
    assert bench.budget_spent([{"seconds": 60.0, "reward": 0.1}, {"seconds": 50.0, "reward": 0.1}], a)
    assert bench.budget_spent([{"seconds": 10.0, "reward": 0.7}, {"seconds": 10.0, "reward": 0.7}], a)
    assert not bench.budget_spent([{"seconds": 600.0, "reward": 0.1}], _args())  # no budget: never stops early


def test_the_threshold_ratio_is_a_bound_when_trl_never_got_there():
    grpo = {"threshold": (5, 100.0)}
    assert bench.threshold_ratio({"grpo": grpo, "trl": {"threshold": (4, 450.0), "raw": []}}) == [
        "time to the threshold: TRL 450 s / grpo 100 s = 4.50x"
    ]
    bound = bench.threshold_ratio(
        {"grpo": grpo, "trl": {"threshold": None, "raw": [{"seconds": 200.0}, {"seconds": 150.0}]}}
    )
    assert bound == ["time to the threshold: grpo 100 s; TRL not there after 350 s of steps, so at least 3.50x"]
    assert bench.threshold_ratio({"grpo": {"threshold": None}, "trl": {"threshold": (1, 9.0), "raw": []}}) == []

"""Reward resolution, calling convention, validation and subprocess workers.

Everything is real: the plugin host reads the installed entry points, the
reward module is a real file imported from a directory on sys.path, workers
are real spawned processes, and the reward model is a real (tiny, randomly
initialised) LlamaForSequenceClassification saved to disk.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, DataError, PluginError, RewardError
from grpo_core.contract.types import Completion, Prompt, RolloutGroup
from grpo_core.host.plugin_host import PluginHost
from grpo_core.scoring.rewards import RewardScorer
from grpo_plugins.rewards.builtin import last_number_match, think_answer_format

REWARD_MODULE = """
import asyncio, math, os, signal, time

RECORDED = []

def exact(completions, answer, **kwargs):
    return [1.0 if (c[0]["content"] if isinstance(c, list) else c) == a else 0.0 for c, a in zip(completions, answer)]

def record(prompts, completions, completion_ids, answer, **kwargs):
    RECORDED.append(
        dict(
            prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, extra=sorted(kwargs)
        )
    )
    return [float(len(ids)) for ids in completion_ids]

def length(completions, **kwargs):
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]

async def slow_async_a(completions, **kwargs):
    await asyncio.sleep(0.6)
    return [1.0] * len(completions)

async def slow_async_b(completions, **kwargs):
    await asyncio.sleep(0.6)
    return [2.0] * len(completions)

def alarm_pid(completions, **kwargs):
    # signal.signal/alarm only work in a main thread (like math_verify's timeouts).
    def on_alarm(signum, frame):
        raise TimeoutError("alarm")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(5)
    try:
        return [float(os.getpid())] * len(completions)
    finally:
        signal.alarm(0)

def sleeps(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)

def dies(completions, **kwargs):
    os._exit(7)

def wrong_len(completions, **kwargs):
    return [1.0]

def nan_first(completions, **kwargs):
    return [math.nan] + [0.5] * (len(completions) - 1)

def words(completions, **kwargs):
    return ["high"] * len(completions)

def boom(completions, **kwargs):
    raise RuntimeError("kaboom")

def needs_reference(completions, reference, **kwargs):
    return [0.0] * len(completions)

def abstains(completions, **kwargs):
    return [None] * len(completions)

def math_verified(completions, answer, **kwargs):
    # The reference's recommended reward: math-verify (signal.alarm inside parse/verify).
    from math_verify import parse, verify
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if verify(parse(a), parse(t)) else 0.0 for t, a in zip(texts, answer)]

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewards_mod")
    pkg = root / "rw_pkg" / "inner"
    pkg.mkdir(parents=True)
    (root / "rw_pkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "fns.py").write_text(textwrap.dedent(REWARD_MODULE))
    import sys

    sys.path.insert(0, str(root))  # spawned workers inherit the parent's sys.path
    yield root
    sys.path.remove(str(root))


M = "rw_pkg.inner.fns."


def scorer_for(funcs, tmp_path=Path("."), **trl):
    cfg = validate({"base_model": "unused/model", "trl": {"reward_funcs": funcs, **trl}})
    return RewardScorer(cfg, PluginHost(), RunContext(config=cfg, output_dir=tmp_path))


def groups(texts_per_group, conversational=False, answers=None):
    out = []
    for g, texts in enumerate(texts_per_group):
        prompt = [{"role": "user", "content": f"question {g}"}] if conversational else f"question {g}"
        columns = {"answer": (answers or [str(g)] * len(texts_per_group))[g], "extra_col": g}
        completions = [Completion(token_ids=list(range(len(t))), text=t) for t in texts]
        out.append(RolloutGroup(Prompt(prompt=prompt, prompt_ids=[1, 2], columns=columns), completions))
    return out


# ----------------------------------------------------------------------------- builtin functions


def test_builtin_last_number_match():
    comps = ["so 2 + 3 = 5", "the answer is 5.0 not 6", "[{}]", "answer: 1,000", "-4"]
    assert last_number_match(completions=comps, answer=["5", "5", "5", "1000", -4]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    conv = [[{"role": "assistant", "content": "It is 12."}]]
    assert last_number_match(completions=conv, answer=[12]) == [1.0]


def test_builtin_think_answer_format():
    comps = [
        "<think>a</think><answer>1</answer>",
        "<think>a</think>",
        "<answer>1</answer><think>x",
        "<think>\nx\n</think> <answer>2</answer>",
    ]
    assert think_answer_format(completions=comps) == [1.0, 0.0, 0.0, 1.0]


# ----------------------------------------------------------------------------- resolution


def test_named_and_imported_functions_resolve(reward_dir):
    scorer = scorer_for(["last_number_match", M + "length"], reward_weights=[1.0, 0.25])
    assert scorer.names == ["last_number_match", "length"]
    assert scorer.weights == [1.0, 0.25]
    assert scorer_for([M + "length", "think_answer_format"]).weights == [1.0, 1.0]


def test_weights_length_checked(reward_dir):
    with pytest.raises(ConfigError, match="reward_weights has 1 weight.*reward_funcs has 2"):
        scorer_for([M + "length", M + "exact"], reward_weights=[1.0])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module.fn", "cannot resolve reward function 'no_such_module.fn'"),
        (M + "missing_fn", "has no attribute 'missing_fn'"),
        (M + "NOT_CALLABLE", "is a int, not a function"),
    ],
)
def test_unresolvable_specs(reward_dir, spec, match):
    with pytest.raises(PluginError, match=match):
        scorer_for([spec])


def test_check_columns(reward_dir):
    scorer = scorer_for([M + "exact", M + "needs_reference", "last_number_match"])
    scorer.check_columns({"answer", "reference"})
    with pytest.raises(
        DataError, match=r"'needs_reference' needs column\(s\) \['reference'\].*The dataset has: answer"
    ):
        scorer.check_columns({"answer"})


# ----------------------------------------------------------------------------- calling convention


def test_score_shape_and_conversational_convention(reward_dir):
    import rw_pkg.inner.fns as fns

    fns.RECORDED.clear()
    scorer = scorer_for([M + "record", M + "exact", M + "abstains"])
    batch = groups([["0", "x1"], ["no", "1", "1"]], conversational=True)
    scores = scorer.score(batch, step=4)
    assert scores == [[[1.0, 1.0, None], [2.0, 0.0, None]], [[2.0, 0.0, None], [1.0, 1.0, None], [1.0, 1.0, None]]]
    call = fns.RECORDED[-1]
    assert call["completions"][1] == [{"role": "assistant", "content": "x1"}]
    assert call["prompts"][2] == [{"role": "user", "content": "question 1"}]
    assert call["answer"] == ["0", "0", "1", "1", "1"]
    assert call["extra"] == ["extra_col"]
    assert call["completion_ids"][1] == [0, 1]


def test_plain_text_completions_are_strings(reward_dir):
    import rw_pkg.inner.fns as fns

    fns.RECORDED.clear()
    scorer_for([M + "record"]).score(groups([["abc"]]), step=0)
    assert fns.RECORDED[-1]["completions"] == ["abc"] and fns.RECORDED[-1]["prompts"] == ["question 0"]


def test_async_functions_run_concurrently(reward_dir):
    scorer = scorer_for([M + "slow_async_a", M + "length", M + "slow_async_b"])
    start = time.monotonic()
    scores = scorer.score(groups([["ab", "c"]]), step=1)
    elapsed = time.monotonic() - start
    assert scores == [[[1.0, 2.0, 2.0], [1.0, 1.0, 2.0]]]
    assert elapsed < 1.1, f"two 0.6 s async functions took {elapsed:.2f}s: not concurrent"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("wrong_len", r"returned 1 values for 3 completions \(one per completion expected\)"),
        ("nan_first", "returned nan as value 0"),
        ("words", r"returned a non-number \(str 'high'\) as value 0"),
        ("boom", "raised RuntimeError: kaboom"),
    ],
)
def test_bad_rewards_raise_naming_function_step_and_sample(reward_dir, name, problem):
    scorer = scorer_for([M + name])
    with pytest.raises(
        RewardError,
        match=rf"reward function '{name}' {problem}[^.]* at step 3\. Sample 0: prompt 'question 0', completion 'first'",
    ):
        scorer.score(groups([["first", "second", "third"]]), step=3)


def test_error_policy_none_scores_none_with_warning(reward_dir):
    scorer = scorer_for([M + "length", M + "nan_first", M + "boom"], reward_error_policy="none")
    with pytest.warns(UserWarning) as caught:
        scores = scorer.score(groups([["ab", "cde"]]), step=2)
    assert scores == [[[2.0, None, None], [3.0, 0.5, None]]]
    messages = " | ".join(str(w.message) for w in caught)
    assert "'nan_first'" in messages and "'boom'" in messages and "Scored None" in messages


# ----------------------------------------------------------------------------- workers


def test_workers_run_in_subprocesses_where_signal_alarm_works(reward_dir, tmp_path):
    with scorer_for([M + "alarm_pid", M + "length"], tmp_path, reward_num_workers=2) as scorer:
        scores = scorer.score(groups([["a"], ["bb", "c"], ["ddd"], ["e"]]), step=0)
        pids = [row[0] for group in scores for row in group]
        assert all(pid != float(os.getpid()) for pid in pids)
        # Sharded by prompt group: groups 0-1 on one worker, 2-3 on the other.
        assert pids[0] == pids[1] == pids[2] and pids[3] == pids[4] and pids[0] != pids[3]
        assert [row[1] for group in scores for row in group] == [1.0, 2.0, 1.0, 3.0, 1.0]
        again = scorer.score(groups([["a"], ["b"]]), step=1)  # workers are reused
        assert {row[0] for group in again for row in group} <= set(pids)
        workers = [w.process for w in scorer._pool._workers if w is not None]
    assert len(workers) == 2 and not any(p.is_alive() for p in workers)  # close() stopped them


def test_signal_alarm_fails_off_the_main_thread(reward_dir):
    """Why workers exist: the same function cannot run in a helper thread."""
    import threading

    scorer = scorer_for([M + "alarm_pid"])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_score_or_error(scorer)))
    thread.start()
    thread.join()
    assert "signal only works in main thread" in errors[0]


def test_async_prefetch_runs_math_verify_with_no_setting(reward_dir, tmp_path):
    """With async_prefetch the producer scores in its background thread;
    math_verify there raises ("doesn't support threaded environment"). grpo
    picks a worker process by itself, with no reward setting given."""
    import threading

    pytest.importorskip("math_verify")  # in the test extra
    with scorer_for([M + "math_verified"], tmp_path, async_prefetch=True) as scorer:
        box = []
        scoring = groups([["The answer is $\\frac{1}{2}$", "0.5", "2"], ["$4$", "five"]], answers=["1/2", "4"])

        def score() -> None:
            try:
                box.append(scorer.score(scoring, step=0))
            except RewardError as exc:
                box.append(str(exc))

        thread = threading.Thread(target=score)
        thread.start()
        thread.join()
        assert box == [[[[1.0], [1.0], [0.0]], [[1.0], [0.0]]]], box
        assert scorer._pool is not None


def _score_or_error(scorer):
    try:
        scorer.score(groups([["a"]]), step=0)
    except RewardError as exc:
        return str(exc)
    return ""


def test_timeout_kills_worker_and_names_function(reward_dir, tmp_path):
    with scorer_for([M + "length", M + "sleeps"], tmp_path, reward_timeout=1.5) as scorer:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"'sleeps' took longer than trl.reward_timeout = 1.5s.*at step 5"):
            scorer.score(groups([["ab"]]), step=5)
        assert time.monotonic() - start < 30
    with scorer_for([M + "length", M + "sleeps"], tmp_path, reward_timeout=1.5, reward_error_policy="none") as scorer:
        with pytest.warns(UserWarning, match="'sleeps' took longer"):
            assert scorer.score(groups([["ab"]]), step=6) == [[[2.0, None]]]
        # The killed worker is replaced on the next call.
        with pytest.warns(UserWarning, match="'sleeps' took longer"):
            assert scorer.score(groups([["abc"]]), step=7) == [[[3.0, None]]]


def test_dead_worker_is_a_reward_error(reward_dir, tmp_path):
    with scorer_for([M + "dies"], tmp_path, reward_num_workers=2) as scorer:
        for step in (0, 1):  # and again: the dead workers were replaced
            with pytest.raises(
                RewardError, match=rf"'dies' crashed: its reward worker process died \(exit code 7\) at step {step}"
            ):
                scorer.score(groups([["a"], ["b"]]), step=step)


def test_worker_validation_errors_come_back(reward_dir, tmp_path):
    with scorer_for([M + "wrong_len"], tmp_path, reward_num_workers=2) as scorer:
        with pytest.raises(
            RewardError,
            match=r"'wrong_len' returned 1 values for 2 completions \(one per completion expected\) at step 9",
        ):
            scorer.score(groups([["a", "b"], ["c", "d"]]), step=9)


# ----------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory, smollm2_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=smollm2_tokenizer.pad_token_id,
    )
    model = LlamaForSequenceClassification(config)
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return out


def test_reward_model_directory_scores_text(tiny_reward_model, tmp_path):
    scorer = scorer_for([str(tiny_reward_model)], tmp_path)
    assert scorer.names == ["tiny-rm"]
    texts = ["The answer is 4.", "I like turtles very much", "The answer is 4."]
    plain = scorer.score(groups([texts]), step=0)[0]
    values = [row[0] for row in plain]
    assert all(isinstance(v, float) for v in values)
    assert values[0] == pytest.approx(values[2], abs=1e-5)  # same text, same score (padding does not leak)
    assert values[0] != pytest.approx(values[1], abs=1e-6)  # different text, different score
    conv = [row[0] for row in scorer.score(groups([texts], conversational=True), step=0)[0]]
    assert conv[0] != pytest.approx(values[0], abs=1e-6)  # the chat template changes the input


def test_causal_lm_directory_is_not_a_reward_model(smollm2_dir, tmp_path):
    with pytest.raises(PluginError, match="not a sequence-classification"):
        scorer_for([smollm2_dir], tmp_path)


def test_hub_reward_model_offline_is_a_clear_error(tmp_path):
    with pytest.raises(PluginError, match="looks like a hub id of a reward model.*local directory"):
        scorer_for(["SomeOrg/some-reward-model"], tmp_path)

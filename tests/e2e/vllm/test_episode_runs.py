"""Whole training runs with multi-turn episodes, through the real vLLM server.

Each way an episode can come to be trains a real run here: ``trl.tools``,
TRL's ``trl.environment_factory`` (with ``get_reward`` and a reward
function that reads ``environments=``), and an ``environment`` plugin
installed the way a user installs one (pip, into a private folder). The
faults (an environment that raises, one that hangs, tool calls that are
malformed or raise) each end only their own episode, and the run goes on.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, merged, metrics, no_traceback
from vllm_session import server_run

from grpo_core.config.loader import validate
from grpo_core.config.schema import GRPOConfig
from grpo_core.host import plugin_host
from grpo_core.training.run import run_training

pytestmark = pytest.mark.vllm

ROOT = REPO
CALCULATOR = ROOT / "examples" / "calculator"
GUESS = ROOT / "examples" / "guess-number"
FAULTS = ROOT / "tests" / "plugin_packages" / "grpo-env-faults"


def episode_config(smollm2_dir: str, workdir: Path, base_url: str, data: Path, **tables: object) -> dict:
    """A 1-step LoRA run of 2 prompts x 4 episodes of up to 3 turns, sampled by the server at ``base_url``;
    output in ``workdir/out``; ``tables`` as ``helpers.merged`` takes them. One step: what these runs check
    is each episode's plumbing; a second step would sample the same way through the synced adapter, which
    the runs that set ``max_steps`` (prefetch and resume, rollout_func) and tests/e2e/vllm/test_vllm_training.py
    check."""
    base = server_run(
        smollm2_dir,
        workdir,
        base_url,
        data,
        sequence_len=512,
        micro_batch_size=8,
        gradient_accumulation_steps=1,
        max_steps=1,
        learning_rate=1e-4,
        seed=5,
        episodes={"max_turns": 3, "max_tokens_per_turn": 24},
        trl={"num_generations": 4, "max_completion_length": 96},
    )
    return merged(base, **tables)


EpisodeRun = Callable[..., tuple[GRPOConfig, list[dict[str, Any]]]]


@pytest.fixture
def episode_run(vllm_server, smollm2_dir: str, tmp_path: Path) -> EpisodeRun:
    """``episode_run(data, *folders, **tables)`` -> ``(cfg, metrics rows)``: ``episode_config``'s run in the
    test's ``tmp_path``, trained to completion with ``folders`` importable (``importable``)."""

    def run(data: Path, *folders: Path, **tables: object) -> tuple[GRPOConfig, list[dict[str, Any]]]:
        cfg = validate(episode_config(smollm2_dir, tmp_path, vllm_server.base_url, data, **tables))
        with importable(*folders):
            assert run_training(cfg) == "completed"
        return cfg, metrics(tmp_path / "out")

    return run


USER_MODULES = ("calculator", "rewards", "guess_env", "two_turns", "killer", "grpo_guess_number", "grpo_env_faults")


@contextmanager
def importable(*folders: Path) -> Iterator[None]:
    """Folders on sys.path (user modules, an installed plugin's site), and
    the entry points they publish visible; forgotten afterwards."""

    def forget() -> None:  # e.g. another example's `rewards`, imported by an earlier test
        for name in [m for m in sys.modules if m.split(".")[0] in USER_MODULES]:
            del sys.modules[name]

    forget()
    for folder in folders:
        sys.path.insert(0, str(folder))
    plugin_host.rescan()
    try:
        yield
    finally:
        for folder in folders:
            sys.path.remove(str(folder))
        forget()
        plugin_host.rescan()


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guess-number example and the fault environments, pip-installed into one private folder."""
    from pip_target import install_into_target

    root = tmp_path_factory.mktemp("env-plugins")
    site = install_into_target(GUESS, root / "guess")
    faults = install_into_target(FAULTS, root / "faults")
    for entry in faults.iterdir():
        shutil.move(str(entry), str(site / entry.name))
    return site


def test_tools_run_with_the_calculator(episode_run: EpisodeRun) -> None:
    _, rows = episode_run(
        CALCULATOR / "data" / "train.jsonl",
        CALCULATOR,
        trl={
            "tools": ["calculator.calculate"],
            "max_tool_calling_iterations": 2,
            "reward_funcs": ["rewards.final_answer_correct"],
        },
        plugins={"tools": {"format": "python"}},
    )
    assert len(rows) == 1
    for row in rows:
        assert row["episodes/turns_mean"] >= 1 and "episodes/tool_calls_mean" in row
        assert "rewards/final_answer_correct/mean" in row and row["episodes/errors"] == 0
        assert row["episodes/model_tokens_mean"] > 0


def test_malformed_and_failing_tool_calls_are_answered_and_counted(episode_run: EpisodeRun) -> None:
    # Guided decoding makes every turn a tool call: half cannot be parsed, half raise in the tool.
    _, rows = episode_run(
        CALCULATOR / "data" / "train.jsonl",
        CALCULATOR,
        trl={
            "tools": ["calculator.calculate"],
            "max_tool_calling_iterations": 1,
            "reward_funcs": ["rewards.final_answer_correct"],
            "vllm_guided_decoding_regex": (
                r'<tool_call>(calculate\(expression="1/0"\)|calculate\(expression=)</tool_call>'
            ),
        },
        plugins={"tools": {"format": "python"}},
    )
    for row in rows:
        episodes = 8
        assert row["episodes/tool_calls_mean"] == 1.0  # one round each, then the limit ends the episode
        assert row["episodes/tool_failures"] == episodes  # every call was answered with an error, none crashed
        assert row["episodes/turns_mean"] == 2.0 and row["episodes/ended_by_environment"] == 1.0


GUESS_ENV = '''
class GuessGame:
    """TRL-style environment: reset(**row), a tool method, get_reward()."""

    def reset(self, secret, **row):
        self.secret, self.guesses = int(secret), []
        return " You may call guess(n) to try a number."

    def guess(self, n: int) -> str:
        """Try a number.

        Args:
            n: The number to try.
        """
        self.guesses.append(int(n))
        return "correct" if int(n) == self.secret else ("higher" if int(n) < self.secret else "lower")

    def get_reward(self):
        return 1.0 if self.secret in self.guesses else 0.0


def guesses_made(completions, environments, **kwargs):
    return [float(len(env.guesses)) for env in environments]
'''


def test_trl_environment_factory_trains_with_get_reward_and_environments(
    episode_run: EpisodeRun, tmp_path: Path
) -> None:
    (tmp_path / "guess_env.py").write_text(GUESS_ENV)
    cfg, rows = episode_run(
        GUESS / "data" / "train.jsonl",
        tmp_path,
        trl={
            "environment_factory": "guess_env.GuessGame",
            "reward_funcs": ["guess_env.guesses_made"],
            "reward_weights": [0.1],
            "max_tool_calling_iterations": 2,
        },
    )
    # get_reward joined the rewards as 'environment' (weight 1), beside the listed function
    assert cfg.trl.reward_funcs == ["guess_env.guesses_made", "environment"] and cfg.trl.reward_weights == [0.1, 1.0]
    for row in rows:
        assert "rewards/environment/mean" in row and "rewards/guesses_made/mean" in row
        # guesses_made read each episode's own environment: it equals the calls that ran
        assert row["rewards/guesses_made/mean"] <= row["episodes/tool_calls_mean"] + 1e-9


def test_an_installed_environment_plugin_trains(episode_run: EpisodeRun, plugin_site: Path) -> None:
    _, rows = episode_run(
        GUESS / "data" / "train.jsonl",
        plugin_site,
        plugins={"environment": "guess_number", "guess_number": {"turn_penalty": 0.2}},
        episodes={"max_turns": 4, "max_tokens_per_turn": 8},
    )
    for row in rows:
        assert "rewards/environment/mean" in row and row["episodes/turns_mean"] >= 1
        assert row["episodes/environment_tokens_mean"] > 0 or row["episodes/turns_max"] == 1


@pytest.mark.parametrize(
    "environment, ending, words",
    [
        ("raising", "error", "ValueError: the board is on fire"),
        ("hanging", "timeout", "step() took longer than [episodes] step_timeout = 3.0 s"),
    ],
)
def test_an_environment_that_fails_ends_only_its_episodes(
    episode_run: EpisodeRun,
    plugin_site: Path,
    capfd: pytest.CaptureFixture[str],
    environment: str,
    ending: str,
    words: str,
) -> None:
    _, rows = episode_run(
        GUESS / "data" / "train.jsonl",
        plugin_site,
        plugins={"environment": environment},
        episodes={"step_timeout": 3.0, "max_tokens_per_turn": 8},
    )
    printed = capfd.readouterr()
    assert words in printed.out + printed.err
    no_traceback(printed.out + printed.err)
    for row in rows:
        # sample 0 of each of the 2 prompts failed; the other 6 episodes played to the end
        assert row[f"episodes/ended_by_{ending}"] == pytest.approx(2 / 8)
        assert row["episodes/errors"] == 2 and row["episodes/ended_by_environment"] == pytest.approx(6 / 8)
        assert row["rewards/environment/mean"] == 1.0  # the failed ones scored None, not 0


def test_episodes_with_async_prefetch_streaming_replay_and_resume(
    vllm_server, smollm2_dir: str, tmp_path: Path, plugin_site: Path
) -> None:
    # async_prefetch scores in reward workers (subprocesses): the environment's reward reaches them
    # as plain data; prefetched episode batches are saved in the checkpoint and trained after the resume.
    out = tmp_path / "out"
    table = episode_config(
        smollm2_dir,
        tmp_path,
        vllm_server.base_url,
        GUESS / "data" / "train.jsonl",
        plugins={"environment": "guess_number"},
        episodes={"max_turns": 3, "max_tokens_per_turn": 6},
        trl={
            "async_prefetch": True,
            "streaming_partial_batch": True,
            "streaming_min_groups": 1,
            "replay_buffer_size": 4,
        },
        max_steps=2,
        save_steps=2,
    )
    with importable(plugin_site):
        assert run_training(validate(table)) == "completed"
        first = metrics(out)
        assert [r["step"] for r in first] == [1, 2] and all("rewards/environment/mean" in r for r in first)
        assert (out / "checkpoint-2").is_dir()
        table["max_steps"] = 3
        table["resume_from_checkpoint"] = str(out / "checkpoint-2")
        assert run_training(validate(table)) == "completed"
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["episodes/turns_mean"] >= 1


def test_the_openenv_adapter_trains_against_a_real_openenv_server(episode_run: EpisodeRun, tmp_path: Path) -> None:
    # grpo starts the OpenEnv environment server (uvicorn, a free loopback port) and stops it at
    # the end; every episode is its own WebSocket session; the server's reward is the episode's.
    pytest.importorskip("openenv")
    serve = (
        "{python} -m uvicorn openenv_guess_env:app --app-dir " + str(ROOT / "tests") + " --host {host} --port {port}"
    )
    cfg, rows = episode_run(
        GUESS / "data" / "train.jsonl",
        plugins={
            "environment": "openenv",
            "openenv": {"command": serve, "observation_field": "text", "env": {"MAX_CONCURRENT_ENVS": "16"}},
        },
        episodes={"max_turns": 3, "max_tokens_per_turn": 6},
    )
    assert cfg.trl.reward_funcs == ["environment"]
    assert len(rows) == 1
    for row in rows:
        assert row["episodes/errors"] == 0 and row["episodes/turns_mean"] >= 1
        assert "rewards/environment/mean" in row and row["episodes/environment_tokens_mean"] > 0
    assert (tmp_path / "out" / "openenv-server.log").is_file()


TWO_TURNS = '''
CALLS = []

def episodes(prompts, trainer):
    """TRL's rollout_func, sampling through the run's engine with trainer.generate:
    a model turn, an environment reply (env_mask 0), a second model turn."""
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    starts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    starts = [tok(s, add_special_tokens=False)["input_ids"] for s in starts]
    first = trainer.generate(starts, trainer.num_generations, max_tokens=6)
    CALLS.append(len(first))
    reply = tok(
        "<|im_end|>\\n<|im_start|>user\\nAgain.<|im_end|>\\n<|im_start|>assistant\\n", add_special_tokens=False
    )["input_ids"]
    second = trainer.generate([f["prompt_ids"] + f["completion_ids"] + reply for f in first], 1, max_tokens=6)
    CALLS.append(len(second))
    for f, s in zip(first, second):
        out["prompt_ids"].append(f["prompt_ids"])
        out["completion_ids"].append(f["completion_ids"] + reply + s["completion_ids"])
        out["logprobs"].append(f["logprobs"] + [0.0] * len(reply) + s["logprobs"])
        out["env_mask"].append([1] * len(f["completion_ids"]) + [0] * len(reply) + [1] * len(s["completion_ids"]))
    return out

def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
'''


def test_rollout_func_generates_through_the_engine(vllm_server, smollm2_dir: str, tmp_path: Path) -> None:
    (tmp_path / "two_turns.py").write_text(TWO_TURNS)
    out = tmp_path / "out"
    cfg = validate(
        episode_config(
            smollm2_dir,
            tmp_path,
            vllm_server.base_url,
            GUESS / "data" / "train.jsonl",
            trl={
                "rollout_func": "two_turns.episodes",
                "reward_funcs": ["two_turns.length_reward"],
                "vllm_lora_sync": True,
            },
            max_steps=2,  # step 2 samples through the adapter synced after step 1
        )
    )
    from grpo_core.config.implementations import chosen_implementations

    chosen = chosen_implementations(cfg)
    assert (chosen["rollout"], chosen["weight_sync"]) == ("vllm", "lora_filesystem")  # the engine's, synced as usual
    with importable(tmp_path):
        assert run_training(cfg) == "completed"
        import two_turns

        assert two_turns.CALLS == [8, 8, 8, 8]  # two generate calls a step, 2 prompts x 4 each, through the server
    rows = metrics(out)
    # the engine's log-probs reached the loss (the IS correction runs on them)
    assert len(rows) == 2 and any(r.get("is/importance_sampling_ratio/mean", 0) > 0 for r in rows)


KILLER = '''
import os
import signal

from grpo_plugins.environments import openenv_server

ARMED = []   # set once the first batch is scored: the next action kills the server
KILLED = []  # the pid killed
PIDS = []    # per scored batch: the server pids the episodes' last observations came from


def act(text):
    """plugins.openenv.action_function: the usual action, and kill -9 of the server's
    process group at the second batch's first step, while its episodes are in flight."""
    if ARMED and not KILLED:
        (server,) = [s for s in openenv_server._LIVE if s.process is not None]
        KILLED.append(server.pid)
        os.killpg(server.pid, signal.SIGKILL)
        server.process.wait()
    return {"message": text}


def server_pids(completions, openenv_observation=None, **kwargs):
    """A zero reward that records which server process each episode played on."""
    PIDS.append([None if o is None else o.get("pid") for o in (openenv_observation or [None] * len(completions))])
    ARMED.append(True)
    return [0.0] * len(completions)
'''


@pytest.mark.extended  # an OpenEnv server killed mid-run (~15 s each); test_environment_openenv restarts a dead one in
# the default tier
@pytest.mark.parametrize("restarts", ["succeed", "keep_failing"])
def test_a_killed_openenv_server_is_restarted_and_the_run_goes_on(
    vllm_server, smollm2_dir: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], restarts: str
) -> None:
    # kill -9 of the OpenEnv server in the middle of step 2's episodes: they end with an error, the
    # next episode start (step 3) restarts the server once and plays on the new process. A server
    # that then dies at every start is restarted max_restarts times and ends the run with a clear error.
    pytest.importorskip("openenv")
    from grpo_plugins.environments.openenv import OpenEnvServerLost

    (tmp_path / "killer.py").write_text(KILLER)
    if restarts == "succeed":
        serve = (
            "{python} -m uvicorn openenv_guess_env:app --app-dir "
            + str(ROOT / "tests")
            + " --host {host} --port {port}"
        )
    else:
        serve = (
            "{python} " + str(ROOT / "tests" / "openenv_flaky_server.py") + f" {tmp_path / 'started'} {{host}} {{port}}"
        )
    out = tmp_path / "out"
    cfg = validate(
        episode_config(
            smollm2_dir,
            tmp_path,
            vllm_server.base_url,
            GUESS / "data" / "train.jsonl",
            plugins={
                "environment": "openenv",
                "openenv": {
                    "command": serve,
                    "observation_field": "text",
                    "env": {"MAX_CONCURRENT_ENVS": "16"},
                    "action_function": "killer.act",
                    "max_restarts": 2,
                },
            },
            episodes={"max_turns": 2, "max_tokens_per_turn": 6},
            max_steps=3,
            trl={"reward_funcs": ["killer.server_pids", "environment"], "reward_weights": [0.0, 1.0]},
        )
    )
    with importable(tmp_path):
        import killer

        if restarts == "succeed":
            assert run_training(cfg) == "completed"
        else:
            with pytest.raises(
                OpenEnvServerLost,
                match=r"restarted 2 time\(s\) already \(plugins.openenv.max_restarts = 2\), so the run ends",
            ) as lost:
                run_training(cfg)
            assert "openenv_flaky_server.py" in str(lost.value) and "refusing to start again" in str(lost.value)
            # what was trained is kept: fix the server, resume
            assert f"Training stopped at step 2; checkpoint saved to {out / 'checkpoint-2'}" in str(lost.value)
            assert (out / "checkpoint-2").is_dir()
        pids, killed = killer.PIDS, killer.KILLED
    printed = capfd.readouterr()
    output = printed.out + printed.err
    rows = metrics(out)
    assert (
        len(killed) == 1 and f"(pid {killed[0]}) exited with code -9; restarting it (restart 1 of at most 2" in output
    )
    assert set(pids[0]) == {killed[0]}  # step 1 played on the first server
    assert rows[1]["episodes/errors"] > 0 and rows[1]["episodes/environment_restarts"] == 0  # in flight at the kill
    if restarts == "succeed":
        assert [r["step"] for r in rows] == [1, 2, 3]
        (new_pid,) = set(pids[2])
        assert new_pid not in (None, killed[0])  # step 3's episodes all played on the restarted server
        assert rows[2]["episodes/errors"] == 0 and rows[2]["episodes/environment_restarts"] == 1
        assert rows[2]["episodes/turns_mean"] >= 1 and "rewards/environment/mean" in rows[2]
    else:
        assert [r["step"] for r in rows] == [1, 2]  # step 3 never trained: the run ended
        assert output.count("restarting it (restart") == 2
    no_traceback(output)

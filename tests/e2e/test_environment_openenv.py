"""The ``openenv`` environment against a real OpenEnv server process.

``tests/openenv_guess_env.py`` is a real OpenEnv app (openenv-core's
``create_fastapi_app``), served by uvicorn in a subprocess on a free
127.0.0.1 port, started by the adapter's own ``command`` setting. Episodes
are driven the way the episode driver does: ``reset()`` once, then
``step(text)`` until ``done``, many episodes at once in threads. Nothing is
mocked.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import TESTS

pytest.importorskip("openenv.core.env_server", reason="openenv-core is not installed (pip install openenv-core)")

from grpo_core.config.loader import validate  # noqa: E402
from grpo_core.contract.context import RunContext  # noqa: E402
from grpo_core.contract.errors import ConfigError, GrpoError  # noqa: E402
from grpo_core.contract.types import EnvironmentReply, Episode, Prompt  # noqa: E402
from grpo_core.host.plugin_host import PluginHost  # noqa: E402
from grpo_plugins.environments.openenv import OpenEnvEnvironment, OpenEnvEpisode, observation_text  # noqa: E402
from grpo_plugins.environments.openenv_session import OpenEnvError, OpenEnvUnavailable  # noqa: E402

SERVE = "{python} -m uvicorn openenv_guess_env:app --app-dir " + str(TESTS) + " --host {host} --port {port}"


def config(**settings):
    return validate(
        {
            "base_model": "unused/model",
            "trl": {"reward_funcs": ["x.y"]},
            "plugins": {"environment": "openenv", "openenv": settings},
        }
    )


def load(tmp_path: Path, log: list[str] | None = None, **settings) -> OpenEnvEnvironment:
    """The adapter as a run builds it: through the plugin host, from a config."""
    context = RunContext(
        config=config(**settings), output_dir=tmp_path, log=(lambda m: None) if log is None else log.append
    )
    return PluginHost().load_implementation("environment", "openenv", context)


def prompt(index: int, **columns) -> Prompt:
    return Prompt(prompt=[{"role": "user", "content": "Play."}], prompt_ids=[1, 2, 3], columns=columns, index=index)


def play_bisect(episode: Episode) -> tuple[list[str], float, int]:
    """Play one game by bisection, as the driver would: the texts the
    environment answered, the summed reward and the number of steps."""
    first = episode.reset()
    assert isinstance(first, str) and first.startswith("Guess my number")
    low, high, seen, total, steps = 1, 20, [], 0.0, 0
    while True:
        guess = (low + high) // 2
        reply = episode.step(f"My guess is {guess}")
        steps += 1
        total += reply.reward or 0.0
        if reply.done:
            seen.append("done")
            return seen, total, steps
        (message,) = reply.messages
        assert message["role"] == "user"
        seen.append(message["content"])
        if message["content"] == "higher":
            low = guess + 1
        else:
            high = guess - 1


@pytest.fixture(scope="module")
def managed(tmp_path_factory):
    """One managed server for the module's tests that do not kill it."""
    environment = load(
        tmp_path_factory.mktemp("openenv"), command=SERVE, observation_field="text", env={"MAX_CONCURRENT_ENVS": "16"}
    )
    yield environment
    environment.close()
    assert environment.server is not None and environment.server.process is None


def test_concurrent_episodes_are_independent_sessions(managed):
    """Eight episodes (4 prompts x 2 samples) played at once in threads:
    each is its own server instance, counts only its own guesses, ends with
    done and the reward the game gave; the two samples of a prompt start
    from the same secret (same seed), so identical play gives identical
    answers, while different prompts get different secrets."""
    episodes = {(i, s): managed.grpo_environment_episode(prompt(i), s) for i in range(4) for s in range(2)}
    assert all(isinstance(e, Episode) for e in episodes.values())
    barrier = threading.Barrier(len(episodes))

    def run(episode: OpenEnvEpisode):
        barrier.wait()  # every reset and step overlaps with the others'
        try:
            return play_bisect(episode)
        finally:
            episode.close()

    with ThreadPoolExecutor(len(episodes)) as pool:
        results = dict(zip(episodes, pool.map(run, episodes.values())))
    for (i, s), (seen, total, steps) in results.items():
        episode = episodes[(i, s)]
        assert seen[-1] == "done" and episode.done
        assert total == pytest.approx(1.0 - 0.1 * (steps - 1))  # the game's rewards, summed
        assert episode.last is not None and episode.last.observation["guesses"] == steps  # its own steps only
        assert episode.last.observation["episode_id"] == f"grpo-p{i}-s{s}"
    instances = {e.last.observation["instance"] for e in episodes.values()}
    assert len(instances) == len(episodes)  # one server-side environment per episode
    for i in range(4):
        assert results[(i, 0)] == results[(i, 1)]  # same seed within the group
    assert len({tuple(results[(i, 0)][0]) for i in range(4)}) > 1  # and different ones across prompts


def test_interleaved_steps_do_not_leak_between_episodes(managed):
    """Two episodes of the same prompt stepped alternately with different
    guesses: each answer reflects that episode's own guess and count."""
    a = managed.grpo_environment_episode(prompt(7), 0)
    b = managed.grpo_environment_episode(prompt(7), 1)
    a.reset(), b.reset()
    ra = a.step("1")
    rb = b.step("20")
    rb2 = b.step("nothing")
    ra2 = a.step("1")
    try:
        assert a.last.observation["guesses"] == 2 and b.last.observation["guesses"] == 2
        assert ra.messages[0]["content"] == "higher" and rb.messages[0]["content"] == "lower"  # secret 11 (seed 7)
        assert rb2.messages[0]["content"] == "say a number" and ra2.messages[0]["content"] == "higher"
        assert a.last.observation["instance"] != b.last.observation["instance"]
    finally:
        a.close(), b.close()


def test_reset_columns_and_default_observation_text(managed, tmp_path):
    """A dataset column reaches the server's reset; without
    observation_field, a JSON observation with several text fields is shown
    whole, one with a single text field as that text."""
    plain = load(tmp_path, base_url=managed.base_url, reset_columns=["hint"], seed="none")
    episode = plain.grpo_environment_episode(prompt(1, hint="it is even"), 0)
    try:
        first = episode.reset()
        assert "Hint: it is even" in first and first.startswith("{")  # text, instance, episode_id: JSON
    finally:
        episode.close()
    assert observation_text({"text": "hi", "guesses": 3}, None) == "hi"
    with pytest.raises(OpenEnvError, match="observation_field"):
        observation_text({"text": "hi"}, "board")
    with pytest.raises(ConfigError, match="reset_columns names \\['hint'\\]"):
        plain.grpo_environment_episode(prompt(1), 0)
    with pytest.raises(
        OpenEnvError, match="prompt 1, sample 0, reset: the observation has no field 'board' .*observation_field"
    ):
        load(tmp_path, base_url=managed.base_url, observation_field="board").grpo_environment_episode(
            prompt(1), 0
        ).reset()


def test_observation_function_renders_messages(managed, tmp_path):
    """observation_function's messages: the conversation to start from at
    reset (instead of the prompt), and each step's reply as they are."""
    chat = load(tmp_path, base_url=managed.base_url, observation_function="openenv_guess_env.as_messages")
    episode = chat.grpo_environment_episode(prompt(1), 0)  # secret 5 (seed 1)
    assert episode.reset() == [{"role": "user", "content": "[0 so far] Guess my number between 1 and 20."}]
    assert episode.step("9").messages == [{"role": "user", "content": "[1 so far] lower"}]
    episode.close()


def test_an_environment_over_at_reset(managed, tmp_path):
    """An environment done at reset: the driver's first step gets done at
    once (it cannot know earlier). Past a step's done, stepping is an error."""
    over = load(tmp_path, base_url=managed.base_url, reset_columns=["over"], observation_field="text")
    episode = over.grpo_environment_episode(prompt(1, over=True), 0)
    assert episode.reset().startswith("Guess") and episode.done
    assert episode.step("7") == EnvironmentReply(done=True)
    played = over.grpo_environment_episode(prompt(1, over=False), 1)
    play_bisect(played)
    with pytest.raises(OpenEnvError, match="prompt 1, sample 1: step after the episode ended"):
        played.step("7")  # a driver that steps past done is told so


def test_a_refused_action_names_the_setting(managed, tmp_path):
    """The action field the server's Action class lacks: a sentence naming
    action_field, the server and the step, and the environment's own
    exception as 'the environment raised'."""
    wrong = load(tmp_path, base_url=managed.base_url, action_field="guess")
    episode = wrong.grpo_environment_episode(prompt(2), 0)
    episode.reset()
    with pytest.raises(OpenEnvError, match=r"prompt 2, sample 0, step 1: the server refused the action .*action_field"):
        episode.step("5")
    episode.close()
    crash = managed.grpo_environment_episode(prompt(2), 1)
    crash.reset()
    with pytest.raises(OpenEnvError, match="step 1: the environment raised: the game engine broke"):
        crash.step("CRASH")
    crash.close()


def test_action_field_from_the_schema_or_a_function(tmp_path):
    """Unset action_field: the action class's only required field, from the
    server's /schema (the module's other tests rely on it for 'message').
    Two required fields: a sentence naming them and the settings; then
    action_function builds the action and the game plays."""
    bet = SERVE.replace("openenv_guess_env:app", "openenv_guess_env:app_bet")
    ambiguous = load(tmp_path, command=bet, observation_field="text")
    try:
        with pytest.raises(
            ConfigError, match=r"action class BetAction has fields \['message', 'stake'\] \(2 required\).*action_field"
        ):
            ambiguous.grpo_environment_episode(prompt(0), 0)
        built = load(
            tmp_path,
            base_url=ambiguous.base_url,
            observation_field="text",
            action_function="openenv_guess_env.bet_action",
        )
        seen, total, steps = play_bisect(built.grpo_environment_episode(prompt(0), 0))
        assert seen[-1] == "done" and total == pytest.approx(1.0 - 0.1 * (steps - 1))
    finally:
        ambiguous.close()


def test_a_slow_step_times_out_and_ends_the_episode(managed, tmp_path):
    """A step slower than step_timeout: a sentence naming the setting; the
    episode then refuses to go on rather than reconnect to a fresh,
    un-reset environment."""
    impatient = load(tmp_path, base_url=managed.base_url, step_timeout=1.0)
    episode = impatient.grpo_environment_episode(prompt(4), 0)
    episode.reset()
    start = time.monotonic()
    with pytest.raises(OpenEnvError, match=r"step 1: no answer within 1 s \(plugins.openenv.step_timeout"):
        episode.step("SLEEP")
    assert 0.9 <= time.monotonic() - start < 2.5
    with pytest.raises(OpenEnvError, match="step 2: the session was lost at step 1, so this episode cannot go on"):
        episode.step("3")
    episode.close()


def test_capacity_is_explained_and_can_be_waited_for(tmp_path):
    """A server with one session: a second episode is refused with the fix
    (max_concurrent_envs), or, with capacity_wait, gets the slot once the
    first episode closes; an episode that reaches done frees its slot
    without waiting for close()."""
    one = load(tmp_path, command=SERVE, env={"MAX_CONCURRENT_ENVS": "1"}, observation_field="text")
    try:
        first = one.grpo_environment_episode(prompt(0), 0)
        first.reset()
        second = one.grpo_environment_episode(prompt(0), 1)
        with pytest.raises(
            OpenEnvError, match="refused a new session \\(1 of 1 in use\\).*max_concurrent_envs"
        ) as refused:
            second.reset()
        assert refused.value.code == "CAPACITY_REACHED"
        second.close()
        one.settings.capacity_wait = 10.0
        waiting = one.grpo_environment_episode(prompt(0), 1)
        threading.Timer(1.0, first.close).start()
        start = time.monotonic()
        assert waiting.reset().startswith("Guess")
        assert time.monotonic() - start >= 0.9
        one.settings.capacity_wait = 0.0
        play_bisect(waiting)  # no close(): reaching done frees the slot by itself
        third = one.grpo_environment_episode(prompt(1), 0)
        assert third.reset().startswith("Guess")
        third.close()
    finally:
        one.close()


def test_a_dead_server_is_a_clear_error_and_restarted_at_the_next_episode(tmp_path):
    """The managed server killed mid-episode: the next step fails with a
    GrpoError naming the server, the episode, the step and the exit code
    (no traceback). The next episode to start restarts the server once (a
    new process on a new port), says so in one log line, counts it in
    episodes/environment_restarts, and plays on it."""
    log: list[str] = []
    doomed = load(tmp_path, log, command=SERVE, observation_field="text")
    try:
        episode = doomed.grpo_environment_episode(prompt(5), 0)
        episode.reset()
        episode.step("3")
        first_pid, first_port = doomed.server.pid, doomed.server.port
        os.killpg(first_pid, signal.SIGKILL)
        doomed.server.process.wait(timeout=10)
        with pytest.raises(OpenEnvUnavailable) as died:
            episode.step("4")
        message = str(died.value)
        assert isinstance(died.value, GrpoError) and "Traceback" not in message
        assert f"OpenEnv server at ws://127.0.0.1:{first_port}/ws, prompt 5, sample 0, step 2" in message
        assert "exited with code -9" in message
        episode.close()  # never raises on a dead server
        metrics: dict[str, float] = {}
        doomed.grpo_step_end(metrics=metrics)
        assert metrics == {"episodes/environment_restarts": 0.0}

        starts = [doomed.grpo_environment_episode(prompt(5), s) for s in (1, 2)]  # two starts, one restart
        assert doomed.restarts == 1 and doomed.server.pid != first_pid and doomed.server.port != first_port
        restarted = [line for line in log if "restarting it" in line]
        assert restarted == [
            f"OpenEnv: the managed server (pid {first_pid}) exited with code -9; restarting it (restart 1 of at most "
            "3, plugins.openenv.max_restarts); the episodes it was playing end with an error"
        ]
        assert f"OpenEnv: server restarted at http://127.0.0.1:{doomed.server.port} (pid {doomed.server.pid})" in log
        for fresh in starts:
            seen, total, steps = play_bisect(fresh)  # on the new server
            assert seen[-1] == "done" and total == pytest.approx(1.0 - 0.1 * (steps - 1))
        doomed.grpo_step_end(metrics=metrics)
        assert metrics == {"episodes/environment_restarts": 1.0}
    finally:
        doomed.close()


@pytest.mark.extended  # waits out a hung OpenEnv server (~26 s); the dead-server restart runs in the default tier
def test_a_server_that_stops_answering_is_restarted(tmp_path):
    """A server whose process lives but answers nothing (SIGSTOP): the step
    in flight times out, and the next episode's start finds /health
    silent, kills the old process group and plays on a new server."""
    log: list[str] = []
    frozen = load(tmp_path, log, command=SERVE, observation_field="text", step_timeout=1.0, connect_timeout=3.0)
    try:
        episode = frozen.grpo_environment_episode(prompt(3), 0)
        episode.reset()
        old = frozen.server.process
        os.killpg(old.pid, signal.SIGSTOP)
        with pytest.raises(OpenEnvError, match="step 1: no answer within 1 s"):
            episode.step("3")
        episode.close()
        frozen.step_timeout = 60.0  # the new server's steps: no hurry on a loaded machine
        fresh = frozen.grpo_environment_episode(prompt(3), 1)
        assert old.poll() is not None  # the frozen process group was killed, not left behind
        assert frozen.restarts == 1 and frozen.server.pid != old.pid
        assert any(
            f"(pid {old.pid}) did not answer GET /health within 3 s" in line and "restarting it" in line for line in log
        )
        assert play_bisect(fresh)[0][-1] == "done"
    finally:
        frozen.close()


FLAKY = "{python} " + str(TESTS / "openenv_flaky_server.py") + " MARKER {host} {port}"


def test_a_server_that_dies_at_every_restart_ends_the_run(tmp_path, smollm2_tokenizer):
    """Restarts are bounded: a server that comes up once, is killed, and then
    exits at every start is restarted max_restarts times, then the next
    episode start (and every one after it) raises OpenEnvServerLost, an
    EnvironmentLost naming the command and its last log lines. The episode
    driver lets it end the run instead of failing one episode after another."""
    from grpo_core.contract.errors import EnvironmentLost
    from grpo_core.contract.types import SamplingSettings
    from grpo_core.generation.episodes import EpisodeDriver
    from grpo_plugins.environments.openenv import OpenEnvServerLost

    command = FLAKY.replace("MARKER", str(tmp_path / "started"))
    log: list[str] = []
    flaky = load(tmp_path, log, command=command, observation_field="text", max_restarts=2)
    try:
        assert play_bisect(flaky.grpo_environment_episode(prompt(0), 0))[0][-1] == "done"
        os.killpg(flaky.server.pid, signal.SIGKILL)
        flaky.server.process.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(OpenEnvServerLost) as lost:
            flaky.grpo_environment_episode(prompt(0), 1)
        assert time.monotonic() - start < 60  # two quick failed starts, no waiting for startup_timeout
        message = str(lost.value)
        assert isinstance(lost.value, EnvironmentLost) and lost.value.exit_code == 3
        assert flaky.restarts == 2 and sum("restarting it" in line for line in log) == 2
        assert "exited with code 1 before answering /health, and it was restarted 2 time(s) already" in message
        assert "(plugins.openenv.max_restarts = 2), so the run ends" in message
        assert f"Its command: {sys.executable} {TESTS / 'openenv_flaky_server.py'}" in message
        assert "refusing to start again" in message  # the log's last lines
        assert flaky.server.process is None  # nothing left running

        # The driver: the error ends the batch (and so the run), it is not one failed episode
        cfg = config(command=command)
        driver = EpisodeDriver(
            flaky.grpo_environment_episode, smollm2_tokenizer, cfg, "openenv", log.append, concurrent_turns=False
        )
        never = lambda *args: pytest.fail("no episode may reach the model")  # noqa: E731
        with pytest.raises(OpenEnvServerLost, match="so the run ends"):
            driver.run([prompt(i) for i in range(2)], 2, SamplingSettings(max_tokens=16), never)
    finally:
        flaky.close()


def test_no_server_at_base_url(tmp_path):
    from grpo_plugins.environments.openenv_server import free_loopback_port

    url = f"http://127.0.0.1:{free_loopback_port()}"
    nowhere = load(tmp_path, base_url=url, startup_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(
        OpenEnvUnavailable,
        match=r"did not answer http://127.0.0.1:\d+/health within 1.5 s \(ConnectError.*plugins.openenv.base_url",
    ):
        nowhere.grpo_environment_episode(prompt(0), 0)
    assert time.monotonic() - start >= 1.5  # it waited for a server that may still be starting


def test_a_base_url_server_that_goes_away(managed, tmp_path):
    """A server that was up at the first episode and is gone at a reset: a
    sentence naming the call and the setting."""
    from grpo_plugins.environments.openenv_session import OpenEnvSession

    session = OpenEnvSession(
        managed.base_url.rsplit(":", 1)[0] + ":1", where="prompt 0, sample 0", connect_timeout=2, message_timeout=2
    )
    with pytest.raises(
        OpenEnvUnavailable,
        match="ws://127.0.0.1:1/ws, prompt 0, sample 0, reset: could not connect .*plugins.openenv.base_url",
    ):
        session.reset()
    session.close()


def test_a_server_that_cannot_start_shows_its_log(tmp_path):
    """A command that never serves: its log's tail in the error, which ends
    the run (an EnvironmentLost); it is not restarted, since the same
    command would fail the same way, and every later episode says so at once."""
    from grpo_core.contract.errors import EnvironmentLost

    broken = load(
        tmp_path, command="{python} -m uvicorn no_such_module:app --host {host} --port {port}", startup_timeout=60
    )
    with pytest.raises(
        EnvironmentLost,
        match="(?s)failed to start: the managed server .* exited with code \\d+; last lines of .*no_such_module.*The "
        "run ends",
    ):
        broken.grpo_environment_episode(prompt(0), 0)
    with pytest.raises(OpenEnvUnavailable, match="failed to start"):
        broken.grpo_environment_episode(prompt(0), 1)
    assert broken.restarts == 0
    broken.close()


def test_settings_errors_name_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match="plugins.openenv.command: Value error, set exactly one of base_url .* and command"
    ):
        load(tmp_path)
    with pytest.raises(ConfigError, match="plugins.openenv.command: .*exactly one of base_url"):
        load(tmp_path, base_url="http://127.0.0.1:1", command="x")
    with pytest.raises(ConfigError, match="plugins.openenv.action_function = 'nowhere.fn' cannot be imported"):
        load(tmp_path, base_url="http://127.0.0.1:1", action_function="nowhere.fn")
    with pytest.raises(ConfigError, match="plugins.openenv.colour"):
        load(tmp_path, base_url="http://127.0.0.1:1", colour="red")


def test_smollm2_turns_drive_an_episode(managed, smollm2_dir):
    """SmolLM2-135M-Instruct's own turns (greedy, transformers, fp32: no CPU
    flag matters) played through the adapter the way the driver will: the
    reset text appended to the prompt's user message, each turn's text
    (special tokens removed) to step(), the replies' messages back into the
    chat template. Whatever the model writes becomes a valid action, and
    every answer is the game's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    episode = managed.grpo_environment_episode(prompt(9), 0)
    messages = [{"role": "user", "content": "Answer with one number only."}]
    messages[-1]["content"] += "\n" + episode.reset()
    turns, replies = 0, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine, 2 threads made generate() ~5x slower
    try:
        while turns < 3:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=12, do_sample=False)
            text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
            reply = episode.step(text)
            turns += 1
            replies.append(reply)
            messages.append({"role": "assistant", "content": text})
            messages.extend(reply.messages)
            if reply.done:
                break
    finally:
        torch.set_num_threads(threads)
    episode.close()
    assert episode.last.observation["guesses"] == turns
    for reply in replies[:-1]:
        assert not reply.done and [m["content"] for m in reply.messages] in (["higher"], ["lower"], ["say a number"])
    if not replies[-1].done:
        assert replies[-1].messages[0]["content"] in ("higher", "lower", "say a number")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.count("<|im_start|>user") == 1 + sum(len(r.messages) for r in replies)

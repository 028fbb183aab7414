"""The ``openenv`` environment: episodes played against an OpenEnv server.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``openenv-core`` on
PyPI) serves an environment (a pydantic ``Action`` in, an ``Observation``
with ``reward`` and ``done`` out) over HTTP/WebSocket. Each grpo episode
opens its own WebSocket session, which the server backs with its own
environment instance, so the ``num_generations`` episodes of a prompt never
share state (:mod:`grpo_plugins.environments.openenv_session` says why
HTTP ``/reset``/``/step`` cannot carry an episode). All episodes of one
prompt reset with the same seed (the prompt's index, unless
``seed = "none"``), so the group's rewards compare the policy's answers,
not the environment's dice.

Each model turn's text becomes the action ``{action_field: text}`` (by
default the action class's only required field, read from the server's
``/schema``; or what ``action_function(text)`` returns); each observation becomes one message
the model reads: the value of ``observation_field``, the observation's only
text field, or the observation as JSON (or what
``observation_function(observation)`` returns). The observation's reward
is the step's reward (``provides_reward = True``: the ``environment``
reward function sums them), its ``done`` ends the episode.

``[plugins.openenv]`` either points at a running server (``base_url``) or
names a ``command`` grpo runs on a free loopback port, restarts when it dies
(at most ``max_restarts`` times) and stops at the end::

    [plugins]
    environment = "openenv"

    [plugins.openenv]
    command = "{python} -m uvicorn my_env.server.app:app --host {host} --port {port}"
    env = { MAX_CONCURRENT_ENVS = "64" }   # if the app reads it
    observation_field = "text"
"""

from __future__ import annotations

import json
import shlex
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from grpo_core.plugin_api import (
    ConfigError,
    EnvironmentLost,
    EnvironmentReply,
    Messages,
    Prompt,
    RunContext,
    hookimpl,
    import_from_cwd,
)
from grpo_plugins.environments.openenv_server import ManagedEnvServer
from grpo_plugins.environments.openenv_session import (
    OpenEnvError,
    OpenEnvSession,
    OpenEnvUnavailable,
    StepResult,
    http_url,
)

ActionFunction = Callable[[str], dict[str, Any]]


class OpenEnvServerLost(OpenEnvUnavailable, EnvironmentLost):
    """The managed server is down for good (it never came up, or died more
    often than ``max_restarts`` allows): the run ends with this message."""


class OpenEnvSettings(BaseModel):
    """``[plugins.openenv]``."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(
        None, description="A running OpenEnv server, e.g. 'http://127.0.0.1:8000' (ws:// works too)."
    )
    command: str | list[str] | None = Field(
        None,
        validate_default=True,
        description="A command grpo runs to serve the environment, with {host}, {port} (a free loopback port) and "
        "{python} (this interpreter) filled in; stopped when the run ends.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for command.")
    startup_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds the server (command's, or base_url's) may take to answer /health, waited for at the "
        "first episode.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times grpo restarts command's server in a run when it has exited or stopped answering "
        "/health (checked as each episode starts); past that, the run ends with an error. 0: never restart.",
    )
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to open an episode's WebSocket session.")
    step_timeout: float | None = Field(
        None, gt=0, description="Seconds a reset or step may take. Unset: [episodes] step_timeout."
    )
    capacity_wait: float = Field(
        0.0, ge=0, description="Seconds a reset keeps retrying while the server has no free session (0: fail at once)."
    )
    action_field: str | None = Field(
        None,
        min_length=1,
        description="The action field the model's turn text goes into. Unset: the action class's only required field "
        "(from the server's /schema).",
    )
    action_function: str | None = Field(
        None, description="'module.function' text -> action dict (overrides action_field)."
    )
    observation_field: str | None = Field(
        None,
        description="The observation field the model reads. Unset: its only text field, else the observation as JSON.",
    )
    observation_function: str | None = Field(
        None,
        description="'module.function' observation dict -> message text (or chat messages); overrides "
        "observation_field.",
    )
    role: str = Field("user", min_length=1, description="Role of the environment's messages in the chat template.")
    reset_observation: Literal["append", "ignore"] = Field(
        "append",
        description="'append': the reset observation is added to the prompt's last user message; 'ignore': the prompt "
        "alone.",
    )
    reset_columns: list[str] = Field(
        default_factory=list, description="Dataset columns passed to the server's reset as keyword arguments."
    )
    seed: Literal["prompt", "none"] = Field(
        "prompt",
        description="'prompt': every episode of a prompt resets with seed = its dataset index; 'none': no seed.",
    )

    @field_validator("command")
    @classmethod
    def _one_server(cls, command: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        # On `command` (validated after base_url, defaults included) so the error names a key.
        if (info.data.get("base_url") is None) == (command is None):
            raise ValueError(
                "set exactly one of base_url (a running OpenEnv server) and command (one grpo starts and stops)"
            )
        if command is not None and not command:
            raise ValueError("the command is empty")
        return command


def _import(key: str, spec: str) -> Callable[..., Any]:
    try:
        func = import_from_cwd(spec)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(
            f"plugins.openenv.{key} = '{spec}' cannot be imported ({type(exc).__name__}: {exc}); "
            "it must be a 'module.function' path importable from the working directory."
        ) from None
    if not callable(func):
        raise ConfigError(f"plugins.openenv.{key} = '{spec}' is not callable.")
    return func


def observation_text(observation: dict[str, Any], field: str | None) -> str:
    """What the model reads of an observation: ``field``'s value, else the
    only text field, else the whole observation as JSON."""
    if field is not None:
        if field not in observation:
            raise OpenEnvError(
                f"the observation has no field '{field}' (it has {sorted(observation)}): "
                "fix plugins.openenv.observation_field."
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    texts = [v for v in observation.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation, sort_keys=True, default=str)


def reset_seed(prompt: Prompt) -> int:
    """The same seed for every episode of a prompt: its dataset index, or a
    checksum of its token ids when it has none."""
    if prompt.index >= 0:
        return prompt.index
    return zlib.crc32(",".join(map(str, prompt.prompt_ids)).encode())


class OpenEnvEpisode:
    """One episode: one WebSocket session, reset once, then stepped with
    each model turn's text. The session closes when the server says
    ``done`` (freeing its slot at once) or at :meth:`close`."""

    def __init__(
        self,
        session: OpenEnvSession,
        *,
        reset_kwargs: dict[str, Any],
        to_action: ActionFunction,
        to_messages: Callable[[dict[str, Any]], Messages],
        reset_text: Callable[[dict[str, Any]], str | Messages | None],
        capacity_wait: float,
    ) -> None:
        self.session = session
        self.reset_kwargs = reset_kwargs
        self.to_action = to_action
        self.to_messages = to_messages
        self.reset_text = reset_text
        self.capacity_wait = capacity_wait
        self.steps = 0
        self.done = False
        self.last: StepResult | None = None

    def reset(self) -> str | Messages | None:
        deadline = time.monotonic() + self.capacity_wait
        while True:
            try:
                self.last = self.session.reset(**self.reset_kwargs)
                break
            except OpenEnvError as exc:
                if exc.code != "CAPACITY_REACHED" or time.monotonic() >= deadline:
                    raise
                self.session.close()
                self.session = self.session.reopened()
                time.sleep(0.2)
        if self.last.done:  # an environment that is over before it starts: nothing to play
            self.done = True
            self.session.close()
        return self._render(self.reset_text, self.last.observation, "reset")

    def step(self, text: str) -> EnvironmentReply:
        if self.done:
            if self.steps == 0:  # over at reset: the driver cannot know before its first turn
                return EnvironmentReply(done=True)
            raise OpenEnvError(
                f"OpenEnv server at {self.session.url}, {self.session.where}: step after the episode ended."
            )
        self.steps += 1
        try:
            action = self.to_action(text)
        except Exception as exc:  # noqa: BLE001 - the user's function: report it, don't crash the run
            raise OpenEnvError(
                f"plugins.openenv.action_function raised {type(exc).__name__}: {exc} ({self.session.where}, step "
                f"{self.steps})."
            ) from None
        if not isinstance(action, dict):
            raise OpenEnvError(
                f"plugins.openenv.action_function returned {type(action).__name__}, not a dict of action fields "
                f"({self.session.where}, step {self.steps})."
            )
        result = self.session.step(action, self.steps)
        self.last = result
        info = {"openenv_observation": result.observation}
        if result.done:
            self.done = True
            self.session.close()
            return EnvironmentReply(done=True, reward=result.reward, info=info)
        messages = self._render(self.to_messages, result.observation, f"step {self.steps}")
        return EnvironmentReply(messages=messages, reward=result.reward, info=info)

    def _render(self, render: Callable[[dict[str, Any]], Any], observation: dict[str, Any], what: str) -> Any:
        try:
            return render(observation)
        except OpenEnvError as exc:  # name the episode and the call, as the server's errors do
            raise OpenEnvError(f"OpenEnv server at {self.session.url}, {self.session.where}, {what}: {exc}") from None

    def close(self) -> None:
        self.session.close()


class OpenEnvEnvironment:
    """Episodes against an OpenEnv server, one session per episode.

    ``grpo.environment:openenv``."""

    episodic = True
    provides_reward = True
    turn_rewards = True  # each observation's reward is its step's
    Settings = OpenEnvSettings

    def __init__(self, context: RunContext, settings: OpenEnvSettings | None = None) -> None:
        self.context = context
        if settings is None:
            raise ConfigError(
                "the 'openenv' environment needs [plugins.openenv] with base_url (a running OpenEnv server) "
                "or command (one grpo starts)."
            )
        self.settings = s = settings
        self.step_timeout = s.step_timeout or float(context.config.episodes.step_timeout)
        self._action_function = _import("action_function", s.action_function) if s.action_function else None
        self._observation_function = (
            _import("observation_function", s.observation_function) if s.observation_function else None
        )
        self.server: ManagedEnvServer | None = None
        if s.command is not None:
            log_path = Path(context.output_dir) / "openenv-server.log"
            self.server = ManagedEnvServer(s.command, env=s.env, log_path=log_path)
            self.server.start()  # starts while the model loads; waited for at the first episode
            context.log(
                f"OpenEnv: starting server {self.server.argv[0]} ... at {self.server.base_url}, log: {log_path}"
            )
        self._base_url = str(s.base_url)
        self._action_field = s.action_field
        self._ready = False
        self._ready_lock = threading.Lock()  # also serialises the health checks and restarts of a managed server
        self.restarts = 0  # of the managed server, in this run
        self._suspect = False  # a connection broke or timed out: check /health before the next episode
        self._lost: OpenEnvServerLost | None = None

    @property
    def base_url(self) -> str:
        """Where the server is: a managed one moves to a new port when restarted."""
        return self.server.base_url if self.server is not None else self._base_url

    # ------------------------------------------------------------------ mapping

    def action(self, text: str) -> dict[str, Any]:
        if self._action_function is not None:
            return self._action_function(text)
        return {self._action_field: text}

    def _find_action_field(self) -> str:
        """The action class's only required field, read from ``GET /schema``."""
        url = f"{http_url(self.base_url)}/schema"
        try:
            response = httpx.get(url, timeout=self.settings.connect_timeout, trust_env=self.server is None)
            response.raise_for_status()
            schema = response.json()["action"]
        except (httpx.ConnectError, httpx.TimeoutException) as exc:
            raise OpenEnvUnavailable(
                f"OpenEnv server at {self.base_url}: could not connect to read its action schema from {url} "
                f"({type(exc).__name__}: {exc}); check plugins.openenv.base_url or command."
            ) from None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"OpenEnv server at {self.base_url}: could not read its action schema from {url} "
                f"({type(exc).__name__}: {exc}); set plugins.openenv.action_field (the action field the model's text "
                "goes into) or action_function."
            ) from None
        if not isinstance(schema, dict):
            raise ConfigError(
                f"OpenEnv server at {self.base_url}: {url} has no action schema object; set "
                "plugins.openenv.action_field or action_function."
            )
        required = [f for f in schema.get("required", []) if f != "metadata"]
        if len(required) == 1:
            return str(required[0])
        fields = sorted(f for f in schema.get("properties", {}) if f != "metadata")
        raise ConfigError(
            f"OpenEnv server at {self.base_url}: its action class {schema.get('title', '?')} has fields {fields} "
            f"({len(required)} required), so grpo cannot tell where the model's text goes: set "
            "plugins.openenv.action_field to one of them, or action_function to build the whole action."
        )

    def content(self, observation: dict[str, Any]) -> str | Messages | None:
        if self._observation_function is not None:
            try:
                return self._observation_function(observation)
            except Exception as exc:  # noqa: BLE001 - the user's function
                raise OpenEnvError(
                    f"plugins.openenv.observation_function raised {type(exc).__name__}: {exc}."
                ) from None
        return observation_text(observation, self.settings.observation_field)

    def messages(self, observation: dict[str, Any]) -> Messages:
        content = self.content(observation)
        if content is None:
            return []
        if isinstance(content, list):
            return content
        return [{"role": self.settings.role, "content": content}]

    def reset_content(self, observation: dict[str, Any]) -> str | Messages | None:
        return None if self.settings.reset_observation == "ignore" else self.content(observation)

    # ------------------------------------------------------------------ hooks

    def _wait_ready(self) -> None:
        """Once, at the first episode: wait for a managed server, then find
        the action field when the settings name none."""
        with self._ready_lock:
            if self._lost is not None:
                raise self._lost
            if self._ready:
                if self.server is not None:
                    self._restart_if_down()
                return
            if self.server is not None:
                try:
                    self.server.wait_ready(self.settings.startup_timeout)
                except OpenEnvUnavailable as exc:  # never came up: restarting the same command would not help
                    self._lost = OpenEnvServerLost(f"{exc} The run ends: no episode can be played without it.")
                    raise self._lost from None
            else:
                self._wait_external()
            self.context.log(f"OpenEnv: server ready at {self.base_url}")
            if self._action_function is None and self._action_field is None:
                self._action_field = self._find_action_field()
            self._ready = True

    def _mark_suspect(self) -> None:
        self._suspect = True

    def _health_problem(self) -> str | None:
        """Why a managed server whose process runs is still no good (it does
        not answer ``GET /health`` within connect_timeout), else ``None``."""
        assert self.server is not None
        timeout = self.settings.connect_timeout
        try:
            status = httpx.get(f"{self.server.base_url}/health", timeout=timeout, trust_env=False).status_code
        except httpx.HTTPError as exc:
            return (
                f"the managed server (pid {self.server.pid}) did not answer GET /health within {timeout:g} s "
                f"({type(exc).__name__})"
            )
        return (
            None if status == 200 else f"the managed server (pid {self.server.pid}) answered GET /health with {status}"
        )

    def _restart_if_down(self) -> None:
        """At an episode's start (under ``_ready_lock``, so a failure seen by
        many episodes at once is handled once): a managed server that has
        exited, or that broke a connection and now fails ``/health``, is
        restarted, at most ``max_restarts`` times in the run. Past that,
        :class:`OpenEnvServerLost`, which ends the run."""
        server, s = self.server, self.settings
        assert server is not None
        code = server.exit_code()
        problem = None if code is None else f"the managed server (pid {server.pid}) exited with code {code}"
        if problem is None and self._suspect:
            self._suspect = False
            problem = self._health_problem()
        while problem is not None:
            if self.restarts >= s.max_restarts:
                server.stop(grace=5.0)
                tail = server.log_tail()
                self._lost = OpenEnvServerLost(
                    f"OpenEnv server at {server.base_url}: {problem}, and it was restarted {self.restarts} time(s) "
                    f"already (plugins.openenv.max_restarts = {s.max_restarts}), so the run ends. "
                    f"Its command: {shlex.join(server.argv)}"
                    + (f". Last lines of {server.log_path}:\n{tail}" if tail else f"; its log: {server.log_path}.")
                )
                raise self._lost
            self.restarts += 1
            self.context.log(
                f"OpenEnv: {problem}; restarting it (restart {self.restarts} of at most {s.max_restarts}, "
                "plugins.openenv.max_restarts); the episodes it was playing end with an error"
            )
            server.restart(f"restart {self.restarts}: {problem}")
            pid = server.pid
            try:
                server.wait_ready(s.startup_timeout)
            except OpenEnvUnavailable:
                code = server.exit_code()
                problem = (
                    f"the restarted server (pid {pid}) exited with code {code} before answering /health"
                    if code is not None
                    else f"the restarted server (pid {pid}) did not answer /health within {s.startup_timeout:g} s "
                    "(plugins.openenv.startup_timeout)"
                )
                continue
            problem = None
            self.context.log(f"OpenEnv: server restarted at {self.base_url} (pid {pid})")

    def _wait_external(self) -> None:
        """A base_url server may still be starting (launched beside grpo):
        wait for its ``/health`` up to ``startup_timeout``."""
        url = f"{http_url(self.base_url)}/health"
        deadline = time.monotonic() + self.settings.startup_timeout
        while True:
            try:
                if httpx.get(url, timeout=min(5.0, self.settings.connect_timeout)).status_code == 200:
                    return
                problem = "it answers, but not 200"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise OpenEnvUnavailable(
                    f"OpenEnv server at {self.base_url} did not answer {url} within {self.settings.startup_timeout:g} "
                    f"s ({problem}): check plugins.openenv.base_url, or raise plugins.openenv.startup_timeout."
                )
            time.sleep(0.5)

    def session(self, where: str) -> OpenEnvSession:
        return OpenEnvSession(
            self.base_url,
            where=where,
            connect_timeout=self.settings.connect_timeout,
            message_timeout=self.step_timeout,
            server_problem=self.server.problem if self.server else (lambda: None),
            on_lost=self._mark_suspect if self.server else (lambda: None),
        )

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> OpenEnvEpisode:
        self._wait_ready()
        s = self.settings
        missing = [c for c in s.reset_columns if c not in prompt.columns]
        if missing:
            raise ConfigError(
                f"plugins.openenv.reset_columns names {missing}, which the dataset row lacks "
                f"(it has {sorted(prompt.columns)}): fix reset_columns or the dataset."
            )
        kwargs: dict[str, Any] = {c: prompt.columns[c] for c in s.reset_columns}
        if s.seed == "prompt":
            kwargs.setdefault("seed", reset_seed(prompt))
        where = f"prompt {prompt.index}, sample {sample}"
        kwargs.setdefault("episode_id", f"grpo-p{prompt.index}-s{sample}")
        return OpenEnvEpisode(
            self.session(where),
            reset_kwargs=kwargs,
            to_action=self.action,
            to_messages=self.messages,
            reset_text=self.reset_content,
            capacity_wait=s.capacity_wait,
        )

    @hookimpl
    def grpo_step_end(self, metrics: dict[str, float]) -> None:
        if self.server is not None:
            metrics["episodes/environment_restarts"] = float(self.restarts)  # so far in this run

    @hookimpl
    def grpo_train_end(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the managed server (a no-op for base_url)."""
        if self.server is not None:
            self.server.stop()

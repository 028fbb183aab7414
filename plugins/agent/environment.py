"""The ``agent`` environment: train an agent written against an OpenAI client.

``[plugins] environment = "agent"`` and ``[plugins.agent] function =
"module.run"``: for every sample of every prompt, grpo calls
``run(row, *, base_url, api_key, model)`` (a plain or an ``async``
function; ``row`` is the dataset row, ``prompt`` included) with a base URL
that belongs to that episode alone. The agent's code talks to it as to any
OpenAI-compatible server (:mod:`.endpoint`), calls its tools itself and
returns when it is done: a float (the episode's reward, the ``environment``
reward) or ``None`` (then only ``trl.reward_funcs`` score it, from the
recorded conversation).

Each request is one generation of the run's policy on the episode's exact
ids, through the run's rollout (the core's
:class:`~grpo_core.contract.types.EpisodeModel`); the model's earlier turns
in a request are matched to the ids it sampled (:mod:`.conversation`). What
trains, and what happens when an agent misbehaves, is the core's rule for
driven episodes (``docs/environments.md``, "Bring your own agent").

What an agent may set per request: ``max_tokens`` / ``max_completion_tokens``
(capped by ``[episodes] max_tokens_per_turn`` and what is left of
``trl.max_completion_length`` on the conversation's chain), ``stop`` (up to
four strings), ``seed``; ``temperature`` and ``top_p`` only with
``sampling_overrides = "allow"`` (by default the run's sampling applies to
every turn, since GRPO's loss assumes the policy sampled as configured).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import importlib.machinery
import inspect
import ipaddress
import os
import secrets
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo_core.plugin_api import (
    ConfigError,
    EpisodeModel,
    GrpoError,
    Prompt,
    RunContext,
    hookimpl,
    import_from_cwd,
)
from grpo_plugins.agent.conversation import Conversation, ToolFormat
from grpo_plugins.agent.endpoint import Endpoint, Served, stamp
from grpo_plugins.agent.openai_format import (
    RequestError,
    chat_answer,
    chat_chunks,
    completion_answer,
    completion_chunks,
    models_answer,
    parse_json,
    read_chat,
    read_completion,
)


class AgentSettings(BaseModel):
    """``[plugins.agent]``."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(
        description="'module.function': run(row, *, base_url, api_key, model) -> float | None, sync or async."
    )
    max_concurrent: int = Field(32, ge=1, description="Episodes whose agent runs at once.")
    timeout: float = Field(
        300.0, gt=0, description="Seconds one episode's agent may take, from its start; then it ends (timeout)."
    )
    model_name: str = Field("policy", description="The model name the agent is given (and /v1/models lists).")
    tool_format: Literal["auto", "template", "json", "python"] = Field(
        "auto",
        description="How a request's tools reach the model: the chat template's own way ('template'), or grpo's text "
        "format ('json', 'python'); 'auto': the template's when it renders tools, else 'json'.",
    )
    sampling_overrides: Literal["ignore", "allow"] = Field(
        "ignore",
        description="'allow': a request's temperature and top_p apply to its turn (off-policy for GRPO's loss); "
        "'ignore': the run's sampling applies to every turn.",
    )
    host: str = Field("127.0.0.1", description="The loopback address the endpoint listens on.")

    @field_validator("host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        try:
            loopback = ipaddress.ip_address(value).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"'{value}' is not a loopback address: the endpoint serves this machine only (127.0.0.1)")
        return value


class AgentEpisode(Served):
    """One sample of one prompt: the agent's call and the requests it sends."""

    def __init__(self, owner: AgentEnvironment, prompt: Prompt, sample: int) -> None:
        self.owner = owner
        self.prompt = prompt
        self.sample = sample
        self.row: dict[str, Any] = {"prompt": prompt.prompt, **prompt.columns}
        self.timeout = owner.settings.timeout  # read by the core: the whole episode's deadline
        self.max_concurrent = owner.settings.max_concurrent  # read by the core
        self.base_url: str | None = None
        self.conversation: Conversation | None = None
        self.reward: float | None = None

    @property
    def environment(self) -> AgentEpisode:
        """What reward functions get in ``environments=``: this episode (``row``, ``reward``)."""
        return self

    def drive(self, model: EpisodeModel) -> float | None:
        self.conversation = Conversation(model, self.owner.tool_format(), secrets.token_hex(3))
        self.base_url = self.owner.endpoint.open(self)
        self.reward = self.owner.run_agent(copy.deepcopy(self.row), self.base_url)
        return self.reward

    def close(self) -> None:
        if self.base_url is not None:
            self.owner.endpoint.close(self.base_url, "its episode was scored")

    # ------------------------------------------------------------------ requests

    def serve(self, path: str, body: bytes | None) -> tuple[int, Any]:
        name = self.owner.settings.model_name
        if path == "models" and body is None:
            return 200, models_answer(name)
        if body is None or path not in ("chat/completions", "completions"):
            raise RequestError(
                404,
                f"no route {'GET' if body is None else 'POST'} /v1/{path} (the endpoint serves "
                "POST /v1/chat/completions, POST /v1/completions, GET /v1/models)",
            )
        conversation = self.conversation
        assert conversation is not None, "an episode's URL exists only once it is driven"
        try:
            if path == "chat/completions":
                return self._chat(conversation, parse_json(body), name)
            return self._complete(conversation, parse_json(body), name)
        except RequestError as exc:
            if exc.status == 400:  # a request it cannot serve ends the episode, named
                conversation.model.fail(f"malformed request to /v1/{path}: {exc.message}")
            raise

    def _sampling_policy(self, sampling: Any) -> None:
        if self.owner.settings.sampling_overrides == "ignore":
            sampling.temperature = sampling.top_p = None

    def _chat(self, conversation: Conversation, body: dict[str, Any], name: str) -> tuple[int, Any]:
        request = read_chat(body)
        self._sampling_policy(request.sampling)
        turn, message, finish = conversation.chat(request)
        ident = f"chatcmpl-{stamp()}"
        if request.stream:
            return 200, chat_chunks(
                ident, name, message, finish, turn.prompt_tokens, len(turn.ids), request.include_usage
            )
        return 200, chat_answer(ident, name, message, finish, turn.prompt_tokens, len(turn.ids))

    def _complete(self, conversation: Conversation, body: dict[str, Any], name: str) -> tuple[int, Any]:
        request = read_completion(body)
        self._sampling_policy(request.sampling)
        turn = conversation.complete(request)
        ident = f"cmpl-{stamp()}"
        finish = "length" if turn.finish_reason == "length" else "stop"
        if request.stream:
            return 200, completion_chunks(
                ident, name, turn.text, finish, turn.prompt_tokens, len(turn.ids), request.include_usage
            )
        return 200, completion_answer(ident, name, turn.text, finish, turn.prompt_tokens, len(turn.ids))


class AgentEnvironment:
    """``grpo.environment:agent``."""

    Settings = AgentSettings
    episodic = True
    provides_reward = True  # run()'s float is the 'environment' reward (None: reward_funcs alone)
    turn_rewards = False  # one reward per episode, never per turn: per-turn credit is refused by the checks

    @staticmethod
    @hookimpl
    def grpo_validate_config(config: Any) -> list[str]:
        """``grpo config check`` finds the agent's module as ``grpo run`` will, importing nothing."""
        table = (config.plugins.model_extra or {}).get("agent")
        spec = table.get("function") if isinstance(table, dict) else None
        problem = agent_location_problem(spec) if isinstance(spec, str) else None
        if problem is not None:
            raise ConfigError(f"plugins.agent.function = '{spec}': {problem}")
        return []

    def __init__(self, context: RunContext, settings: AgentSettings) -> None:
        self.settings = settings
        self.context = context
        self.function = load_agent(settings.function)
        self.endpoint = Endpoint(settings.host, context.log)
        self._tool_format: ToolFormat | None = None
        self._lock = threading.Lock()

    def tool_format(self) -> ToolFormat:
        with self._lock:
            if self._tool_format is None:
                self._tool_format = ToolFormat(
                    self.context.tokenizer, self.settings.tool_format, self.context.config.trl.chat_template_kwargs
                )
            return self._tool_format

    def run_agent(self, row: dict[str, Any], base_url: str) -> Any:
        """Call the agent once, in this thread (a coroutine in an event loop
        of its own, cancelled at the timeout). Its failure is named."""
        spec, timeout = self.settings.function, self.settings.timeout
        kwargs = {"base_url": base_url, "api_key": self.endpoint.key, "model": self.settings.model_name}
        try:
            value = self.function(row, **kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_bounded(value, timeout, spec))
        except GrpoError:
            raise
        except TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - the agent's own error, named
            raise GrpoError(f"agent '{spec}' raised {type(exc).__name__}: {exc}") from exc
        return value

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> AgentEpisode:
        return AgentEpisode(self, prompt, sample)

    @hookimpl
    def grpo_train_end(self, context: RunContext, status: str) -> None:
        self.endpoint.stop()


async def _bounded(awaitable: Any, timeout: float, spec: str) -> Any:
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise TimeoutError(f"agent '{spec}' ran past plugins.agent.timeout = {timeout:g} s") from None
        raise


def agent_location_problem(spec: str) -> str | None:
    """Why ``spec`` ('module.function') will not import, found without
    running the module: it is not on the path (the working directory first),
    or its source defines no such top-level name. ``None`` when it may."""
    module, _, name = spec.rpartition(".")
    if not module or not name:
        return "it must be a 'module.function' path"
    if module in sys.modules:  # imported already (a script's own object that grpo.train holds, or a library)
        return None if hasattr(sys.modules[module], name) else f"module '{module}' has no '{name}'"
    top = module.partition(".")[0]
    found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
    if found is None:
        return f"no module '{top}' in {os.getcwd()} or on the Python path"
    if module != top or not (found.origin or "").endswith(".py"):
        return None  # a package's submodule or compiled code: what importing it says is the check
    try:
        tree = ast.parse(Path(found.origin).read_text(encoding="utf-8"))  # type: ignore[arg-type]
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{found.origin} cannot be read: {exc}"
    defined: set[str] = set()
    functions: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            functions.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None  # a star import may define it
            defined |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
    if name in defined or "__getattr__" in defined:
        return None
    public = ", ".join(n for n in functions if not n.startswith("_")) or "none public"
    return f"{found.origin} defines no top-level '{name}' (found by reading it; its functions and classes: {public})"


def load_agent(spec: str) -> Callable[..., Any]:
    try:
        function = import_from_cwd(spec)
    except Exception as exc:  # noqa: BLE001 - named below
        raise ConfigError(
            f"plugins.agent.function = '{spec}' cannot be imported ({exc}); it must be 'module.function', importable "
            "from the working directory"
        ) from None
    if not callable(function):
        raise ConfigError(f"plugins.agent.function = '{spec}' is not callable")
    return function

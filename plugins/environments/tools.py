"""The ``tools`` environment: TRL's ``tools`` and ``environment_factory``.

``trl.tools = ["module.function", ...]`` gives the model functions to call;
``trl.environment_factory = "module.Class"`` gives each episode its own
instance of a class whose public methods are tools too (TRL 1.16's
convention: ``reset(**row) -> str | None``, whose string is appended to the
last user message; an optional ``get_reward()`` scores the finished episode
and becomes the ``environment`` reward, weight 1). Schemas come from the
functions' signatures and Google-style docstrings
(``transformers.utils.get_json_schema``, as TRL does).

Where grpo differs from TRL: SmolLM2-class templates have no tool support,
so the calls use a text format of their own (:mod:`grpo_core.contract.tool_calls`, chosen by
``[plugins.tools] format``) taught by the system prompt, with a one-shot
example; results come back as ``tool`` messages (``result_role``). A call
that cannot be parsed, names no tool, or raises is answered with an error
message (``tool_failures``), never a crash. ``trl.max_tool_calling_iterations``
bounds the rounds of calls (TRL's meaning: a turn's calls past the limit
are not run and the episode ends). ``trl.environment_factory`` as a table
of name -> 'module.Class' is TRL's multi-environment mode: each row names
its class in an ``environment`` column (the core routes rows and refuses an
unknown name before training; :func:`ToolEnvironment.names`), and each
episode sees the tools of its own class.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from grpo_core.plugin_api import (
    ConfigError,
    EnvironmentReply,
    Messages,
    Prompt,
    RunContext,
    ToolCall,
    example_arguments,
    hookimpl,
    import_from_cwd,
    instructions,
    parse_calls,
)


class ToolSettings(BaseModel):
    """``[plugins.tools]``."""

    format: Literal["json", "python"] = Field("json", description="How the model writes a call (see tool_calls.py).")
    example: bool = Field(True, description="Put a one-shot example call in the system prompt.")
    result_role: Literal["tool", "user"] = Field("tool", description="The role of the messages that carry results.")
    instructions: str | None = Field(
        None, description="Text before the tool list in the system prompt (default: grpo's)."
    )
    demonstration: list[dict[str, str]] | None = Field(
        None,
        description="Chat messages put between the system prompt and the prompt: a worked exchange (a call, its "
        "result as a 'tool' message, the answer). A small model copies a demonstration far more readily than it "
        "follows instructions.",
    )


def _schema(func: Callable[..., Any], where: str) -> dict[str, Any]:
    # heavy (transformers): loaded on first use, not with this module
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as exc:  # transformers raises its own types for undocumented arguments
        raise ConfigError(
            f"{where}: tool '{getattr(func, '__name__', func)}' has no usable schema ({exc}). Give every argument a "
            "type hint and describe it in a Google-style docstring (an 'Args:' section)."
        ) from None


def _load(spec: str, key: str) -> Any:
    try:
        return import_from_cwd(spec)
    except Exception as exc:  # noqa: BLE001 - named below
        raise ConfigError(
            f"{key} = '{spec}' cannot be imported ({exc}); it must be importable from the working directory"
        ) from None


def environment_methods(instance: Any) -> list[Callable[..., Any]]:
    """An environment's tools: its public methods besides reset/get_reward (TRL's rule)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


class ToolEpisode:
    """One episode: an environment instance (if any) and the tools."""

    def __init__(self, owner: ToolEnvironment, prompt: Prompt, instance: Any, name: str | None = None) -> None:
        self.owner = owner
        self.prompt = prompt
        self.name = name  # the environment_factory key the row chose (None: the one class)
        self.environment = instance  # what reward functions get as environments=
        self.tools = {
            f.__name__: f for f in owner.functions + (environment_methods(instance) if instance is not None else [])
        }
        self.rounds = 0

    def reset(self) -> Messages:
        start = None
        if self.environment is not None and callable(getattr(self.environment, "reset", None)):
            start = self.environment.reset(**{"prompt": self.prompt.prompt, **self.prompt.columns})
        system = self.owner.system_text(self.name)
        prompt = self.prompt.prompt
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if start is not None:
            last = messages[-1]
            messages[-1] = {**last, "content": str(last.get("content", "")) + str(start)}
        shown = list(self.owner.settings.demonstration or [])
        if messages and messages[0].get("role") == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{system}"}, *shown, *messages[1:]]
        return [{"role": "system", "content": system}, *shown, *messages]

    def step(self, text: str) -> EnvironmentReply:
        calls = parse_calls(text, self.owner.settings.format, self.owner.schemas_for(self.tools, self.name))
        if not calls:
            return EnvironmentReply(done=True)
        limit = self.owner.max_rounds
        if limit is not None and self.rounds >= limit:
            return EnvironmentReply(done=True)
        self.rounds += 1
        messages, failures = [], 0
        for call in calls:
            result, failed = self._run(call)
            failures += failed
            messages.append({"role": self.owner.settings.result_role, "content": result})
        return EnvironmentReply(messages=messages, tool_calls=len(calls), tool_failures=failures)

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        if call.problem is not None:
            return f"Error: {call.problem}.", True
        try:
            result = self.tools[call.name](**call.arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(result)
        except Exception as exc:  # noqa: BLE001 - the model is told, and it is counted
            return f"Error: {call.name} raised {type(exc).__name__}: {exc}", True
        return (result if isinstance(result, str) else json.dumps(result, default=str)), False

    def final_reward(self) -> float | None:
        get_reward = getattr(self.environment, "get_reward", None)
        if not callable(get_reward):
            return None
        value = get_reward()
        if inspect.isawaitable(value):
            value = asyncio.run(value)
        return None if value is None else float(value)


class ToolEnvironment:
    """Tool calls: the model calls trl.tools functions or environment_factory methods.

    ``grpo.environment:tools``."""

    Settings = ToolSettings

    def __init__(self, context: RunContext, settings: ToolSettings | None = None) -> None:
        trl = context.config.trl
        self.settings = settings or ToolSettings()
        self.functions = [_load(spec, "trl.tools") for spec in trl.tools or []]
        factory = trl.environment_factory
        specs = factory if isinstance(factory, dict) else ({None: factory} if factory else {})
        self.factories: dict[str | None, Any] = {
            name: _load(spec, "trl.environment_factory" + (f".{name}" if name is not None else ""))
            for name, spec in specs.items()
        }
        self.factory = self.factories.get(None)
        if not self.functions and not self.factories:
            raise ConfigError(
                "the 'tools' environment needs trl.tools = ['module.function'] or trl.environment_factory = "
                "'module.Class'"
            )
        self.max_rounds = trl.max_tool_calling_iterations
        # each environment's tools: the functions, then its class's methods (a probe instance, checked now)
        self._tool_lists: dict[str | None, list[Callable[..., Any]]] = {}
        self._schemas: dict[str | None, dict[str, dict[str, Any]]] = {}
        for name, cls in (self.factories or {None: None}).items():
            probe = cls() if cls is not None else None
            tools = self.functions + (environment_methods(probe) if probe is not None else [])
            key = "trl.environment_factory" + (f".{name}" if name is not None else "")
            if not tools:
                raise ConfigError(
                    f"{key} = '{specs.get(name)}' has no public methods to offer as tools, and trl.tools is empty"
                )
            self._tool_lists[name] = tools
            self._schemas[name] = {
                f.__name__: _schema(f, key if f not in self.functions else "trl.tools") for f in tools
            }

    @staticmethod
    def provides_reward(config: Any) -> bool:
        """An environment class may score episodes (``get_reward``). Decided
        from the config alone, so checking a config imports none of its
        code: with ``environment_factory`` the ``environment`` reward is
        listed, and is ``None`` for a class without ``get_reward``."""
        return bool(config.trl.environment_factory)

    @staticmethod
    def names(config: Any) -> list[str] | None:
        """The names rows choose by: the keys of an ``environment_factory`` table."""
        factory = config.trl.environment_factory
        return list(factory) if isinstance(factory, dict) else None

    def schemas_for(self, tools: dict[str, Callable[..., Any]], name: str | None = None) -> dict[str, dict[str, Any]]:
        schemas = self._schemas[name]
        return {tool: schemas[tool] for tool in tools if tool in schemas}

    def system_text(self, name: str | None = None) -> str:
        schemas = [self._schemas[name][f.__name__] for f in self._tool_lists[name]]
        example = (schemas[0]["function"]["name"], example_arguments(schemas[0])) if self.settings.example else None
        text = instructions(schemas, self.settings.format, example)
        return f"{self.settings.instructions}\n{text}" if self.settings.instructions else text

    @staticmethod
    def grpo_validate_config(config: Any) -> list[str]:
        trl = config.trl
        if not trl.tools and not trl.environment_factory:
            raise ConfigError("plugins.environment = 'tools' needs trl.tools or trl.environment_factory")
        if config.episodes.max_turns < 2:
            return [
                f"episodes.max_turns = {config.episodes.max_turns} with tools: an episode ends after the model's first "
                "turn, so a tool it calls runs but its result never reaches the model. Set episodes.max_turns to at "
                "least 2 (a call, then the answer written after the result)."
            ]
        return []

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> ToolEpisode:
        if None in self.factories or not self.factories:
            return ToolEpisode(self, prompt, self.factory() if self.factory is not None else None)
        name = prompt.columns.get("environment")
        if name not in self.factories:  # the core checks every row first; this is TRL's message
            raise ConfigError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}."
            )
        return ToolEpisode(self, prompt, self.factories[name](), name)

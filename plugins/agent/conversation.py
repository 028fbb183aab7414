"""One episode's requests, matched to the turns the model already sampled.

An agent sends its whole conversation with every request, the model's
earlier answers included. Those answers must not be tokenised again: the
ids the engine sampled are what trains. So each request is matched to the
episode's earlier turns: the longest earlier request whose messages, then
that turn's answer, begin this one. The match is continued with the rest
rendered by the chat template after the turn's own ids
(:meth:`~grpo_core.contract.types.EpisodeModel.render` with ``after``);
without one, the conversation starts afresh (the core counts it as a
rewritten history when the episode had turns before).

An assistant message matches a turn when its content (trimmed) and its tool
calls (name, and the arguments as JSON values) equal what the endpoint
answered, or its content equals the turn's raw text (an agent that keeps the
text and parses tool calls itself). Tool call ids are not compared: some
libraries make their own. Other messages match on role, content, and their
tool fields. The ``tools`` of the two requests must be the same.

Tools reach the model one of two ways (:class:`ToolFormat`): through the
chat template, when it renders tools (its calls are read with the
tokenizer's response parser when it has one, else as ``<tool_call>{json}``
blocks, the Hermes/Qwen convention), or, for templates without tools, in
grpo's text format (:mod:`grpo_core.contract.tool_calls`): the schemas and
an example in the system message, calls as ``<tool_call>`` blocks, the
agent's earlier calls written back in the same form.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from grpo_core.plugin_api import (
    EpisodeModel,
    ModelTurn,
    example_arguments,
    instructions,
    render_call,
    split_calls,
)
from grpo_plugins.agent.openai_format import ChatRequest, CompletionRequest, RequestError

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "grpo_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer: Any, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the chat template writes ``tools`` into the prompt at all."""
    probe = [{"role": "user", "content": "x"}]
    try:
        text = tokenizer.apply_chat_template(
            probe, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True, **(kwargs or {})
        )
    except Exception:  # noqa: BLE001 - a template that refuses tools has none
        return False
    return "grpo_probe_tool" in str(text)


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


def _canonical(arguments: str) -> str:
    value = _arguments_value(arguments)
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What two messages must share to be the same message (see the module's text)."""
    if message["role"] == "assistant":
        calls = tuple(
            (c["function"]["name"], _canonical(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        )
        return ("assistant", (message.get("content") or "").strip(), calls)
    return (message["role"], message.get("content") or "", message.get("tool_call_id"), message.get("name"))


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


class ToolFormat:
    """How a request's tools reach the model and how its calls come back.
    ``setting``: ``"auto"`` (the template's way when it renders tools,
    else grpo's ``json`` text format), ``"template"``, ``"json"`` or ``"python"``."""

    def __init__(self, tokenizer: Any, setting: str, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        if setting == "auto":
            setting = "template" if template_renders_tools(tokenizer, template_kwargs) else "json"
        self.mode = setting

    def template_tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """What the template is given as ``tools``."""
        return tools if self.mode == "template" else None

    def messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, start: bool) -> list[dict]:
        """Messages as the chat template takes them. In the text format the
        tools' description joins the system message of a conversation's
        start, and earlier calls are written as the model writes them."""
        out = []
        for message in messages:
            m = {k: v for k, v in message.items() if k != "tool_calls"}
            m["content"] = m.get("content") or ""
            calls = message.get("tool_calls") or []
            if calls and self.mode == "template":
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments_value(c["function"]["arguments"]),
                        },
                        "id": c.get("id", ""),
                    }
                    for c in calls
                ]
            elif calls:
                written = [
                    render_call(c["function"]["name"], _as_dict(c["function"]["arguments"]), self.mode)  # type: ignore[arg-type]
                    for c in calls
                ]
                m["content"] = "\n".join(part for part in [m["content"], *written] if part)
            out.append(m)
        if start and tools and self.mode != "template":
            text = self._instructions(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def _instructions(self, tools: list[dict[str, Any]]) -> str:
        first = tools[0]
        return instructions(tools, self.mode, (first["function"]["name"], example_arguments(first)))  # type: ignore[arg-type]

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[tuple[str, Any]]]:
        """The turn's content and its calls ``(name, arguments)``."""
        if not tools:
            return text, []
        schemas = {t["function"]["name"]: t for t in tools}
        if self.mode == "template":
            parsed = self._template_parse(text)
            if parsed is not None:
                return parsed
            style = "json"
        else:
            style = self.mode
        content, calls = split_calls(text, style, schemas)  # type: ignore[arg-type]
        return content, [(c.name, c.arguments) for c in calls]

    def _template_parse(self, text: str) -> tuple[str, list[tuple[str, Any]]] | None:
        """The tokenizer's own response parser, when it has one."""
        if not (getattr(self.tokenizer, "response_schema", None) or getattr(self.tokenizer, "response_template", None)):
            return None
        try:
            parsed = self.tokenizer.parse_response(text)
        except Exception:  # noqa: BLE001 - fall back to the <tool_call> convention
            return None
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call)
            calls.append((str(function.get("name")), function.get("arguments", {})))
        return str(parsed.get("content") or ""), calls


def _as_dict(arguments: str) -> dict[str, Any]:
    value = _arguments_value(arguments)
    return value if isinstance(value, dict) else {"arguments": value}


@dataclass
class _Asked:
    """One served request and the turn that answered it."""

    turn: ModelTurn
    keys: list[tuple[Any, ...]]  # its messages (chat) ...
    tools: str
    reply: tuple[Any, ...]  # the answer as the agent saw it
    raw: tuple[Any, ...]  # the answer's raw text
    prompt: str | None = None  # ... or its prompt text (completions)
    ids: list[int] | None = None  # the turn's context and its ids (completions)


class Conversation:
    """Serves one episode's requests through its :class:`EpisodeModel`."""

    def __init__(self, model: EpisodeModel, tool_format: ToolFormat, tag: str) -> None:
        self.model = model
        self.tool_format = tool_format
        self.tag = tag
        self._lock = threading.Lock()
        self._asked: list[_Asked] = []

    def chat(self, request: ChatRequest) -> tuple[ModelTurn, dict[str, Any], str]:
        """One chat request: the turn, the assistant message, the finish reason."""
        tools = request.tools if request.tool_choice != "none" else None
        tkey = tools_key(tools)
        keys = [message_key(m) for m in request.messages]
        with self._lock:
            asked = list(self._asked)
        best: _Asked | None = None
        length = 0
        for earlier in reversed(asked):
            n = len(earlier.keys)
            if earlier.ids is not None or earlier.tools != tkey or len(keys) <= n or n + 1 <= length:
                continue
            if keys[:n] == earlier.keys and keys[n] in (earlier.reply, earlier.raw):
                best, length = earlier, n + 1
        template_tools = self.tool_format.template_tools(tools)
        try:
            if best is not None:
                rest = self.tool_format.messages(request.messages[length:], tools, start=False)
                ids = self.model.render(rest, after=best.turn, tools=template_tools)
            else:
                ids = self.model.render(
                    self.tool_format.messages(request.messages, tools, start=True), tools=template_tools
                )
        except Exception as exc:  # the template refused the conversation
            raise RequestError(
                400, f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None
        s = request.sampling
        turn = self.model.generate(
            ids,
            after=best.turn if best is not None else None,
            conversation=request.messages,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=s.stop or None,
        )
        content, calls = self.tool_format.parse(turn.text, tools)
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{self.tag}_{turn.index}_{j}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
                for j, (name, arguments) in enumerate(calls)
            ]
        turn.message = message
        with self._lock:
            self._asked.append(_Asked(turn, keys, tkey, message_key(message), ("assistant", turn.text.strip(), ())))
        finish = "tool_calls" if calls else ("length" if turn.finish_reason == "length" else "stop")
        return turn, message, finish

    def complete(self, request: CompletionRequest) -> ModelTurn:
        """One completions request (no template): a prompt that begins with
        an earlier prompt and its answer continues that turn's ids."""
        with self._lock:
            asked = [a for a in self._asked if a.ids is not None]
        best: _Asked | None = None
        covered = 0
        prompt = request.prompt
        for earlier in asked:
            assert earlier.ids is not None
            if isinstance(prompt, list):
                size = len(earlier.ids)
                if size > covered and prompt[:size] == earlier.ids:
                    best, covered = earlier, size
            elif earlier.prompt is not None:
                seen = earlier.prompt + earlier.turn.text
                if len(seen) > covered and prompt.startswith(seen):
                    best, covered = earlier, len(seen)
        if isinstance(prompt, list):
            rest_ids = list(prompt[covered:])
        else:
            rest_ids = self.model.encode(prompt[covered:]) if prompt[covered:] else []
        base = list(best.ids) if best is not None and best.ids is not None else []
        s = request.sampling
        turn = self.model.generate(
            rest_ids,
            after=best.turn if best is not None else None,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=s.stop or None,
        )
        turn.message = {"role": "assistant", "content": turn.text}
        with self._lock:
            self._asked.append(
                _Asked(
                    turn,
                    [],
                    "",
                    (),
                    (),
                    prompt=prompt if isinstance(prompt, str) else None,
                    ids=base + rest_ids + list(turn.ids),
                )
            )
        return turn

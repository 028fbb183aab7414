"""grpo's text format for tool calls, for chat templates without tools.

Part of the contract because more than one environment speaks it: the
``tools`` environment teaches it to the model, and the ``agent``
environment's endpoint reads it back into OpenAI ``tool_calls``.

SmolLM2's template (like many small models') knows nothing of tools, so the
format lives in the text: the tools' schemas and one worked example go into
the system prompt, the model writes a call inside ``<tool_call>`` tags, and
each result comes back as a ``tool`` message. Two spellings of a call:

``json`` (Hermes/Qwen style)
    ``<tool_call>{"name": "guess", "arguments": {"n": 50}}</tool_call>``
``python``
    ``<tool_call>guess(n=50)</tool_call>`` (positional arguments allowed,
    values must be literals): shorter, and closer to code a small model has
    seen.

Every call in a turn is parsed; a call that cannot be read (bad JSON, an
unknown tool, arguments that do not fit) becomes a :class:`ToolCall` with
``problem`` set, which the environment answers as an error message.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
Format = Literal["json", "python"]


@dataclass
class ToolCall:
    """One call as the model wrote it."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


def schema_line(schema: dict[str, Any]) -> str:
    """``name(arg: type, ...): description``, one line per tool."""
    function = schema["function"]
    params = function.get("parameters", {}).get("properties", {})
    args = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in params.items())
    lines = [f"- {function['name']}({args}): {function.get('description', '').strip()}"]
    for name, spec in params.items():
        if spec.get("description"):
            lines.append(f"    {name}: {spec['description']}")
    return "\n".join(lines)


def render_call(name: str, arguments: dict[str, Any], style: Format) -> str:
    if style == "json":
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    return "<tool_call>" + name + "(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")</tool_call>"


def instructions(schemas: list[dict[str, Any]], style: Format, example: tuple[str, dict[str, Any]] | None) -> str:
    """The system-prompt text that teaches the format."""
    how = (
        'write {"name": ..., "arguments": {...}} as JSON'
        if style == "json"
        else "write the call as name(argument=value)"
    )
    text = [
        "You can use tools. To call a tool, " + how + " between <tool_call> and </tool_call>, then stop and wait: "
        "the result comes back in a message. When you have the final answer, reply without a tool call.",
        "Tools:",
        *(schema_line(s) for s in schemas),
    ]
    if example is not None:
        text.append("Example of a call: " + render_call(example[0], example[1], style))
    return "\n".join(text)


def example_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Plausible arguments for the one-shot example, from the schema's types."""
    samples = {"integer": 7, "number": 2.5, "string": "text", "boolean": True, "array": [], "object": {}}
    props = schema["function"].get("parameters", {}).get("properties", {})
    return {name: samples.get(spec.get("type", "string"), "text") for name, spec in props.items()}


def parse_calls(text: str, style: Format, schemas: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """Every ``<tool_call>`` in ``text``, read and checked against the tools."""
    calls = []
    for body in CALL.findall(text):
        call = _parse_json(body) if style == "json" else _parse_python(body)
        if call.problem is None:
            call.problem = _check(call, schemas)
        calls.append(call)
    return calls


def split_calls(text: str, style: Format, schemas: dict[str, dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """``text`` as an OpenAI assistant message: the calls that read cleanly
    (a known tool, arguments that fit) and the content without them. A call
    that cannot be read stays in the content, as the model wrote it."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    end = 0
    for match in CALL.finditer(text):
        body = match.group(1)
        call = _parse_json(body) if style == "json" else _parse_python(body)
        if call.problem is None:
            call.problem = _check(call, schemas)
        kept.append(text[end : match.start()])
        if call.problem is None:
            calls.append(call)
        else:
            kept.append(match.group(0))
        end = match.end()
    kept.append(text[end:])
    return "".join(kept).strip(), calls


def _parse_json(body: str) -> ToolCall:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return ToolCall("?", problem=f"the call is not valid JSON ({exc.msg})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("?", problem='the call must be {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models quote the arguments object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], problem="'arguments' must be a JSON object")
    return ToolCall(data["name"], arguments)


def _parse_python(body: str) -> ToolCall:
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        return ToolCall("?", problem="the call is not name(argument=value)")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("?", problem="the call is not name(argument=value)")
    try:
        positional = [ast.literal_eval(a) for a in node.args]
        named = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return ToolCall(node.func.id, problem="argument values must be literals (numbers, strings, lists)")
    call = ToolCall(node.func.id, named)
    call.arguments["__positional__"] = positional
    return call


def _check(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> str | None:
    schema = schemas.get(call.name)
    if schema is None:
        return f"there is no tool '{call.name}' (tools: {', '.join(sorted(schemas))})"
    params = schema["function"].get("parameters", {})
    names = list(params.get("properties", {}))
    positional = call.arguments.pop("__positional__", [])
    if len(positional) > len(names):
        return f"{call.name} takes {len(names)} argument(s), got {len(positional)}"
    for name, value in zip(names, positional):
        if name in call.arguments:
            return f"{call.name} got '{name}' twice"
        call.arguments[name] = value
    unknown = sorted(set(call.arguments) - set(names))
    if unknown:
        return f"{call.name} has no argument(s) {unknown} (arguments: {', '.join(names) or 'none'})"
    missing = [n for n in params.get("required", []) if n not in call.arguments]
    if missing:
        return f"{call.name} needs argument(s) {missing}"
    return None

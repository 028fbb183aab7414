"""The OpenAI wire format the endpoint speaks: requests read and checked,
answers (whole, or as server-sent events) and errors built.

Only what an agent library sends is read (the fields of the Chat
Completions and Completions APIs that change what is generated); other
fields are ignored, as vLLM's server ignores them. A field of the wrong
type, ``n`` other than 1, or a message the template cannot take is a
:class:`RequestError` (HTTP 400, OpenAI's error body), which the ``openai``
SDK raises as ``BadRequestError``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_STOP = 4  # as OpenAI: at most four stop strings


class RequestError(Exception):
    """A request the endpoint answers with an error (OpenAI's shape)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code=code)


@dataclass
class Sampling:
    """What a request may set about one generation."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool


# ---------------------------------------------------------------------------- reading


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"the request body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(f"'{key}' must be a number from {low:g} to {high:g}, got {value!r}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(f"'{key}' must be an integer >= {low}, got {value!r}", key)
    return int(value)


def _sampling(body: dict[str, Any]) -> Sampling:
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(f"'n' must be 1: each request is one sample of the episode (got {n!r})", "n")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = list(stop)
    else:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"'seed' must be an integer, got {seed!r}", "seed")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        seed=seed,
        stop=[s for s in stops if s],
    )


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _text(content: Any, where: str) -> str | None:
    """A message's content as text (a list of text parts joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}: only text content is supported, not a '{kind}' part", where)
        return "\n".join(parts)
    raise _bad(f"{where}: content must be a string or a list of text parts", where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}", where)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def normalise_message(message: Any, i: int) -> dict[str, Any]:
    """One message as the endpoint keeps it: role, text content, and the
    tool fields of its role. ``developer`` is the newer name of ``system``."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where)
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.get("content"), where),
    }
    if role == "assistant":
        calls = _tool_calls(message.get("tool_calls"), where)
        if calls:
            out["tool_calls"] = calls
    elif out["content"] is None:
        raise _bad(f"{where}: a {role} message needs content", where)
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def read_chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of chat messages", "messages")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools
        ):
            raise _bad("'tools' must be a list of {'type': 'function', 'function': {'name': ..., ...}}", "tools")
        tools = [{"type": "function", "function": dict(t["function"])} for t in tools] or None
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise _bad(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    stream, usage = _stream(body)
    return ChatRequest(
        messages=[normalise_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
        tool_choice=tool_choice,
        sampling=_sampling(body),
        stream=stream,
        include_usage=usage,
    )


def read_completion(body: dict[str, Any]) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list (the SDK's batch form with one entry)
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise _bad("'prompt' must be a string or one list of token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if body.get("echo"):
        raise _bad("'echo' is not supported", "echo")
    stream, usage = _stream(body)
    return CompletionRequest(prompt=prompt, sampling=_sampling(body), stream=stream, include_usage=usage)


# ---------------------------------------------------------------------------- answering


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_answer(
    ident: str, model: str, message: dict[str, Any], finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunks(
    ident: str,
    model: str,
    message: dict[str, Any],
    finish: str,
    prompt_tokens: int,
    completion_tokens: int,
    include_usage: bool,
) -> list[dict[str, Any]]:
    """The answer as the events a streaming server sends: the role, the
    content, each tool call (whole, at its index), the finish reason, and
    the usage when asked (its own chunk with no choices, as OpenAI sends it)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for j, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": j, **call}]}))
    chunks.append(chunk({}, finish))
    if include_usage:
        chunks.append(
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )
    return chunks


def completion_answer(
    ident: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunks(
    ident: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
) -> list[dict[str, Any]]:
    created = int(time.time())
    base = {"id": ident, "object": "text_completion", "created": created, "model": model}
    chunks = [
        {**base, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]},
        {**base, "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}]},
    ]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    return chunks


def models_answer(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "grpo"}]}

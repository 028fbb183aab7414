"""A calculator agent written with the plain ``openai`` client, trained by grpo.

The agent is ordinary OpenAI-client code: it sends the conversation with a
``calculate`` tool, runs the tool itself when the model calls it, sends the
result back, and takes the model's next message without a call as its
answer. Nothing in it knows grpo; grpo only gives it a base URL and a key
(``run`` below), exactly as any OpenAI-compatible server would.

    .venv/bin/grpo run examples/agent/config.toml

``run`` returns the episode's reward (1.0 when the answer's last number is
right): it becomes the ``environment`` reward of the run. Returning ``None``
instead would leave the scoring to ``trl.reward_funcs``, which then see the
recorded conversation.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Compute an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'The expression to compute, with numbers and + - * / only, e.g. "12 * 34".',
                    }
                },
                "required": ["expression"],
            },
        },
    }
]


def _call(ident: str, expression: str) -> dict[str, Any]:
    arguments = json.dumps({"expression": expression})
    return {"id": ident, "type": "function", "function": {"name": "calculate", "arguments": arguments}}


# Two worked exchanges of other operations, as earlier turns of the conversation:
# SmolLM2-135M does not call a tool from a description alone, but copies a
# demonstration (the same two as examples/calculator, there in grpo's own tools environment).
DEMONSTRATION: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 12 + 34? Use the calculator, then answer with the number."},
    {"role": "assistant", "content": None, "tool_calls": [_call("demo-1", "12 + 34")]},
    {"role": "tool", "tool_call_id": "demo-1", "content": "46"},
    {"role": "assistant", "content": "46"},
    {"role": "user", "content": "What is 75 - 21? Use the calculator, then answer with the number."},
    {"role": "assistant", "content": None, "tool_calls": [_call("demo-2", "75 - 21")]},
    {"role": "tool", "tool_call_id": "demo-2", "content": "54"},
    {"role": "assistant", "content": "54"},
]

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool, run by the agent itself."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / are allowed")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def solve(client: openai.OpenAI, model: str, question: str, max_calls: int = 2) -> str:
    """The agent: ask, run the tool calls, ask again; the first answer without a call is final."""
    messages: list[dict[str, Any]] = [*DEMONSTRATION, {"role": "user", "content": question}]
    for _ in range(max_calls + 1):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as exc:  # noqa: BLE001 - the model is told, as a real tool would tell it
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else None


def run(row: dict[str, Any], *, base_url: str, api_key: str, model: str) -> float:
    """What grpo calls for each sample: ``row`` is the dataset row."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    question = row["prompt"][-1]["content"]
    answer = solve(client, model, question)
    return 1.0 if last_number(answer) == str(row["answer"]) else 0.0


if __name__ == "__main__":  # the same agent against any OpenAI-compatible server
    import os
    import sys

    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "none"))
    print(solve(client, os.environ.get("MODEL", "policy"), " ".join(sys.argv[1:]) or "What is 28 * 83?"))

"""The calculator tool of the tool-use example (``trl.tools = ["calculator.calculate"]``)."""

from __future__ import annotations

import ast
import operator

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculate(expression: str) -> str:
    """Compute an arithmetic expression.

    Args:
        expression: The expression to compute, with numbers and + - * / only, e.g. "12 * 34".
    """
    result = _value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"

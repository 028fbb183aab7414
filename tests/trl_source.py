"""Running TRL's own code in parity tests.

TRL computes advantages and IS weights inline inside a long method, so the
parity tests cut the exact lines out of TRL's installed source and execute
them unchanged, rather than re-typing TRL's formulas.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest


def trl_block(method, start: str, end: str) -> str:
    """TRL's source from the line holding ``start`` up to (not including) the
    line holding ``end``, dedented so it can be executed."""
    lines = inspect.getsource(method).splitlines()
    try:
        i = next(n for n, line in enumerate(lines) if start in line)
        j = next(n for n, line in enumerate(lines) if n > i and end in line)
    except StopIteration:
        pytest.fail(f"TRL's {method.__qualname__} no longer contains '{start}' ... '{end}': update the parity test")
    return textwrap.dedent("\n".join(lines[i:j]))

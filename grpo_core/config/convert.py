"""YAML (the reference's layout, Axolotl's, or TRL's CLI file) -> grpo's TOML, for ``grpo config convert``.

The layouts map one to one: top-level keys stay top-level, ``vllm:`` and
``trl:`` become ``[vllm]`` and ``[trl]``, the ``datasets:`` list becomes
``[[datasets]]`` entries. Written by hand rather than with ``tomli_w.dumps``
so tables and arrays of tables come out as sections a person would write.
TOML has no null: ``null`` values are left out (they mean "the default") and
listed in a comment so nothing disappears silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import tomli_w

from grpo_core.config.axolotl import explain as axolotl_explain
from grpo_core.config.trl_cli import Converted

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: Any) -> str:
    key = str(key)
    # fullmatch: `$` would also accept a key ending in a newline
    return key if _BARE_KEY.fullmatch(key) else tomli_w.dumps({"k": key}).split("=", 1)[1].strip()


def _value(value: Any) -> str:
    """One TOML value, inline (arrays of scalars, inline tables, ...)."""
    if isinstance(value, dict) and not value:
        return "{}"  # tomli_w would open a [table] for it
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _drop_none(value: Any, path: str, dropped: list[str]) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if v is None:
                dropped.append(sub)
            else:
                out[k] = _drop_none(v, sub, dropped)
        return out
    if isinstance(value, list):
        kept = []
        for i, v in enumerate(value):
            if v is None:
                dropped.append(f"{path}[{i}]")
            else:
                kept.append(_drop_none(v, f"{path}[{i}]", dropped))
        return kept
    return value


Explain = Callable[[str, Any], tuple[str | None, bool]]


def _render_table(
    data: dict[str, Any], prefix: list[str], out: list[str], explain: Explain | None = None, where: str = ""
) -> None:
    tables, arrays = [], []
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        note, drop = explain(path, value) if explain else (None, False)
        if drop:  # refused: kept as a comment, so the TOML runs and shows what was left
            out.append(f"# {_key(key)} = {json.dumps(value, ensure_ascii=False, default=str)}  # {note}")
        elif isinstance(value, dict) and value:
            tables.append((key, value, note))
        elif _is_table_list(value):
            arrays.append((key, value))
        else:
            out.append(f"{_key(key)} = {_value(value)}" + (f"  # {note}" if note else ""))
    for key, value, note in tables:
        path = [*prefix, _key(key)]
        out.append("")
        out.append(f"[{'.'.join(path)}]" + (f"  # {note}" if note else ""))
        _render_table(value, path, out, explain, f"{where}.{key}" if where else str(key))
    for key, items in arrays:
        path = [*prefix, _key(key)]
        for i, item in enumerate(items):
            out.append("")
            out.append(f"[[{'.'.join(path)}]]")
            _render_table(item, path, out, explain, f"{where}.{key}[{i}]" if where else f"{key}[{i}]")


def to_toml_text(data: dict[str, Any], explain: bool = False, trl: Converted | None = None) -> str:
    """Render a raw config dict (as read from YAML) as TOML text.

    ``explain``: comment every key another framework's layout brings (Axolotl's)
    with what grpo does with it, and write refused keys commented out with
    the reason (:func:`grpo_core.config.axolotl.explain`). ``trl``: ``data``
    was converted from TRL's CLI layout (:func:`grpo_core.config.trl_cli.from_trl_cli`):
    its notes go on their keys' lines, what it left out goes first, commented.
    """
    dropped: list[str] = []
    clean = _drop_none(data, "", dropped)
    out: list[str] = []
    if trl is not None:
        out.append("# Converted from TRL's CLI layout (trl grpo --config); TRL's defaults that grpo sets otherwise")
        out.append("# are written out, so this trains as the TRL run would (docs/from-trl.md).")
        for key, value, why in trl.left_out:
            out.append(f"# {key} = {json.dumps(value, ensure_ascii=False, default=str)}  # left out: {why}")
    if dropped:
        out.append("# null in the source (left out; the default applies): " + ", ".join(dropped))
    if trl is not None:
        notes = trl.notes

        def explain_trl(path: str, value: Any) -> tuple[str | None, bool]:
            return notes.get(path), False

        _render_table(clean, [], out, explain_trl)
    else:
        _render_table(clean, [], out, axolotl_explain if explain else None)
    return "\n".join(out).lstrip("\n") + "\n"

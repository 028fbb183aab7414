"""No option is silently ignored.

Every field of the config schema is either read by grpo's code (an
attribute access or a name lookup somewhere in ``grpo_core/`` or
``plugins/``, outside the schema and the compatibility list themselves) or
listed in :data:`grpo_core.config.compat.COMPATIBILITY_ONLY`, whose keys
``grpo config check`` and ``grpo run`` name in a warning.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest
from helpers import REPO
from pydantic import BaseModel

from grpo_core.config.compat import COMPATIBILITY_ONLY, compat_keys, compat_warnings
from grpo_core.config.loader import validate
from grpo_core.config.schema import DatasetSpec, GRPOConfig, PluginSettings, TrlSettings
from grpo_plugins.vllm.settings import VllmSettings

NOT_READERS = {
    REPO / "grpo_core" / "config" / "schema.py",
    REPO / "grpo_core" / "config" / "compat.py",
    REPO / "plugins" / "vllm" / "settings.py",  # the [vllm] table's schema, owned by the vLLM plugin
}
TABLES: dict[str, type[BaseModel]] = {
    "": GRPOConfig,
    "vllm.": VllmSettings,  # the vLLM plugin's table
    "trl.": TrlSettings,
    "plugins.": PluginSettings,
    "datasets[].": DatasetSpec,
}


def schema_keys() -> list[str]:
    keys = []
    for prefix, model in TABLES.items():
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                continue  # a table: its own fields are listed under its prefix
            if prefix == "" and name == "datasets":
                continue
            keys.append(prefix + name)
    return keys


def names_read_by_the_code() -> set[str]:
    """Attribute names accessed, and string constants used as names, in the
    code that runs (the schema's own definitions do not count)."""
    found: set[str] = set()
    for root in (REPO / "grpo_core", REPO / "plugins"):
        for path in root.rglob("*.py"):
            if path in NOT_READERS:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute):
                    found.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    found.add(node.value)
    return found


def test_every_option_is_read_or_declared_compatibility_only() -> None:
    read = names_read_by_the_code()
    silent = [key for key in schema_keys() if key.rsplit(".", 1)[-1] not in read and key not in compat_keys()]
    assert silent == [], f"options nothing reads and no warning names: {silent}"


def test_the_scan_would_catch_an_unread_option() -> None:
    assert "some_option_nobody_reads" not in names_read_by_the_code()
    assert "max_completion_length" in names_read_by_the_code()


@pytest.mark.parametrize("item", COMPATIBILITY_ONLY, ids=lambda item: item.key)
def test_each_compatibility_key_is_a_real_option_and_is_named_when_set(item: Any) -> None:
    assert item.key in schema_keys()
    table, _, name = item.key.rpartition(".")
    data: dict[str, Any] = {"base_model": "m", "trl": {"reward_funcs": ["r"]}}
    (data.setdefault(table, {}) if table else data)[name] = item.example
    warnings = compat_warnings(validate(data))
    assert any(item.key in w and "no effect" in w for w in warnings), warnings
    assert not any(item.key in w for w in compat_warnings(validate({"base_model": "m"})))

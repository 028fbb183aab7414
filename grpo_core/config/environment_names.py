"""The environment names dataset rows choose, read from the config.

A run with several environments (``[plugins] environment`` as a list, or
``trl.environment_factory`` as a table, TRL 1.16's dict) routes each row by
its ``environment`` column (:mod:`grpo_core.generation.environment_routes`).
Which names exist is decided here, from the config and the implementations'
classes alone, so ``grpo run`` checks every row before training and the
checks refuse a name two implementations both serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError, DataError
from grpo_core.contract.extension_points import BY_NAME, declared
from grpo_core.contract.types import Prompt

ROUTE_COLUMN = "environment"


@dataclass(frozen=True)
class RouteTable:
    """Row name -> implementation name; ``routed``: whether rows choose."""

    names: dict[str, str]
    routed: bool


def route_table(cfg: GRPOConfig, classes: list[tuple[str, Any]]) -> RouteTable:
    """The names rows may choose, from the config and the implementations'
    classes (``(implementation name, class)``, imported, not built)."""
    point = BY_NAME["environment"]
    names: dict[str, str] = {}
    declared_any = False
    for implementation, cls in classes:
        own = declared(cls, point, "names")
        if callable(own):
            own = own(cfg)
        if own:
            declared_any = True
        for name in own or [implementation]:
            if name in names:
                raise ConfigError(
                    f"environment name '{name}' is served by both '{names[name]}' and '{implementation}' "
                    "(plugins.environment): rows could not tell them apart; rename one (a trl.environment_factory key)"
                )
            names[str(name)] = implementation
    return RouteTable(names, declared_any or len(classes) > 1)


def check_rows(prompts: list[Prompt], table: RouteTable, label: str = "dataset") -> None:
    """Every row names an environment of this run (when rows choose)."""
    if not table.routed:
        return
    for prompt in prompts:
        name = prompt.columns.get(ROUTE_COLUMN)
        if name not in table.names:
            where = (
                "has no 'environment' column" if ROUTE_COLUMN not in prompt.columns else f"has `environment={name!r}`"
            )
            raise DataError(
                f"{label} row {prompt.index} {where}, which is not among the environments of this run. Expected one "
                f"of: {list(table.names)}. With several environments (plugins.environment as a list, or "
                "trl.environment_factory as a table) every row names its own in an 'environment' column."
            )

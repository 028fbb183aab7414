"""Several environments in one run: each dataset row names its own.

TRL 1.16 takes ``environment_factory`` as a dict of name -> class and reads
each row's ``environment`` column to pick one. grpo does the same for every
kind of environment: ``[plugins] environment = ["tools", "agent",
"openenv"]`` builds each implementation, and a row's ``environment`` value
picks the implementation that serves that name: its own name, or one of the
names it declares (``names(config)``: the ``tools`` environment serves the
keys of a ``trl.environment_factory`` table;
:mod:`grpo_core.config.environment_names`). Rows are checked at data
loading, so an unknown name fails with the row and the names (TRL's
message), before the model loads.

Routing is on when the run has more than one implementation or one that
declares names; otherwise, as in TRL, the column is not read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo_core.config.environment_names import ROUTE_COLUMN, RouteTable
from grpo_core.contract.errors import DataError
from grpo_core.contract.types import Prompt


def call_hook(method: Callable[..., Any], **arguments: Any) -> Any:
    """Call one implementation's hook directly, with the arguments its
    signature names (pluggy's rule: a hook may take any subset)."""
    accepted = inspect.signature(method).parameters
    return method(**{k: v for k, v in arguments.items() if k in accepted})


class EnvironmentRouter:
    """Makes each episode with the implementation its row names."""

    def __init__(self, table: RouteTable, objects: dict[str, Any]) -> None:
        self.table = table
        self.objects = objects

    def new_episode(self, prompt: Prompt, sample: int) -> Any:
        name = prompt.columns.get(ROUTE_COLUMN)
        implementation = self.table.names.get(name)  # type: ignore[arg-type]
        if implementation is None:  # checked at data loading; a prompt from elsewhere (replay) may still miss
            raise DataError(f"row {prompt.index} has `environment={name!r}`; expected one of {list(self.table.names)}")
        return call_hook(self.objects[implementation].grpo_environment_episode, prompt=prompt, sample=sample)

    def name_of(self, prompt: Prompt) -> str | None:
        return str(prompt.columns.get(ROUTE_COLUMN)) if self.table.routed else None

"""Objects a script handed to :func:`grpo.train` that no import path reaches
(a class or function defined in the script itself, a closure, an instance).

A config names user code by import path (``trl.rollout_func``,
``trl.environment_factory``, ``trl.tools``), and every loader imports it the
same way. :func:`hold` keeps such an object as an attribute of this module and
returns the path that reaches it (``grpo_core.host.script_objects.<name>``), so the
loaders need no second way in. They live as long as the process: a
subprocess (a reward worker, a second training process started by a
launcher) sees only what its own script put here.
"""

from __future__ import annotations

import sys
from typing import Any

PREFIX = f"{__name__}."

CALLABLE_PREFIX = "python:"
"""``trl.reward_funcs`` entries for reward callables a script handed to
:func:`grpo.train` that no import path reaches (answered by an in-memory
plugin, :mod:`grpo_core.interface.api`)."""


def hold(obj: Any, name: str) -> str:
    """Keep ``obj`` here under ``name`` (or ``name_2``, ... when that is
    taken by another object); the import path that reaches it."""
    module = sys.modules[__name__]
    candidate, n = name, 1
    while getattr(module, candidate, obj) is not obj:
        n += 1
        candidate = f"{name}_{n}"
    setattr(module, candidate, obj)
    return PREFIX + candidate

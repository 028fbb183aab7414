"""Numbers a config may hold that its types allow but no run can use.

The schema's bounds refuse a negative ``micro_batch_size`` and a NaN
anywhere; three kinds of value still passed and broke a run later with a
library's traceback: an infinite float where only a finite one means
anything (``learning_rate = inf``, ``num_epochs = inf`` overflowed when
turned into steps), a seed outside what numpy accepts (``seed = -1``), and a
port outside 0-65535. :func:`range_problems` names each, found by walking the
schema, so a new field is covered without a rule of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

SEED_LIMIT = 2**32  # numpy's RandomState takes seeds in [0, 2**32)

INFINITY_ALLOWED = frozenset(
    {
        "max_grad_norm",  # no clipping
        "reward_timeout",
        "step_timeout",
        "vllm_importance_sampling_cap",
        "off_policy_mask_threshold",
        "delta",
        "epsilon_high",  # no upper clip
        "entropy_max",
        "grad_norm_max",
        "logp_gap_max",
    }
)
"""Float keys where an infinite value means "no limit" (the last part of the key)."""


def _values(node: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name in type(node).model_fields:
        value = getattr(node, name, None)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from _values(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _values(item, f"{key}[{i}].")
        else:
            yield key, value


def range_problems(cfg: BaseModel) -> list[str]:
    """Each value of ``cfg`` its type allows but a run cannot use, with the fix."""
    problems = []
    for key, value in _values(cfg):
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(value, float) and math.isinf(value) and leaf not in INFINITY_ALLOWED:
            problems.append(f"'{key}' is {value}: it must be a finite number.")
        elif isinstance(value, int) and not isinstance(value, bool):
            if leaf == "seed" and not 0 <= value < SEED_LIMIT:
                problems.append(f"'{key}' is {value}: a seed must be between 0 and {SEED_LIMIT - 1}.")
            elif leaf.endswith("port") and not 0 <= value <= 65535:
                problems.append(f"'{key}' is {value}: a port is between 0 and 65535.")
    return problems

"""The run context: what an extension-point implementation is built with.

Implementations are constructed as ``factory(context)``. The context gives
them the validated config and the pieces the trainer owns, without the
trainer having to know which of them each implementation needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


@dataclass
class RunContext:
    """Shared state of one run.

    ``get_model`` returns the trainer's current (unwrapped) model; it is a
    callable rather than the model so implementations built before the model
    is loaded (e.g. a vLLM rollout that starts a server) still see the live
    one later. ``tokenizer`` is the processing class (HF tokenizer).
    ``services`` is a small registry where implementations of different
    extension points can share an object without importing each other (e.g.
    the vLLM rollout publishes its server client under ``"vllm.client"`` and
    the vLLM weight sync reads it).
    """

    config: GRPOConfig
    output_dir: Path
    tokenizer: Any = None
    get_model: Callable[[], Any] = lambda: None
    services: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = print

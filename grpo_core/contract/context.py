"""The run context: what every implementation is built with.

Implementations are constructed as ``factory(context)`` (or
``factory(context, settings)``, see ``docs/plugins.md``). The context
carries the validated config and the pieces the trainer owns, without the
trainer having to know which of them each implementation needs. It holds
nothing else: implementations of different extension points that must
cooperate do it through typed hooks (the rollout's engine handle reaches the
weight sync as an argument of ``grpo_sync_weights``), never through shared
state here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig


def _no_model() -> Any:
    return None


@dataclass
class RunContext:
    """Shared, read-only facts of one run."""

    config: GRPOConfig
    """The validated config, defaults filled in."""
    output_dir: Path
    """Where checkpoints, logs and the final model go; an implementation may
    keep its own files in a subfolder (and should remove large ones at
    ``grpo_train_end``)."""
    tokenizer: Any = None
    """The processing class (an HF tokenizer), loaded before any
    implementation is built."""
    get_model: Callable[[], Any] = _no_model
    """Returns the trainer's current (unwrapped) model, ``None`` until it is
    loaded: implementations are built before the model so that an engine
    (a vLLM server) can start while the model loads. Inside the call of a
    rollout that ``generates_on_every_rank`` (several processes), the policy
    made whole on the calling process for that call (``docs/plugins.md``)."""
    log: Callable[[str], None] = print
    """Print a line on the run's console."""
    engine_requirements: frozenset[str] = field(default_factory=frozenset)
    """The capabilities the chosen weight sync needs from the rollout's
    engine (its ``required_capabilities``), so a rollout starts its engine
    accordingly (e.g. with LoRA loading only when adapters will be loaded)."""
    start_step: int = 0
    """The step this run continues from: the resumed checkpoint's step, 0 for
    a fresh start. The output's logs hold nothing after it (a killed run's
    later rows were set aside): a tracker that keeps one run across restarts
    continues it from here, dropping what it logged after this step where
    it can (``grpo_core.checkpointing.lineage``)."""

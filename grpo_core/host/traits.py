"""What the chosen implementations declare, as the config rules and the
training backends read it: a rule asks what an implementation can do, never
which one it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChosenTraits:
    """What the chosen implementations declare (their classes imported, never
    built), for the rules below: a rule asks what an implementation can do,
    never which one it is, so a third-party rollout or sync is judged like a
    built-in one. An implementation that cannot be imported declares
    nothing here; :func:`import_chosen` reports it."""

    names: dict[str, str]
    engine_in_process: bool = False  # the rollout's engine lives in the trainer's process
    sync_sends: str | None = None  # the weight sync's ``sends``: "merged_weights", "adapter" or "nothing"
    loss_uses_hidden_states: bool = False  # the policy loss runs the decoder itself (a fused LM head)

"""The ``none`` environment: no episodes, every completion is one model turn.

It is what a run gets unless ``[plugins] environment``, ``trl.tools`` or
``trl.environment_factory`` asks for episodes."""

from __future__ import annotations

from grpo_core.plugin_api import Prompt, RunContext, hookimpl


class NoEnvironment:
    """Single-turn: one completion per sample, no episode.

    ``grpo.environment:none`` declares ``episodic = False``, so the core
    samples single-turn completions and never asks for an episode."""

    episodic = False

    def __init__(self, context: RunContext) -> None:
        self.context = context

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> None:
        return None

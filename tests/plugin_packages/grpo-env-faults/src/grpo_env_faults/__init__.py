"""Environments that fail on purpose, for the fault tests: sample 0 of
every prompt raises (``raising``) or hangs (``hanging``) at its first step;
the other samples play a two-turn game and score 1.0."""

from __future__ import annotations

import time

from grpo_core.plugin_api import EnvironmentReply, hookimpl


class TwoTurns:
    def __init__(self, fault: str | None) -> None:
        self.fault = fault
        self.turns = 0

    def reset(self):
        return None

    def step(self, text: str) -> EnvironmentReply:
        self.turns += 1
        if self.fault == "raise":
            raise ValueError("the board is on fire")
        if self.fault == "hang":
            time.sleep(600)
        if self.turns == 2:
            return EnvironmentReply(done=True, reward=1.0)
        return EnvironmentReply(messages=[{"role": "user", "content": "Once more."}], reward=0.0)


class Raising:
    provides_reward = True

    def __init__(self, context) -> None:
        pass

    @hookimpl
    def grpo_environment_episode(self, prompt, sample):
        return TwoTurns("raise" if sample == 0 else None)


class Hanging(Raising):
    @hookimpl
    def grpo_environment_episode(self, prompt, sample):
        return TwoTurns("hang" if sample == 0 else None)

"""A gymnasium-style text environment as a grpo environment (the worked
adapter of docs/environments.md, "Environments from other libraries").

It fits any class with gymnasium's API whose observations and actions are
strings: ``reset(seed=...) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``.
Publish ``GymTextEnvironment`` from your own package::

    [project.entry-points."grpo.environment"]
    gym_text = "my_pkg.gym_text:GymTextEnvironment"

and choose it with ``[plugins] environment = "gym_text"`` and
``[plugins.gym_text] env = "my_pkg.games.Guess"``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from grpo_core import hookimpl
from grpo_core.contract.types import EnvironmentReply, Prompt
from grpo_core.data.prompts import import_from_cwd


class GymTextEpisode:
    """One episode on its own environment instance."""

    def __init__(self, env: Any, seed: int) -> None:
        self.env, self.seed = env, seed

    def reset(self) -> str:
        observation, _info = self.env.reset(seed=self.seed)
        return observation  # appended to the prompt's last user message

    def step(self, text: str) -> EnvironmentReply:
        observation, reward, terminated, truncated, _info = self.env.step(text)
        done = bool(terminated or truncated)
        messages = [] if done else [{"role": "user", "content": observation}]
        return EnvironmentReply(messages=messages, done=done, reward=float(reward))

    def close(self) -> None:
        self.env.close()


class GymTextEnvironment:
    """``[plugins.gym_text] env = "module.Class"``: a new instance per episode,
    every episode of a prompt reset with the same seed (its dataset index)."""

    episodic = True
    provides_reward = True  # the rewards step() returns are the episode's reward

    class Settings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        env: str  # 'module.Class' of the text environment

    def __init__(self, context: Any, settings: GymTextEnvironment.Settings) -> None:
        self.make = import_from_cwd(settings.env)

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> GymTextEpisode:
        return GymTextEpisode(self.make(), seed=prompt.index)

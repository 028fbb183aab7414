"""Guess a number: a multi-turn environment that answers in words.

Each dataset row holds a ``secret`` (and its range in the prompt). The model
guesses; the environment says "Higher." or "Lower." until the guess is
right or the turns run out. The episode's reward is 1.0 for a right guess,
less ``turn_penalty`` for each extra turn it took; a lost game earns up to
``closeness`` for how near its last guess came. With ``hint_reward`` each
guess the hints so far allow (above every "Higher.", below every "Lower.")
earns that much at its own turn: the hints as a reward per turn, what
per-turn credit (``advantage_aggregation = "turn_returns"``) can use.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from grpo_core.plugin_api import EnvironmentReply, Prompt, hookimpl

NUMBER = re.compile(r"-?\d+")


class Settings(BaseModel):
    """``[plugins.guess_number]``."""

    turn_penalty: float = Field(0.1, ge=0, description="Reward taken off for each guess after the first.")
    column: str = Field("secret", description="The dataset column with the number to guess.")
    closeness: float = Field(
        0.0,
        ge=0,
        description="For a game lost, up to this much reward for a last guess close to the secret (a dense "
        "signal: following the hints is learnable before winning is).",
    )
    span: int = Field(15, ge=1, description="The distance of the farthest possible guess (for closeness).")
    hint_reward: float = Field(
        0.0,
        ge=0,
        description="Reward, at its own turn, for each guess the hints so far allow (a per-turn signal: following "
        "'Higher.'/'Lower.' is rewarded where it happens, not only through the game's end).",
    )


class GuessEpisode:
    """One game: a secret, and the guesses so far."""

    def __init__(self, secret: int, settings: Settings) -> None:
        self.secret = secret
        self.settings = settings
        self.guesses: list[int] = []
        self.low, self.high = -(10**9), 10**9  # what the hints so far allow

    def reset(self) -> None:
        return None  # the dataset's prompt states the game

    def final_reward(self) -> float:
        """A lost game's closeness reward (0 when won: the win was scored)."""
        if not self.guesses or self.guesses[-1] == self.secret:
            return 0.0
        return self.settings.closeness * max(0.0, 1.0 - abs(self.guesses[-1] - self.secret) / self.settings.span)

    def step(self, text: str) -> EnvironmentReply:
        found = NUMBER.findall(text)
        if not found:
            return EnvironmentReply(messages=[{"role": "user", "content": "Answer with one number."}])
        guess = int(found[-1])
        self.guesses.append(guess)
        followed = self.settings.hint_reward if self.low <= guess <= self.high else 0.0
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.settings.turn_penalty * (len(self.guesses) - 1))
            return EnvironmentReply(done=True, reward=reward + followed, info={"guesses": len(self.guesses)})
        if guess < self.secret:
            hint, self.low = "Higher.", max(self.low, guess + 1)
        else:
            hint, self.high = "Lower.", min(self.high, guess - 1)
        return EnvironmentReply(
            messages=[{"role": "user", "content": hint}], reward=followed, info={"guesses": len(self.guesses)}
        )


class GuessNumber:
    """``grpo.environment:guess_number``."""

    Settings = Settings
    provides_reward = True  # its reward joins reward_funcs as 'environment'
    turn_rewards = True  # each step's reply carries the turn's reward (per-turn credit may use it)

    def __init__(self, context, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()

    @hookimpl
    def grpo_environment_episode(self, prompt: Prompt, sample: int) -> GuessEpisode:
        return GuessEpisode(int(prompt.columns[self.settings.column]), self.settings)

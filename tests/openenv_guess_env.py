"""A small OpenEnv environment for the adapter's tests: guess a number.

A real OpenEnv app (openenv-core's ``create_fastapi_app``) that the tests
serve with uvicorn in a subprocess on a free loopback port::

    python -m uvicorn openenv_guess_env:app --app-dir tests --port PORT

``reset(seed)`` draws the secret from 1..20 with ``random.Random(seed)``; each
step reads the last integer of the message and answers "higher", "lower" or
"correct" (reward 1, done); a wrong guess costs 0.1 and the game ends after
``MAX_GUESSES``. Every session (WebSocket connection) gets its own
instance, whose ``instance`` id and ``guesses`` count the observation shows,
so a test can tell sessions apart (and ``pid``, the server process). ``MAX_CONCURRENT_ENVS`` (environment
variable) sets the server's session limit. ``app_bet`` is the same game
with a two-field action.
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

MAX_GUESSES = 6


class GuessAction(Action):
    message: str


class BetAction(Action):
    """An action of two required fields (``app_bet``): the adapter cannot
    guess where the text goes, ``bet_action`` builds it."""

    message: str
    stake: int


def bet_action(text: str) -> dict[str, Any]:
    """``plugins.openenv.action_function`` for ``app_bet``."""
    return {"message": text, "stake": 1}


def as_messages(observation: dict[str, Any]) -> list[dict[str, str]]:
    """``plugins.openenv.observation_function``: the observation as chat messages."""
    return [{"role": "user", "content": f"[{observation['guesses']} so far] {observation['text']}"}]


class GuessObservation(Observation):
    text: str
    guesses: int = 0
    instance: str = ""
    episode_id: str | None = None
    pid: int = 0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.instance = uuid.uuid4().hex
        self._state = State(episode_id=None, step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 20)
        self._state = State(episode_id=episode_id, step_count=0)
        hint = kwargs.get("hint")
        text = "Guess my number between 1 and 20." + (f" Hint: {hint}" if hint else "")
        over = bool(kwargs.get("over"))  # a game that is over before it starts
        return GuessObservation(
            text=text, instance=self.instance, episode_id=episode_id, reward=0.0, done=over, pid=os.getpid()
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        if "CRASH" in action.message:
            raise RuntimeError("the game engine broke")
        if "SLEEP" in action.message:  # a step slower than the adapter's step_timeout
            time.sleep(3.0)
        numbers = re.findall(r"-?\d+", action.message)
        common = {
            "guesses": self._state.step_count,
            "instance": self.instance,
            "episode_id": self._state.episode_id,
            "pid": os.getpid(),
        }
        if numbers and int(numbers[-1]) == self.secret:
            return GuessObservation(text="correct", done=True, reward=1.0, **common)
        over = self._state.step_count >= MAX_GUESSES
        if not numbers:
            text = "say a number"
        else:
            text = "higher" if int(numbers[-1]) < self.secret else "lower"
        return GuessObservation(text=text, done=over, reward=-0.1, **common)

    @property
    def state(self) -> State:
        return self._state


SESSIONS = int(os.environ.get("MAX_CONCURRENT_ENVS", "16"))
app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=SESSIONS)
app_bet = create_fastapi_app(GuessEnvironment, BetAction, GuessObservation, max_concurrent_envs=SESSIONS)

"""The worked adapter of docs/environments.md (examples/environments/gym_text.py)
drives a gymnasium-style text environment the way the episode driver does.

``Guess`` below has gymnasium's ``reset``/``step`` signatures and string
observations; gymnasium itself is not installed here and the adapter does
not import it (it only calls those two methods)."""

from __future__ import annotations

import random
import sys

import pytest
from helpers import REPO

from grpo_core.contract.types import Episode, Prompt
from grpo_core.host.plugin_host import contract_problem, validate_settings

sys.path.insert(0, str(REPO / "examples" / "environments"))
from gym_text import GymTextEnvironment  # noqa: E402


class Guess:
    """Guess a number in 1..8: 'higher'/'lower' until right (reward 1) or 4 tries (truncated)."""

    closed = 0

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.secret, self.tries = random.Random(seed).randint(1, 8), 0
        return "Guess my number between 1 and 8.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.tries += 1
        guess = int(action.split()[-1])
        if guess == self.secret:
            return "correct", 1.0, True, False, {}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, self.tries >= 4, {}

    def close(self) -> None:
        Guess.closed += 1


def test_worked_gym_adapter_plays_episodes():
    assert contract_problem("grpo.environment", GymTextEnvironment) is None  # the hook contract, as grpo checks it
    settings = validate_settings(GymTextEnvironment, "gym_text", {"env": "test_environment_gym_example.Guess"})
    environment = GymTextEnvironment(None, settings)
    prompt = Prompt(prompt="Play.", prompt_ids=[1], index=3)
    a, b = environment.grpo_environment_episode(prompt, 0), environment.grpo_environment_episode(prompt, 1)
    assert isinstance(a, Episode) and a.env is not b.env  # one instance per episode
    assert a.reset() == b.reset() == "Guess my number between 1 and 8."
    assert a.env.secret == b.env.secret == random.Random(3).randint(1, 8)  # same seed across the group
    low, high, replies = 1, 8, []
    while True:
        guess = (low + high) // 2
        reply = a.step(f"I say {guess}")
        replies.append(reply)
        if reply.done:
            break
        assert reply.messages == [{"role": "user", "content": reply.messages[0]["content"]}]
        low, high = (guess + 1, high) if reply.messages[0]["content"] == "higher" else (low, guess - 1)
    assert replies[-1].reward == 1.0 and replies[-1].messages == [] and sum(r.reward for r in replies) == 1.0
    truncated = [b.step("I say 9") for _ in range(4)]
    assert [r.done for r in truncated] == [False, False, False, True] and all(r.reward == 0.0 for r in truncated)
    a.close(), b.close()
    assert Guess.closed == 2
    with pytest.raises(Exception, match="env"):
        validate_settings(GymTextEnvironment, "gym_text", {})

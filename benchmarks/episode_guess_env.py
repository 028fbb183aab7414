"""A guess-the-number game as a TRL 1.16 ``environment_factory`` class.

One class serves both sides of ``bench_episodes_vs_trl.py``: TRL's
``GRPOTrainer(environment_factory=GuessNumberEnv)`` and grpo's
``trl.environment_factory = "episode_guess_env.GuessNumberEnv"``. TRL's
convention: ``reset(**row)`` starts an episode from a dataset row (here its
``secret`` column), every public method but ``reset``/``get_reward`` is a
tool, and ``get_reward()`` scores the finished episode.

Reward: 1.0 for a right guess, 0.1 less for each guess before it; a game
lost gets up to ``CLOSENESS`` for how near its last guess came (a dense
signal, as in ``examples/guess-number``); no guess at all gets 0.
"""

from __future__ import annotations

LOW, HIGH = 1, 16
TURN_PENALTY = 0.1
CLOSENESS = 0.5


class GuessNumberEnv:
    # every scored game as (secret, guesses, reward), for the benchmark's
    # side-by-side account of how the two trainers' episodes went
    scored: list[tuple[int, list[int], float]] = []

    def __init__(self) -> None:
        self.secret = LOW
        self.guesses: list[int] = []
        self.solved_at: int | None = None

    def reset(self, secret: int = LOW, **row) -> None:
        self.secret = int(secret)
        self.guesses = []
        self.solved_at = None
        return None  # the dataset's prompt states the game

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess, a whole number from 1 to 16.
        """
        number = int(number)
        self.guesses.append(number)
        if number == self.secret:
            if self.solved_at is None:
                self.solved_at = len(self.guesses)
            return "Correct!"
        return "Higher." if number < self.secret else "Lower."

    def get_reward(self) -> float:
        reward = episode_reward(self.secret, self.guesses, self.solved_at)
        GuessNumberEnv.scored.append((self.secret, list(self.guesses), reward))
        return reward


def episode_reward(secret: int, guesses: list[int], solved_at: int | None) -> float:
    """The game's score (see the module docstring)."""
    if solved_at is not None:
        return max(0.0, 1.0 - TURN_PENALTY * (solved_at - 1))
    if not guesses:
        return 0.0
    return CLOSENESS * max(0.0, 1.0 - abs(guesses[-1] - secret) / (HIGH - LOW))

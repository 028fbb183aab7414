"""How a generation call's prompts are shared out over the training processes
(grpo_core.generation.spread.prompt_shares). The two real processes sampling
their shares are tests/e2e/test_spread_generation.py.
"""

from __future__ import annotations

from grpo_core.generation.spread import prompt_shares


def test_prompt_shares_are_contiguous_and_as_even_as_the_count_allows() -> None:
    assert prompt_shares(4, 2) == [(0, 2), (2, 4)]
    assert prompt_shares(3, 2) == [(0, 2), (2, 3)]
    assert prompt_shares(1, 3) == [(0, 1), (1, 1), (1, 1)]  # a call smaller than the world: empty shares
    assert prompt_shares(0, 2) == [(0, 0), (0, 0)]

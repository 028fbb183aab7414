"""Prompts into scored batches: the producer (prefetch, streaming), multi-turn
episodes, user rollout functions, generation shared across ranks, and held-out
evaluation."""

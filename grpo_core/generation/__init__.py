"""Prompts into scored batches: the producer (prefetch, streaming, partial rollouts), which policy
version sampled each token, multi-turn episodes, user rollout functions, generation shared across
ranks, and held-out evaluation."""

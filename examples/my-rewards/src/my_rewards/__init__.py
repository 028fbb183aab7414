"""A grpo reward package: ``brevity`` (``my_rewards.rewards``), found by grpo through its entry point."""

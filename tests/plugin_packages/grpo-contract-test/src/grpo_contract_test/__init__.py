"""Test plugin package for grpo's contract (see pyproject.toml)."""

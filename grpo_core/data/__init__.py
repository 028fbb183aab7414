"""Datasets into prompts: loading each ``[[datasets]]`` entry, its transform,
and the chat template applied once."""

"""``brevity``: TRL's reward convention, with settings from the config's ``[plugins.brevity]``."""

from pydantic import BaseModel, ConfigDict, Field


class BrevitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in [plugins.brevity] is an error naming the key
    max_words: int = Field(50, ge=1, description="Words above which the reward falls.")


def brevity(completions, max_words: int = 50, **kwargs) -> list[float]:
    """1.0 up to max_words words, then falling to 0.0 at twice as many."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [max(0.0, min(1.0, 2.0 - len(t.split()) / max_words)) for t in texts]


brevity.Settings = BrevitySettings

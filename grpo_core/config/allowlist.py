"""Which plugin distributions may load: ``GRPO_PLUGINS_ALLOW`` and the
config's ``plugins.allow``. Config-level, so that the config's own plugin
tables (:mod:`grpo_core.config.plugin_tables`) and the plugin host apply one rule."""

from __future__ import annotations

import os

from grpo_core.contract.errors import ConfigError

SELF_DISTRIBUTION = "grpo"
ALLOW_ENV = "GRPO_PLUGINS_ALLOW"


def normalise(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def allowlist_from_env() -> set[str] | None:
    """``GRPO_PLUGINS_ALLOW`` as a set of names; ``None`` when unset or empty."""
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def effective_allowlist(config_allow: set[str] | None) -> set[str] | None:
    """The normalised distributions that may load (grpo's own included), or
    ``None`` for no restriction.

    The environment's list bounds the config's: with both set the result is
    their intersection, and a config naming a distribution the environment
    does not allow is a :class:`ConfigError` naming both, so a downloaded
    config can narrow an administrator's list but never widen it."""
    env = {normalise(d) for d in allowlist_from_env() or ()}
    config = {normalise(d) for d in config_allow or ()}
    if env and config:
        outside = sorted(config - env - {SELF_DISTRIBUTION})
        if outside:
            raise ConfigError(
                f"plugins.allow names {', '.join(repr(d) for d in outside)}, which {ALLOW_ENV} "
                f"({os.environ.get(ALLOW_ENV, '').strip()}) does not allow: the environment's list is an upper bound a "
                f"config can only narrow. Remove {'them' if len(outside) > 1 else 'it'} from plugins.allow, or have "
                f"whoever sets {ALLOW_ENV} add {'them' if len(outside) > 1 else 'it'} there."
            )
    if not (env or config):
        return None
    chosen = (config & env) if (env and config) else (config or env)
    return chosen | {SELF_DISTRIBUTION}  # never None here: an empty intersection still restricts

"""The config check ``grpo run`` and ``grpo config check`` make: the config
layer's rules (:func:`~grpo_core.validation.checks.check_config`) with the
training backends' own (:func:`~grpo_core.parallel.config_problems`).

The backends sit above the config layer, so the two meet here, one layer up:
a new backend's rules live in its own module and reach every check through
the backend table, with no change to the config layer.
"""

from __future__ import annotations

from grpo_core.config.schema import GRPOConfig
from grpo_core.host.plugin_host import PluginHost
from grpo_core.parallel import config_problems
from grpo_core.validation.checks import check_config

__all__ = ["check_run_config"]


def check_run_config(cfg: GRPOConfig, host: PluginHost | None = None, num_processes: int | None = None) -> list[str]:
    """:func:`~grpo_core.validation.checks.check_config` with every training
    backend's rules: the warnings, or a :class:`~grpo_core.contract.errors.ConfigError`
    listing every problem."""
    return check_config(cfg, host, num_processes, backend_rules=config_problems)

"""``import grpo``: the names a training script needs, in one place.

A thin alias over :mod:`grpo_core` (where everything lives)::

    import grpo
    result = grpo.train("config.toml", max_steps=3)

See :func:`grpo_core.interface.api.train`. ``python -m grpo run config.toml``
is the ``grpo`` command (:mod:`grpo.__main__`); a plugin imports
:mod:`grpo_core.plugin_api`, not this.
"""

from grpo_core import __version__
from grpo_core.config.loader import load_config
from grpo_core.config.schema import GRPOConfig
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.interface.api import TrainResult, train

__all__ = ["ConfigError", "GRPOConfig", "GrpoError", "TrainResult", "__version__", "load_config", "train"]

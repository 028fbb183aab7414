"""grpo: GRPO training with a plugin contract for every extension point.

Plugin authors import from :mod:`grpo_core.plugin_api` (the one public
surface: :data:`hookimpl`, the types, the context, the errors and named
helpers); the contract itself is :mod:`grpo_core.contract.hookspecs`. The
folders are the layers, lowest first, each importing only itself and those
before it: ``contract``, ``runtime``, ``config``, ``host``, ``modeling``,
``observability``, ``validation`` (the config's checks, which ask the rules
of the layers below), ``scoring``, ``training``, ``interface``. Modules that
once sat at this top level keep their old import paths (:mod:`grpo_core.moved`).
"""

from grpo_core import moved
from grpo_core.contract.hookspecs import hookimpl

moved.install()

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]

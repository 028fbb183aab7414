"""grpo: GRPO training with a plugin contract for every extension point.

Plugin authors import from :mod:`grpo_core.plugin_api` (the one public
surface: ``hookimpl``, the types, the Protocols, the context, the errors and
named helpers); the manual is ``docs/plugins.md``. The folders are the
layers, lowest first, each importing only itself and those before it:
``contract``, ``runtime``, ``config``, ``host``, ``modeling``,
``observability``, ``scoring``, ``data``, ``optimization``, ``generation``,
``checkpointing``, ``parallel``, ``sync``, ``validation`` (every rule of a
config, the backends' included), ``training`` (the loop), ``interface``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

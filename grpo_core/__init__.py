"""grpo: GRPO training with a plugin contract for every extension point.

Plugin authors need only :data:`hookimpl` and the types in
:mod:`grpo_core.types`; the contract itself is :mod:`grpo_core.hookspecs`.
"""

from grpo_core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]

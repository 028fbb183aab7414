"""The plugin contract: what a plugin author reads (the manual: ``docs/plugins.md``).

:mod:`~grpo_core.contract.hookspecs` (every hook),
:mod:`~grpo_core.contract.declarations` (one Protocol per extension point:
the class attributes the core reads), :mod:`~grpo_core.contract.types` (the
plain data that crosses the contract), :mod:`~grpo_core.contract.context` (what every
implementation is built with), :mod:`~grpo_core.contract.errors` and
:mod:`~grpo_core.contract.extension_points` (the table of extension points
and the capabilities an implementation declares). Plugins import these names
from :mod:`grpo_core.plugin_api`, the one public surface.
"""

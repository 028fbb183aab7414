"""Old import paths of modules that moved into layer folders, kept working.

grpo_core's modules once sat side by side at its top level; they now live in
folders by layer (``contract``, ``runtime``, ``config``, ``host``,
``modeling``, ``observability``, ``validation``, ``scoring``, ``training``,
``interface``). Third-party
plugins and scripts written against the old paths (``import
grpo_core.hookspecs``, ``from grpo_core.types import Prompt``,
``mock.patch("grpo_core.models.load_policy")``) keep working: the old name is
the *same module object* as the new one, so a patch through either path is
seen by both. New code imports the new paths, or, in a plugin,
:mod:`grpo_core.plugin_api`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    f"grpo_core.{name}": f"grpo_core.{layer}.{name}"
    for layer, names in {
        "contract": ("hookspecs", "types", "context", "errors", "extension_points"),
        "host": ("plugin_host", "user_code", "script_objects"),
        "modeling": ("models", "model_files", "quantization", "fp8", "compile", "precision", "engine_weights"),
        "scoring": ("rewards", "reward_calls", "reward_workers"),
        "optimization": ("loss", "logprobs"),
        "generation": ("evaluation",),
        "training": ("observe",),
        "observability": ("alerts", "tracking", "report"),
        "interface": ("cli", "cli_common", "cli_tools", "tools", "api", "launch"),
        "runtime": ("atomic", "cpu_affinity", "lifelong_thread", "processes", "scratch"),
    }.items()
    for name in names
} | {
    "grpo_core.config.deepspeed_file": "grpo_core.parallel.deepspeed_file",  # the DeepSpeed backend's file
    "grpo_core.training.logging": "grpo_core.observability.logging",  # the metrics log
    "grpo_core.config.checks": "grpo_core.validation.checks",  # above the layers whose rules it asks
}
"""Old dotted name -> where the module lives now."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old name with the module at its new home
    (imported there, under its new name, once)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: :meth:`create_module` returned the module, already executed."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())

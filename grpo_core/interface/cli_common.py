"""What every module of the ``grpo`` command line shares.

The ``--set`` option and the config argument, warnings printed once, and
loading a config with its checks. :mod:`grpo_core.interface.cli` (the app and the core
commands) and :mod:`grpo_core.interface.cli_tools` (commands around a run) both build
on these, so neither imports the other's internals. The heavy modules are
imported inside the functions, so ``grpo --help`` stays fast.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig
    from grpo_core.host.plugin_host import PluginHost

SET_HELP = (
    'Override a config key, e.g. --set trl.num_generations=4 or --set \'trl.reward_funcs=["a", "b"]\'. '
    "VALUE is read as TOML (numbers, true/false, quoted strings, arrays, inline tables), else as a plain string. "
    "Repeatable."
)


def stderr(message: str) -> None:
    typer.echo(message, err=True)


_warned: set[str] = set()


def warn(message: str) -> None:
    """Print a warning once (start-up and the command may both see it)."""
    if message not in _warned:
        _warned.add(message)
        stderr(f"warning: {message}")


def set_option() -> Any:
    return typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help=SET_HELP, show_default=False)


def config_argument() -> Any:
    return typer.Argument(..., help="Config file: .toml, or .yaml/.yml in the reference layout.", show_default=False)


def import_from_cwd() -> None:
    """Reward functions and dataset transforms are named by import path
    relative to the directory grpo runs in (``rewards.accuracy_reward``); a
    console script does not put that directory on ``sys.path`` by itself."""
    from grpo_core.host.user_code import (
        make_cwd_importable,  # start-up: `grpo --help` loads no plugin machinery
    )

    make_cwd_importable()


def host_for(cfg: GRPOConfig) -> PluginHost:
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.host.plugin_host import PluginHost

    return PluginHost(allow=set(cfg.plugins.allow) if cfg.plugins.allow else None)


def load_and_check(
    config: Path, overrides: list[str] | None, num_processes: int | None = None
) -> tuple[GRPOConfig, PluginHost, list[str]]:
    """The config as ``grpo config check`` judges it: loaded, its always-on
    plugins registered, checked; the warnings come back as notes."""
    # imported when the command runs, so `grpo --help` stays fast
    from grpo_core.config.loader import load_config
    from grpo_core.validation.run_check import check_run_config

    import_from_cwd()
    cfg = load_config(config, overrides or [])
    host = host_for(cfg)
    notes = load_always_on(host)
    notes += check_run_config(cfg, host, num_processes)
    return cfg, host, notes


def load_always_on(host: PluginHost) -> list[str]:
    """Register the always-on plugins the allowlist permits; their problems
    come back as notes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host.load_always_on(strict=True)
    return [str(w.message) for w in caught]

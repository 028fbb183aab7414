"""What a config points at, checked before a run: files, modules, names.

A config names a model, datasets, and Python by
import path (reward functions, tools, transforms, ...). Each is checked the
way ``grpo run`` would find it, without running anything: paths must exist,
modules are found with :mod:`grpo_core.host.user_code` (never imported), and
a name a module does not define is found by parsing the module's source. A
name that reading cannot rule out (the module star-imports, or defines
``__getattr__``) is a warning, not an error. :func:`import_problems`
(``grpo config check --import``) imports the modules for a user who trusts
the config, and reports what importing them says.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from pathlib import Path

from grpo_core.config.schema import GRPOConfig
from grpo_core.host.plugin_host import PluginHost, normalise, split_qualified
from grpo_core.host.script_objects import CALLABLE_PREFIX
from grpo_core.host.user_code import (
    DOTTED,
    UserCode,
    attr_of,
    locate,
    make_cwd_importable,
    module_names,
    named_user_code,
)
from grpo_core.modeling.model_files import model_location_problem

DATA_SUFFIXES = {".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt"}


def _looks_local(path: str) -> bool:
    """A dataset path meant as a file or folder here, not a hub id."""
    return path.startswith((".", "/", "~")) or Path(path).suffix in DATA_SUFFIXES


def path_problems(cfg: GRPOConfig) -> list[str]:
    """The model and the datasets must exist where ``grpo run`` will look
    (relative paths from the working directory; a dataset beside the config
    was already anchored there by the loader). The checkpoint to resume is
    :mod:`grpo_core.validation.output_dir`'s to judge."""
    problems: list[str] = []
    model = model_location_problem(cfg.base_model)
    if model is not None:
        problems.append(model)
    for label, specs in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets)):
        for i, spec in enumerate(specs):
            if _looks_local(spec.path) and not Path(spec.path).expanduser().exists():
                problems.append(
                    f"{label}[{i}].path '{spec.path}' does not exist (relative to {Path.cwd()}, or beside the config)."
                )
    return problems


def _other_reward_loaders(host: PluginHost) -> list[str]:
    """Registered ``grpo_load_reward`` implementations not grpo's own: one of
    them may resolve a dotted reward spec that names no module."""
    out = []
    for impl in host.pm.hook.grpo_load_reward.get_hookimpls():
        dist, _ = split_qualified(impl.plugin_name.partition(":")[2])
        if dist is None or normalise(dist) != "grpo":
            out.append(impl.plugin_name)
    return out


def _did_you_mean(spec: str, names: list[str]) -> str:
    module = spec.rpartition(".")[0]
    close = difflib.get_close_matches(attr_of(spec), names, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"'{module}.{name}'" for name in close) + "?"
    public = sorted(n for n in names if not n.startswith("_"))
    if not public:
        return "it defines no public names."
    return "it defines " + ", ".join(public[:12]) + (", ..." if len(public) > 12 else "") + "."


def code_problems(cfg: GRPOConfig, host: PluginHost, registered_rewards: set[str]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for every import path the config names, found
    without running it: a module that is not there, a name the module's
    source does not define (with the module's names closest to it)."""
    errors: list[str] = []
    warnings: list[str] = []
    others = None
    make_cwd_importable()  # where `grpo run` finds a user's rewards.py
    importlib.invalidate_caches()
    for key, spec in named_user_code(cfg, registered_rewards):
        loaded = sys.modules.get(spec.rpartition(".")[0])
        if loaded is not None:  # imported already (grpo's own, or an object a script handed to grpo.train)
            if not hasattr(loaded, attr_of(spec)):
                names = [n for n in dir(loaded) if not n.startswith("__")]
                errors.append(
                    f"{key} = '{spec}': module '{loaded.__name__}' has no '{attr_of(spec)}': "
                    + _did_you_mean(spec, names)
                )
            continue
        item = locate(key, spec)
        if item.file is None:
            message = f"{key} = '{spec}': {item.problem} (looked in {Path.cwd()} and the config's folder)."
            if key.startswith("trl.reward_funcs"):
                others = _other_reward_loaders(host) if others is None else others
                if others:
                    warnings.append(f"{message} Unless a reward loader plugin ({', '.join(others)}) claims it.")
                    continue
            errors.append(message)
            continue
        names = module_names(item.file)
        if names is None or item.line is not None:
            continue  # found, or compiled/unreadable (nothing to read)
        if names.conclusive:
            errors.append(
                f"{key} = '{spec}': {item.file} defines no top-level '{attr_of(spec)}' (found by reading it): "
                + _did_you_mean(spec, list(names.lines))
            )
        else:
            warnings.append(
                f"{key} = '{spec}': no top-level '{attr_of(spec)}' found by reading {item.file}, which may define "
                "names when imported (a star import or a module __getattr__): `grpo config check --import` imports "
                "it to be sure."
            )
    return errors, warnings


def _is_reward_reference(spec: str, registered: set[str]) -> bool:
    """What the reward loaders take besides an import path: a registered
    name, a URL, a reward-model folder or hub id, a script's callable."""
    return (
        split_qualified(spec)[1] in registered
        or "://" in spec
        or spec.startswith(CALLABLE_PREFIX)
        or Path(spec).expanduser().is_dir()
        or (spec.count("/") == 1 and not spec.startswith((".", "/", "~")))
    )


def reward_name_problems(cfg: GRPOConfig, host: PluginHost, registered: set[str]) -> tuple[list[str], list[str]]:
    """A reward entry that is neither an import path nor anything a reward
    loader takes (a misspelt registered name): an error with the closest
    registered names, a warning when a third-party loader may claim it."""
    errors: list[str] = []
    warnings: list[str] = []
    for i, spec in enumerate(cfg.trl.reward_funcs or []):
        if DOTTED.fullmatch(spec) or _is_reward_reference(spec, registered):
            continue
        close = difflib.get_close_matches(split_qualified(spec)[1], sorted(registered), n=2, cutoff=0.6)
        message = (
            f"trl.reward_funcs[{i}] = '{spec}': no installed package registers a reward function of that name"
            + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else "")
            + "; an entry is a registered name (`grpo plugins`), an import path 'module.function', a reward-model "
            "folder or a hub id (org/name)."
        )
        others = _other_reward_loaders(host)
        if others:
            warnings.append(f"{message} Unless a reward loader plugin ({', '.join(others)}) claims it.")
        else:
            errors.append(message)
    return errors, warnings


def import_problems(items: list[UserCode]) -> list[str]:
    """``--import``: import each module the config names and look its name
    up, for a user who trusts the config; what fails, with the exception."""
    make_cwd_importable()
    importlib.invalidate_caches()
    problems: list[str] = []
    for item in items:
        module_name, _, attr = item.spec.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # user code at import time may raise anything, exit included
            problems.append(
                f"{item.key} = '{item.spec}': importing '{module_name}' failed: {type(exc).__name__}: {exc}"
            )
            continue
        if not hasattr(module, attr):
            names = [n for n in dir(module) if not n.startswith("__")]
            problems.append(
                f"{item.key} = '{item.spec}': module '{module_name}' ({getattr(module, '__file__', None)}) has no "
                f"'{attr}' after importing it: " + _did_you_mean(item.spec, names)
            )
    return problems

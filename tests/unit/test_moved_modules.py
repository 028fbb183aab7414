"""Old import paths of grpo_core's modules keep working after the move into
layer folders: third-party plugins and scripts import them
(``grpo_core.hookspecs``, ``grpo_core.types``, ``grpo_core.errors``...)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import grpo_core
from grpo_core.moved import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_is_the_moved_module_itself(old: str) -> None:
    new = MOVED_MODULES[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert not Path(grpo_core.__path__[0], *old.split(".")[1:]).with_suffix(".py").exists(), (
        "no file left at the old path"
    )


def test_the_names_plugins_imported_from_old_paths_still_import() -> None:
    from grpo_core import hookimpl
    from grpo_core.context import RunContext
    from grpo_core.contract.context import RunContext as new_context
    from grpo_core.contract.errors import ConfigError as new_error
    from grpo_core.contract.types import Prompt as new_prompt
    from grpo_core.errors import ConfigError
    from grpo_core.hookspecs import hookimpl as spec_hookimpl
    from grpo_core.runtime.scratch import make_scratch_dir as new_scratch
    from grpo_core.scratch import make_scratch_dir
    from grpo_core.types import Prompt

    assert hookimpl is spec_hookimpl
    assert (RunContext, ConfigError, Prompt, make_scratch_dir) == (new_context, new_error, new_prompt, new_scratch)


def test_a_patch_through_the_old_path_is_seen_at_the_new_one() -> None:
    from grpo_core.modeling import model_files

    with mock.patch("grpo_core.model_files.atomic_directory", "patched"):
        assert model_files.atomic_directory == "patched"
    assert model_files.atomic_directory != "patched"


def test_a_fresh_interpreter_imports_an_old_path_first() -> None:
    """The finder is installed by ``import grpo_core``, which importing any
    submodule runs first: an old path works as a process's very first import."""
    code = "import grpo_core.hookspecs as h, grpo_core.cli as c; print(h.__name__, c.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["grpo_core.contract.hookspecs", "grpo_core.interface.cli"]


def test_an_unknown_name_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("grpo_core.no_such_module")

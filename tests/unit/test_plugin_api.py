"""grpo_core.plugin_api: the one public surface plugins import grpo_core through.

Its names resolve to the objects their home modules define (so isinstance
checks and constants agree), the built-in plugins, the examples and the test
plugin packages import grpo_core through it alone, its names are listed once
(the type-checking imports, read at run time), ``hookimpl`` has no other
public path, and importing it pulls in no heavy library.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

import grpo_core
from grpo_core import plugin_api
from grpo_core.contract import hookspecs

PLUGIN_SOURCES = [REPO / "plugins", REPO / "examples", REPO / "tests" / "plugin_packages"]


def _grpo_core_imports(root: Path, base: Path = REPO) -> list[str]:
    """Every ``grpo_core`` import under ``root`` that is not the plugin API, as file:line module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "grpo_core":
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names if alias.name.split(".")[0] == "grpo_core"]
            else:
                continue
            found += [f"{path.relative_to(base)}:{node.lineno} {m}" for m in modules if m != "grpo_core.plugin_api"]
    return found


@pytest.mark.parametrize("root", PLUGIN_SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_plugins_import_grpo_core_only_through_the_plugin_api(root: Path) -> None:
    assert _grpo_core_imports(root) == []


def test_the_scan_sees_each_kind_of_import(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text(
        "import grpo_core.contract.types\nfrom grpo_core import hookimpl\nfrom grpo_core.plugin_api import Prompt\n"
        "def f():\n    from grpo_core.contract.errors import ConfigError\n"
    )
    found = [line.split(" ", 1)[1] for line in _grpo_core_imports(tmp_path, base=tmp_path)]
    assert sorted(found) == ["grpo_core", "grpo_core.contract.errors", "grpo_core.contract.types"]


@pytest.mark.parametrize("name", plugin_api.__all__)
def test_every_name_is_its_home_modules_object(name: str) -> None:
    home = next(module for module, names in plugin_api.HOMES.items() if name in names)
    assert getattr(plugin_api, name) is getattr(importlib.import_module(home), name)


def test_hookimpl_has_one_public_path() -> None:
    """The marker is defined beside the specs and published by the plugin API
    alone: neither ``grpo_core`` nor the ``grpo`` alias re-exports it."""
    import grpo

    assert plugin_api.hookimpl is hookspecs.hookimpl
    assert not hasattr(grpo_core, "hookimpl") and not hasattr(grpo, "hookimpl")


def test_a_name_outside_the_surface_says_so() -> None:
    with pytest.raises(AttributeError, match="has no 'Producer': it is not part of the plugin surface"):
        plugin_api.Producer  # noqa: B018
    with pytest.raises(ImportError):
        exec("from grpo_core.plugin_api import load_policy", {})


def test_the_names_are_listed_once_and_re_exported_for_type_checkers() -> None:
    """The ``TYPE_CHECKING`` imports are the list: each ``from m import x as x``
    (the PEP 484 re-export a strict type checker needs), no name twice, and
    the run-time table is exactly them."""
    tree = ast.parse(Path(plugin_api.__file__).read_text(encoding="utf-8"))
    block = next(
        node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    aliases = [alias for stmt in block.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names]
    assert [a.name for a in aliases if a.asname != a.name] == []
    assert len({a.name for a in aliases}) == len(aliases) == len(plugin_api.__all__)
    typed = {
        (stmt.module, alias.name) for stmt in block.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names
    }
    assert typed == {(module, name) for module, names in plugin_api.HOMES.items() for name in names}
    assert "HOMES" not in Path(plugin_api.__file__).read_text(encoding="utf-8").split("if TYPE_CHECKING:")[-1]


def test_importing_the_surface_imports_no_heavy_library() -> None:
    """Names load on first use: a plugin listing (``grpo plugins``) that
    imports a plugin module does not pay for torch through the surface."""
    code = (
        "import sys, grpo_core.plugin_api; print(sorted({'torch', 'transformers', 'datasets', 'peft'} & "
        "set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"

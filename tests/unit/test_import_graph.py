"""The import graph of grpo_core and grpo_plugins: no circles, layers read one way.

The graph is read from the source (:mod:`import_graph`, nothing is imported),
so the test takes well under a second. What it holds the code to:

* no circle among the imports that run (module level, and with the imports
  inside functions counted: a lazy import must not hide one), nor among the
  ``TYPE_CHECKING``-only ones;
* grpo_core never imports the built-in plugins, vLLM, DeepSpeed or Liger (at
  any level: it reaches built-ins through entry points, and accelerate
  imports DeepSpeed for it);
* a plugin imports grpo_core, libraries and its own package, never a sibling
  plugin (what two plugins share is a typed part of the contract);
* grpo_core's layers are its folders (:data:`LAYERS`, lowest first: the
  contract, runtime utilities, the config, the plugin host, models,
  observability, scoring, data, the policy update, generation, checkpoints,
  the training backends, weight syncs, the config's validation, the loop,
  the command line): a
  module imports only its own layer and lower ones, and the error and data
  types import nothing of grpo_core. Imports that still run from a lower layer up are listed in
  :data:`UPWARD`, each with why; the list must match the code exactly, so a
  new one fails and a removed one asks for its entry to go.

``python tests/import_graph.py`` prints the circles and what ties them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from import_graph import (
    REPO,
    Edge,
    all_edges,
    cycles,
    edges_between,
    graph,
    own,
    source_files,
    unexplained_lazy_imports,
)

ENGINES = {"grpo_plugins", "plugins", "vllm", "deepspeed", "liger_kernel"}

FOUNDATION = {"grpo_core.contract.errors", "grpo_core.contract.types"}

# grpo_core's folders are its layers, lowest first: a module imports (at
# module level or inside a function) only modules of its own layer or lower
# ones. The config (schema, loading, the facts every layer reads) sits low;
# the run's parts follow in the order a step uses them (scoring, data, the
# policy update, generation, checkpoints, the training backends, weight
# syncs); validation sits above every layer whose rules it asks (the
# backends' included), and the loop and the command line on top.
LAYERS = [
    "contract",
    "runtime",
    "config",
    "host",
    "modeling",
    "observability",
    "scoring",
    "data",
    "optimization",
    "generation",
    "checkpointing",
    "parallel",
    "sync",
    "validation",
    "training",
    "interface",
]
OWN_RANK = {
    "grpo_core": "contract",  # the package: its version, nothing else
}
PLUGIN_SURFACE = (
    "grpo_core.plugin_api"  # above every layer: it re-exports them for plugins, nothing in grpo_core imports it
)

# Imports that run from a lower layer to a higher one, each with why it is
# still there (none today).
UPWARD: dict[tuple[str, str], str] = {}


def rank(module: str) -> int:
    """A grpo_core module's layer, as an index into :data:`LAYERS`."""
    if module == PLUGIN_SURFACE:
        return len(LAYERS)
    if module in OWN_RANK:
        return LAYERS.index(OWN_RANK[module])
    return LAYERS.index(module.split(".")[1])


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return all_edges()


@pytest.fixture(scope="module")
def known() -> set[str]:
    return set(source_files())


def _own_edges(edges: list[Edge], known: set[str], levels: set[str]) -> set[tuple[str, str]]:
    return {
        (e.source, t) for e in edges if e.level in levels and (t := own(e.target, known)) is not None and t != e.source
    }


def _layer_breaks(edges: list[Edge], known: set[str]) -> set[tuple[str, str]]:
    """Imports that run (module or function level) and break a layer rule."""
    breaks = set()
    for source, target in _own_edges(edges, known, {"module", "function"}):
        if source in FOUNDATION and target.startswith("grpo_core"):
            breaks.add((source, target))
        elif source.startswith("grpo_core") and target.startswith("grpo_core") and rank(target) > rank(source):
            breaks.add((source, target))
        elif target == "grpo" or target.startswith("grpo."):  # the `import grpo` alias is for users only
            breaks.add((source, target))
    return breaks


def _sibling_imports(edges: list[Edge], known: set[str]) -> list[str]:
    """Plugin imports of another plugin (any level)."""
    found = []
    for edge in edges:
        target = own(edge.target, known)
        if not edge.source.startswith("grpo_plugins.") or target is None or not target.startswith("grpo_plugins"):
            continue
        if _plugin_package(edge.source) != _plugin_package(target):
            found.append(f"{edge.source}:{edge.line} imports {edge.target}")
    return found


def _plugin_package(module: str) -> str:
    """The plugin a module belongs to: ``grpo_plugins.vllm`` for ``grpo_plugins.vllm.pool``,
    the module itself for a one-file plugin (``grpo_plugins.advantages``)."""
    return ".".join(module.split(".")[:2])


def _ties(found: list[list[str]], edges: list[Edge], known: set[str], levels: set[str]) -> str:
    """What ties each circle, for the failure message."""
    return "\n".join(
        f"{e.source}:{e.line} -> {e.target} ({e.level})"
        for members in found
        for e in edges_between(edges, set(members), known)
        if e.level in levels
    )


# ---------------------------------------------------------------------------- the repository


def test_no_circle_among_module_level_imports(edges: list[Edge], known: set[str]) -> None:
    found = cycles(graph(edges, known, {"module"}))
    assert found == [], _ties(found, edges, known, {"module"})


def test_no_lazy_import_hides_a_circle(edges: list[Edge], known: set[str]) -> None:
    """With the imports inside functions counted, still no circle: a lazy
    import is for a heavy library or start-up time, never to dodge one."""
    found = cycles(graph(edges, known, {"module", "function"}))
    assert found == [], _ties(found, edges, known, {"module", "function"})


def test_no_circle_even_among_type_checking_imports(edges: list[Edge], known: set[str]) -> None:
    """Not even a circle that never runs: a type two layers share lives in the lower one."""
    found = cycles(graph(edges, known, {"module", "function", "type_checking"}))
    assert found == [], _ties(found, edges, known, {"module", "function", "type_checking"})


def test_every_import_inside_a_function_says_why() -> None:
    """A lazy import is for a heavy or optional library, or for start-up
    time, and its comment says which; a light module is imported at the top."""
    found = [
        f"{module}:{line}"
        for module, path in source_files().items()
        if module.split(".")[0] in ("grpo_core", "grpo_plugins")
        for line in unexplained_lazy_imports(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_core_never_imports_plugins_or_engines(edges: list[Edge]) -> None:
    offenders = [
        f"{e.source}:{e.line} imports {e.target} ({e.level})"
        for e in edges
        if e.source.startswith("grpo_core") and e.target.split(".")[0] in ENGINES
    ]
    assert offenders == []


def test_plugins_import_only_the_core_libraries_and_their_own_package(edges: list[Edge], known: set[str]) -> None:
    assert _sibling_imports(edges, known) == []
    assert [e for e in edges if e.source.startswith("grpo_plugins") and e.target.split(".")[0] == "plugins"] == []


def test_layers_read_one_way_except_the_listed_imports(edges: list[Edge], known: set[str]) -> None:
    breaks = _layer_breaks(edges, known)
    assert sorted(breaks - UPWARD.keys()) == [], "a new import runs from a lower layer up"
    assert sorted(UPWARD.keys() - breaks) == [], "no longer imported: remove it from UPWARD"


def test_errors_and_types_import_nothing_of_grpo_core_even_for_type_checking(
    edges: list[Edge], known: set[str]
) -> None:
    assert {
        (s, t) for s, t in _own_edges(edges, known, {"module", "function", "type_checking"}) if s in FOUNDATION
    } == set()


def test_the_graph_covers_every_package(known: set[str]) -> None:
    for package in (
        "grpo_core",
        "grpo_core.config",
        "grpo_core.training",
        "grpo_plugins",
        "grpo_plugins.vllm",
        "grpo_plugins.environments",
        "grpo_plugins.rewards",
        "grpo",
    ):
        assert package in known
    assert len(known) >= 90
    assert (
        set(OWN_RANK) | {PLUGIN_SURFACE} | {f"grpo_core.{layer}" for layer in LAYERS} <= known
    )  # a renamed module must be renamed here too


def test_every_grpo_core_module_sits_in_a_layer_folder(known: set[str]) -> None:
    """No module loose at grpo_core's top level but the package and the plugin
    surface: a new module goes into its layer."""
    loose = {m for m in known if m.startswith("grpo_core.") and m.count(".") == 1 and m.split(".")[1] not in LAYERS}
    assert loose == {PLUGIN_SURFACE}
    assert all(rank(m) >= 0 for m in known if m.startswith("grpo_core"))


# ---------------------------------------------------------------------------- the scan itself


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, code in {"grpo_core/__init__.py": "", "plugins/__init__.py": "", "grpo/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code), encoding="utf-8")
    return root


def test_the_scan_tells_module_function_and_type_checking_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "grpo_core/a.py": """
            from typing import TYPE_CHECKING
            from grpo_core import b
            from .c import thing
            import importlib
            if TYPE_CHECKING:
                from grpo_core.d import D
            def later():
                from grpo_core.e import E
                importlib.import_module("vllm")
            class Holder:
                from grpo_core import f
        """,
            "grpo_core/b.py": "",
            "grpo_core/c.py": "",
            "grpo_core/d.py": "",
            "grpo_core/e.py": "",
            "grpo_core/f.py": "",
        },
    )
    found = {
        (own(e.target, set(source_files(root))) or e.target, e.level)
        for e in all_edges(root)
        if e.source == "grpo_core.a"
    }
    assert found == {
        ("typing", "module"),
        ("grpo_core.b", "module"),
        ("grpo_core.c", "module"),
        ("importlib", "module"),
        ("grpo_core.d", "type_checking"),
        ("grpo_core.e", "function"),
        ("vllm", "function"),
        ("grpo_core.f", "module"),
    }


def test_the_lazy_import_rule_reads_blocks_and_comments() -> None:
    code = textwrap.dedent("""
        import os

        def explained():
            # heavy: why
            import torch
            from transformers import AutoModel

        def trailing():
            import numpy as np  # heavy: why

        def bare():
            x = 1
            import json
            from pathlib import Path

        def nested(flag):
            if flag:
                import pickle
    """)
    assert unexplained_lazy_imports(code) == [14, 19]


def test_a_circle_is_found_and_a_lazy_one_too(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "grpo_core/a.py": "from grpo_core.b import x\n",
            "grpo_core/b.py": "import grpo_core.c\nx = 1\n",
            "grpo_core/c.py": "def f():\n    from grpo_core import a\n",
            "grpo_core/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_core import a\n",
            "grpo_core/e.py": "import grpo_core.d\n",
        },
    )
    edges, known = all_edges(root), set(source_files(root))
    assert cycles(graph(edges, known, {"module"})) == []
    assert cycles(graph(edges, known, {"module", "function"})) == [["grpo_core.a", "grpo_core.b", "grpo_core.c"]]
    (root / "grpo_core/c.py").write_text("from grpo_core import a\n", encoding="utf-8")
    assert cycles(graph(all_edges(root), known, {"module"})) == [["grpo_core.a", "grpo_core.b", "grpo_core.c"]]


def test_a_sibling_plugin_import_and_an_upward_import_are_caught(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "plugins/vllm/__init__.py": "",
            "plugins/vllm/pool.py": "from grpo_plugins.vllm.server import x\n",
            "plugins/vllm/server.py": "x = 1\n",
            "plugins/replay.py": "",
            "plugins/advantages.py": "def f():\n    from grpo_plugins.vllm import pool\n",
            "grpo_core/contract/errors.py": "from grpo_core.contract.types import Prompt\n",
            "grpo_core/contract/types.py": "",
            "grpo_core/interface/cli.py": "",
            "grpo_core/modeling/models.py": "def f():\n    import grpo_core.interface.cli\n",
        },
    )
    edges, known = all_edges(root), set(source_files(root))
    assert _sibling_imports(edges, known) == ["grpo_plugins.advantages:2 imports grpo_plugins.vllm.pool"]
    assert _layer_breaks(edges, known) == {
        ("grpo_core.contract.errors", "grpo_core.contract.types"),
        ("grpo_core.modeling.models", "grpo_core.interface.cli"),
    }


def test_no_module_imports_another_modules_private_names() -> None:
    """A leading underscore means "this module's own": another module that
    needs it asks for a public name instead (the trainer once reached into
    the log-prob path's helpers this way)."""
    import ast

    offenders = []
    for name, path in source_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {
                "grpo_core",
                "grpo_plugins",
                "grpo",
            }:
                offenders += [
                    f"{name}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert offenders == []


def test_no_core_rule_compares_against_a_built_in_implementations_name() -> None:
    """A rule in grpo_core about what an implementation does reads the
    capability it declares, never its name: a third-party rollout or sync
    that does the same gets the same rules. The names are the built-ins'
    entry points (those that are not also a config table or a generic word)."""
    import ast
    import tomllib

    groups = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    names = {
        name
        for group in ("grpo.rollout", "grpo.weight_sync", "grpo.policy_loss", "grpo.environment")
        for name in groups[group]
    } - {"vllm", "function", "grpo", "none"}
    assert {"transformers", "vllm_colocate", "vllm_in_memory", "nccl", "liger", "tools"} <= names
    offenders = [
        f"{module}:{node.lineno} compares against '{const.value}'"
        for module, path in source_files().items()
        if module.startswith("grpo_core")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Compare)
        for const in ast.walk(node)
        if isinstance(const, ast.Constant) and const.value in names
    ]
    assert offenders == []


def test_every_package_is_a_layer_and_listed_for_installation() -> None:
    """A new folder under grpo_core/ is a layer (in :data:`LAYERS`) and a
    package pyproject.toml installs; a folder missing from either would import
    from a checkout and fail from a wheel, or sit outside the rules above."""
    import tomllib

    folders = {p.name for p in (REPO / "grpo_core").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"layers without a folder or folders without a layer: {folders ^ set(LAYERS)}"
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    plugin_folders = {p.name for p in (REPO / "plugins").iterdir() if (p / "__init__.py").exists()}
    wanted = {"grpo", "grpo_core", "grpo_plugins"} | {f"grpo_core.{f}" for f in folders}
    wanted |= {f"grpo_plugins.{f}" for f in plugin_folders}
    assert listed == wanted, f"pyproject.toml's packages differ from the folders: {sorted(listed ^ wanted)}"

"""The user code a config will import, found without running it.

A config names Python by import path (``trl.reward_funcs``,
``trl.rollout_func``, ``trl.environment_factory``, ``trl.tools``, dataset
``type`` transforms), so a config written by someone else can make
``grpo run`` execute code from any module on ``sys.path`` or in the working
directory. ``grpo config check`` lists each of them with the file it
resolves to, so the code can be read first.

Resolving runs nothing: a top-level module is found with
:func:`importlib.util.find_spec` (which imports nothing for a top-level
name), and a submodule is looked up inside its parent package's folders by
the same finders the import system uses, without importing the parent
(``importlib.util.find_spec("a.b")`` would run ``a/__init__.py``). Where
``grpo run`` will run a parent package's ``__init__.py`` before the module,
the listing names that file too. A package that changes its ``__path__``
when imported can make ``grpo run`` load a file other than the one listed;
such a module is reported as not found rather than imported.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.host.plugin_host import split_qualified

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # 'module.function' (the reward loader's rule)


def make_cwd_importable() -> None:
    """Put the working directory first on ``sys.path`` (where a user's
    ``rewards.py`` lives); a console script does not do it by itself."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


@dataclass(frozen=True)
class UserCode:
    """One import path a config names, and where it resolves."""

    key: str  # the config key, e.g. "trl.reward_funcs[0]"
    spec: str  # "module.attr" as written
    file: str | None = None  # the module's file; None when not found
    line: int | None = None  # where ``attr`` is defined at the module's top level, if found by reading it
    runs_first: tuple[str, ...] = ()  # parent packages' __init__.py files an import runs before the module
    problem: str | None = None  # why it was not found

    def describe(self) -> str:
        if self.file is None:
            return f"{self.key}: {self.spec} -> NOT FOUND ({self.problem})"
        if self.line:
            where = f"{self.file}:{self.line}"
        elif self.file.endswith(".py"):
            where = f"{self.file} (no top-level '{attr_of(self.spec)}' found by reading it)"
        else:
            where = self.file  # compiled or built in: nothing to read
        first = f"; importing it runs {', '.join(self.runs_first)} first" if self.runs_first else ""
        return f"{self.key}: {self.spec} -> {where}{first}"


def attr_of(spec: str) -> str:
    return spec.rpartition(".")[2]


def named_user_code(cfg: GRPOConfig, registered_rewards: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(config key, 'module.attr') for every import path ``cfg`` names.

    A reward that is a registered name (``registered_rewards``, as
    ``name`` or ``distribution:name``), a directory, a URL or a hub id is
    not user code by import path, so it is left out."""
    names = set(registered_rewards)
    trl = cfg.trl
    found: list[tuple[str, str]] = []
    for i, spec in enumerate(trl.reward_funcs or []):
        if "://" in spec or split_qualified(spec)[1] in names or Path(spec).expanduser().is_dir():
            continue
        if DOTTED.fullmatch(spec):
            found.append((f"trl.reward_funcs[{i}]", spec))
    if trl.rollout_func:
        found.append(("trl.rollout_func", trl.rollout_func))
    if isinstance(trl.environment_factory, dict):
        found += [(f"trl.environment_factory.{name}", spec) for name, spec in trl.environment_factory.items()]
    elif trl.environment_factory:
        found.append(("trl.environment_factory", trl.environment_factory))
    found += [(f"trl.tools[{i}]", spec) for i, spec in enumerate(trl.tools or [])]
    for label, specs in (("datasets", cfg.datasets), ("test_datasets", cfg.test_datasets)):
        found += [(f"{label}[{i}].type", d.type) for i, d in enumerate(specs) if d.type]
    return found


def _find_submodule(fullname: str, locations: list[str]) -> importlib.machinery.ModuleSpec | None:
    """What the import system would find for ``fullname`` inside a package
    whose ``__path__`` is ``locations``, asked of the same finders, without
    importing the package."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, locations, None)
        except Exception:  # a third-party finder that cannot answer for this name
            continue
        if spec is not None:
            return spec
    return None


def _module_spec(module: str) -> tuple[importlib.machinery.ModuleSpec | None, list[str], str | None]:
    """(spec, parent __init__ files run first, problem) for ``module``, importing nothing."""
    loaded = sys.modules.get(module)
    if loaded is not None and getattr(loaded, "__spec__", None) is not None:
        return loaded.__spec__, [], None  # already imported in this process (grpo's own modules, say)
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not run
    except (ImportError, ValueError) as exc:
        return None, [], f"{type(exc).__name__}: {exc}"
    if spec is None:
        return None, [], f"no module '{parts[0]}' on sys.path or in the working directory"
    runs_first: list[str] = []
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        locations = spec.submodule_search_locations
        if locations is None:
            return None, [], f"'{parent}' is a module, not a package, so it has no '{parts[depth]}'"
        if spec.origin and spec.has_location:
            runs_first.append(spec.origin)  # a regular package: importing the child runs its __init__.py
        name = ".".join(parts[: depth + 1])
        spec = _find_submodule(name, list(locations))
        if spec is None:
            return (
                None,
                [],
                (
                    f"no module '{name}' in the folders of package '{parent}' (found without importing it; a package "
                    "that extends its __path__ when imported is not followed)"
                ),
            )
    return spec, runs_first, None


@dataclass(frozen=True)
class ModuleNames:
    """The names a source file defines at its top level, found by parsing it."""

    lines: dict[str, int]  # name -> the first line defining it
    conclusive: bool  # False when importing it may define names reading cannot see (see :func:`module_names`)


_BLOCKS = (ast.If, ast.Try, ast.With, ast.For, ast.While, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.For, ast.With)):
        targets = (
            [node.target] if isinstance(node, ast.For) else [i.optional_vars for i in node.items if i.optional_vars]
        )
    names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names += [a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"]
    return names


def module_names(path: str) -> ModuleNames | None:
    """What the source file ``path`` defines at its top level (inside
    top-level ``if``/``try``/``with``/``for`` blocks too, never inside a
    function or class), or None when it cannot be read. Not conclusive when
    the module can make names at import time that reading does not see: a
    ``from x import *``, a module-level ``__getattr__``, or a call to
    ``globals()``/``setattr``."""
    if not path.endswith(".py"):
        return None
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    lines: dict[str, int] = {}
    conclusive = True
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        for name in _defined(node):
            lines.setdefault(name, node.lineno)
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            conclusive = False
        if isinstance(node, _BLOCKS):
            for field in ("body", "orelse", "finalbody"):
                pending.extend(getattr(node, field, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                pending.extend(handler.body)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                if isinstance(call.func, ast.Name) and call.func.id in {"globals", "setattr", "exec", "vars"}:
                    conclusive = False
    if "__getattr__" in lines:
        conclusive = False
    return ModuleNames(lines, conclusive)


def _top_level_line(path: str, attr: str) -> int | None:
    """The line defining ``attr`` at the top level of the source file ``path``, found by parsing it (never
    running it)."""
    found = module_names(path)
    return found.lines.get(attr) if found is not None else None


def locate(key: str, spec: str) -> UserCode:
    """Where ``spec`` ('module.attr') resolves, without running any of it."""
    module, _, attr = spec.rpartition(".")
    if not module or not attr:
        return UserCode(key, spec, problem="not a 'module.function' path")
    found, runs_first, problem = _module_spec(module)
    if found is None:
        return UserCode(key, spec, problem=problem)
    if not found.has_location and found.submodule_search_locations is None:  # built into Python, or frozen
        return UserCode(key, spec, file=f"<{found.origin or 'no file'}: part of Python, no source file>")
    origin = found.origin if found.has_location else None
    if origin is None:  # a namespace package: no file of its own holds the name
        locations = ", ".join(found.submodule_search_locations or [])
        return UserCode(
            key,
            spec,
            problem=f"'{module}' is a namespace package (folders: {locations}) with no file to define '{attr}'",
        )
    return UserCode(key, spec, file=origin, line=_top_level_line(origin, attr), runs_first=tuple(runs_first))


def user_code(cfg: GRPOConfig, registered_rewards: Iterable[str] = ()) -> list[UserCode]:
    """Every import path in ``cfg``, resolved (the working directory importable, as ``grpo run`` has it)."""
    make_cwd_importable()
    importlib.invalidate_caches()
    return [locate(key, spec) for key, spec in named_user_code(cfg, registered_rewards)]


def user_code_text(items: list[UserCode]) -> str:
    """The ``grpo config check`` section: what `grpo run` will import and run."""
    if not items:
        return "user code:    none (no config key names a Python module)"
    lines = [
        f"user code:    {len(items)} import path(s) that `grpo run` will import and run (read them first; "
        "found without running anything):"
    ]
    lines += [f"  {item.describe()}" for item in items]
    return "\n".join(lines)

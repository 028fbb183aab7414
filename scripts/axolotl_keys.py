"""Refresh ``tests/data/axolotl/keys.json``: every key of Axolotl's config schema.

Reads the schema's source (``src/axolotl/utils/schemas/*.py``) from a git
checkout of Axolotl with :mod:`ast` (Axolotl is not imported or installed)
and writes the top-level keys of ``AxolotlInputConfig`` (its own fields and
every mixin's) and the keys of its ``trl:`` and ``vllm:`` tables, with the
commit they came from. ``tests/unit/test_axolotl_compat.py`` walks the list, so a
key Axolotl adds shows up as a failing test after a refresh instead of as a
"remove it" for the first user who writes it.

    python scripts/axolotl_keys.py /path/to/axolotl.git [COMMIT]
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

SCHEMA_DIR = "src/axolotl/utils/schemas"
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "axolotl" / "keys.json"


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True, text=True).stdout


def _classes(repo: str, commit: str) -> dict[str, ast.ClassDef]:
    out: dict[str, ast.ClassDef] = {}
    for path in _git(repo, "ls-tree", "-r", "--name-only", commit, SCHEMA_DIR).split():
        if path.endswith(".py"):
            tree = ast.parse(_git(repo, "show", f"{commit}:{path}"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name, node)
    return out


def _alias(stmt: ast.AnnAssign) -> str | None:
    """The YAML name of a field declared ``Field(alias="model_type")``."""
    if isinstance(stmt.value, ast.Call):
        for kw in stmt.value.keywords:
            if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                return str(kw.value.value)
    return None


def _fields(name: str, classes: dict[str, ast.ClassDef]) -> list[str]:
    """Annotated fields of ``name`` and of every base defined in the schema."""
    node = classes[name]
    keys: list[str] = []
    for base in node.bases:
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name in classes:
            keys += _fields(base_name, classes)
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
            if "ClassVar" not in ast.unparse(stmt.annotation):
                keys.append(_alias(stmt) or stmt.target.id)
    return list(dict.fromkeys(keys))


def main(repo: str, commit: str = "HEAD") -> None:
    commit = _git(repo, "rev-parse", commit).strip()
    classes = _classes(repo, commit)
    data = {
        "source": "https://github.com/axolotl-ai-cloud/axolotl",
        "commit": commit,
        "schema": (
            f"{SCHEMA_DIR}/config.py AxolotlInputConfig (with its mixins), TRLConfig, VllmConfig, SFTDataset (a "
            "datasets: entry)"
        ),
        "top_level": sorted(_fields("AxolotlInputConfig", classes)),
        "trl": sorted(_fields("TRLConfig", classes)),
        "vllm": sorted(_fields("VllmConfig", classes)),
        "datasets": sorted(_fields("SFTDataset", classes)),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(
        f"{OUT}: {len(data['top_level'])} top-level, {len(data['trl'])} trl, {len(data['vllm'])} vllm, "
        f"{len(data['datasets'])} datasets keys at {commit}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])

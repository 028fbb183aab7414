"""The typed contract: one Protocol per extension point
(grpo_core/contract/declarations.py) lists the class attributes the core
reads from an implementation, with their types and defaults.

The extension-point table takes its attributes from the Protocols, every
attribute the core reads is in one, the built-ins declare what their
Protocol allows, the runtime check refuses what a type checker would, and a
plugin package that subclasses the Protocols is type-checked by mypy: its
own declarations pass, and the same package with wrong ones fails.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from helpers import REPO
from pydantic import BaseModel

from grpo_core.contract import declarations as d
from grpo_core.contract.extension_points import EXTENSION_POINTS, GROUP_PREFIX
from grpo_core.host.plugin_host import PluginHost, contract_problem

PACKAGE = REPO / "tests" / "plugin_packages" / "grpo-contract-test"
READ_ATTRIBUTES = {
    "Settings",
    "engine_capabilities",
    "concurrent_generate",
    "runs_rollout_func",
    "generates_on_every_rank",
    "episodic",
    "provides_reward",
    "turn_rewards",
    "names",
    "required_capabilities",
    "sends",
    "needs_turn_rewards",
    "uses_hidden_states",
    "per_token_advantages",
}
"""What the core reads from an implementation besides its hooks (and the
state_dict / load_state_dict pair, checked by the host: test_plugins.py)."""


def test_each_point_takes_its_attributes_from_its_protocol() -> None:
    assert {p.name for p in EXTENSION_POINTS} == {
        "rollout",
        "environment",
        "weight_sync",
        "advantage_aggregation",
        "is_correction",
        "policy_loss",
        "replay",
    }
    for point in EXTENSION_POINTS:
        assert d.Implementation in point.declares.__mro__ and point.declares._is_protocol  # type: ignore[attr-defined]
        assert point.attributes == {
            name: getattr(point.declares, name) for name in typing.get_type_hints(point.declares)
        }
    assert set().union(*(p.attributes for p in EXTENSION_POINTS)) == READ_ATTRIBUTES
    assert EXTENSION_POINTS[2].attributes == {
        "Settings": None,
        "required_capabilities": frozenset(),
        "sends": "merged_weights",
    }


def test_each_point_has_its_default_rule_in_the_config_layer() -> None:
    """The rules read [trl] keys, so they live with the config; the contract names no config type."""
    from grpo_core.config.implementations import DEFAULT_RULES

    assert list(DEFAULT_RULES) == [p.name for p in EXTENSION_POINTS]
    assert "GRPOConfig" not in Path(d.__file__).read_text(encoding="utf-8")
    assert "GRPOConfig" not in (REPO / "grpo_core" / "contract" / "extension_points.py").read_text(encoding="utf-8")


def test_every_attribute_the_core_reads_is_in_a_protocol() -> None:
    """Scans grpo_core for ``declared(obj, point, "name")``: a new attribute
    read without its Protocol entry fails here."""
    read = set()
    for path in (REPO / "grpo_core").rglob("*.py"):
        read |= set(re.findall(r'declared\(\s*\w+,\s*[^,]+,\s*"(\w+)"\s*\)', path.read_text(encoding="utf-8")))
    assert read and read <= READ_ATTRIBUTES, read - READ_ATTRIBUTES


def test_every_attribute_has_its_line() -> None:
    tree = ast.parse(Path(d.__file__).read_text(encoding="utf-8"))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for i, stmt in enumerate(cls.body):
            if isinstance(stmt, ast.AnnAssign):
                doc = cls.body[i + 1] if i + 1 < len(cls.body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (cls.name, stmt.target)
                assert stmt.value is not None, f"{cls.name}.{ast.unparse(stmt.target)} has no default"


def test_the_runtime_check_refuses_what_the_types_refuse() -> None:
    class Good:
        engine_capabilities = frozenset({"weights_from_path"})
        generates_on_every_rank = True

    class Env:
        @staticmethod
        def provides_reward(config: Any) -> bool:
            return True

        class Settings(BaseModel):
            x: int = 1

    class Bad:
        engine_capabilities = frozenset({1})
        concurrent_generate = 1  # an int is not a bool
        Settings = dict

    assert d.declaration_problems(Good, d.RolloutImplementation) == []
    assert d.declaration_problems(Env, d.EnvironmentImplementation) == []
    assert d.declaration_problems(type("Undeclared", (), {}), d.RolloutImplementation) == []  # defaults apply
    assert d.declaration_problems(Bad, d.RolloutImplementation) == [
        "Settings = <class 'dict'>: it must be a class derived from BaseModel or None",
        "engine_capabilities = frozenset({1}): it must be a frozenset of str, e.g. frozenset({...})",
        "concurrent_generate = 1: it must be True or False",
    ]
    assert d.declaration_problems(type("E", (), {"provides_reward": "yes"}), d.EnvironmentImplementation) == [
        "provides_reward = 'yes': it must be True or False or a static function (config) -> bool"
    ]
    assert d.declaration_problems(type("E", (), {"names": "tools"}), d.EnvironmentImplementation) == [
        "names = 'tools': it must be a list of str or a static function (config) -> list[str] | None or None"
    ]
    assert d.declaration_problems(type("E", (), {"names": ["a", "b"]}), d.EnvironmentImplementation) == []


def test_every_builtin_implementation_keeps_the_contract() -> None:
    host = PluginHost(allow=set())
    for point in EXTENSION_POINTS:
        listed = [i for i in host.list_group(GROUP_PREFIX + point.name) if i.distribution == "grpo"]
        assert listed and [(i.name, i.error) for i in listed if i.error] == []


def _mypy(src: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """mypy over ``src``, following grpo_core's own modules (the heavy
    libraries behind them are read as Any: the Protocols are what is checked)."""
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\npython_version = 3.11\nfollow_imports = silent\nignore_missing_imports = True\n"
        "[mypy-torch.*,transformers.*,peft.*,datasets.*,accelerate.*,safetensors.*,trl.*,numpy.*]\n"
        "follow_imports = skip\n",
        encoding="utf-8",
    )
    env = {**os.environ, "MYPYPATH": str(REPO)}  # grpo is installed editable: mypy reads it from the checkout
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(config),
        "--cache-dir",
        str(tmp_path / "cache"),
        str(src),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_the_contract_test_package_type_checks_against_the_protocols(tmp_path: Path) -> None:
    """mypy (about 10 s) checks what the package's classes declare against the
    Protocols they subclass; the same package with wrong declarations fails."""
    good = _mypy(PACKAGE / "src", tmp_path)
    assert good.returncode == 0 and "Success: no issues found" in good.stdout, good.stdout + good.stderr

    wrong = tmp_path / "wrong"
    shutil.copytree(PACKAGE / "src", wrong)
    sync = wrong / "grpo_contract_test" / "sync.py"
    text = sync.read_text(encoding="utf-8")
    text = text.replace('sends = "merged_weights"', 'sends = "weights"')
    text = text.replace("frozenset({WEIGHTS_FROM_PATH})", "{WEIGHTS_FROM_PATH}")
    sync.write_text(text, encoding="utf-8")
    bad = _mypy(wrong, tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert 'expression has type "set[str]", base class "WeightSyncImplementation" defined the type as' in bad.stdout
    assert "expression has type \"Literal['weights']\"" in bad.stdout


def test_a_plugin_class_that_subclasses_a_protocol_is_built_and_registered(tmp_path: Path) -> None:
    """Subclassing the Protocol changes nothing at run time: the package's
    classes pass the contract check, build and register as before."""
    from grpo_core.contract.context import RunContext

    sys.path.insert(0, str(PACKAGE / "src"))
    try:
        from grpo_contract_test.aggregation import ScaledGroupAdvantages
        from grpo_contract_test.sync import TimedFullSync

        assert contract_problem("grpo.weight_sync", TimedFullSync) is None
        assert contract_problem("grpo.advantage_aggregation", ScaledGroupAdvantages) is None
        sync = TimedFullSync(RunContext(config=None, output_dir=tmp_path), TimedFullSync.Settings())  # type: ignore[arg-type]
        host = PluginHost(allow=set())
        host.pm.register(sync)
        assert [i.plugin for i in host.pm.hook.grpo_sync_weights.get_hookimpls()] == [sync]
    finally:
        sys.path.remove(str(PACKAGE / "src"))
        for name in [m for m in sys.modules if m.split(".")[0] == "grpo_contract_test"]:
            del sys.modules[name]

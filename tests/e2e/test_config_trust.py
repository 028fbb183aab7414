"""A config you did not write cannot widen what may run, and `grpo config
check` shows the code it will run before `grpo run` runs it.

* The environment's ``GRPO_PLUGINS_ALLOW`` is an upper bound: a config's
  ``plugins.allow`` only narrows it, and naming a distribution outside it
  is an error naming both. Checked on :func:`effective_allowlist` and through
  the real CLI against a real (``.dist-info``) distribution whose always-on
  plugin writes a marker when imported.
* ``grpo config check`` lists every import path with the file it resolves
  to, and resolving runs none of it: every module in the test writes a
  marker when it is executed, and no marker appears.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import grpo, no_traceback

from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError
from grpo_core.host.plugin_host import ALLOW_ENV, PluginHost, effective_allowlist
from grpo_core.host.user_code import locate, named_user_code

SPY_DIST = "grpo-spy-plugin"


def marking(name: str) -> str:
    """Source that leaves ``<name>.ran`` in MARKERS when Python executes it."""
    return f"import os, pathlib\npathlib.Path(os.environ['MARKERS'], '{name}.ran').write_text('ran')\n"


# ---------------------------------------------------------------- the allowlist


def test_the_environment_bounds_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert effective_allowlist(None) is None  # neither: no restriction
    assert effective_allowlist({"Dist_A"}) == {"dist-a", "grpo"}  # the config alone restricts
    monkeypatch.setenv(ALLOW_ENV, "dist-a, dist-b")
    assert effective_allowlist(None) == {"dist-a", "dist-b", "grpo"}  # the environment alone
    assert effective_allowlist({"dist-a"}) == {"dist-a", "grpo"}  # a config narrows it
    assert effective_allowlist({"grpo"}) == {"grpo"}  # narrowed to grpo alone: still a restriction, not "none"
    assert PluginHost(allow={"DIST.B"}).allow == {"dist-b", "grpo"}
    for config in (None, {"dist-a"}, {"grpo"}):  # reward workers rebuild their host from host.allow: it must stand
        assert effective_allowlist(effective_allowlist(config)) == effective_allowlist(config)
    with pytest.raises(ConfigError) as info:
        effective_allowlist({"dist-a", "dist-c"})
    message = str(info.value)
    assert "plugins.allow" in message and "'dist-c'" in message and ALLOW_ENV in message and "dist-a, dist-b" in message
    assert "'dist-a'" not in message  # only the offending name is blamed


@pytest.fixture
def spy_site(tmp_path: Path) -> Path:
    """A real distribution whose always-on plugin marks its import."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "grpo_spy_plugin.py").write_text(marking("spy_plugin") + "\nclass Spy:\n    pass\n", encoding="utf-8")
    info = site / "grpo_spy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {SPY_DIST}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text("[grpo.plugins]\nspy = grpo_spy_plugin:Spy\n", encoding="utf-8")
    return site


CONFIG = (
    'base_model = "org/m"\n'
    "micro_batch_size = 4\n"
    "[[datasets]]\n"
    'path = "org/data"\n'
    "{datasets}[trl]\n"
    "num_generations = 4\n"
    "{trl}\n"
    "{extra}"
)


def test_a_config_cannot_widen_the_environments_allowlist(spy_site: Path, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"PYTHONPATH": str(spy_site), "MARKERS": str(markers)}
    plain = tmp_path / "plain.toml"
    plain.write_text(CONFIG.format(datasets="", trl='reward_funcs = ["last_number_match"]', extra=""), encoding="utf-8")
    assert grpo("config", "check", str(plain), cwd=tmp_path, env=env, unset=[ALLOW_ENV]).returncode == 0
    assert (markers / "spy_plugin.ran").exists()  # sanity: unrestricted, its always-on plugin loads
    (markers / "spy_plugin.ran").unlink()

    widening = tmp_path / "widening.toml"
    widening.write_text(plain.read_text(encoding="utf-8") + f'[plugins]\nallow = ["{SPY_DIST}"]\n', encoding="utf-8")
    admin = env | {ALLOW_ENV: "grpo-plugin-example"}
    for args in (
        ("config", "check", str(widening)),
        ("run", str(widening)),
        ("config", "check", str(plain), "--set", f'plugins.allow=["{SPY_DIST}"]'),
    ):
        result = grpo(*args, cwd=tmp_path, env=admin, unset=[ALLOW_ENV])
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        no_traceback(result)
        assert SPY_DIST in result.stderr and ALLOW_ENV in result.stderr and "grpo-plugin-example" in result.stderr
        assert not (markers / "spy_plugin.ran").exists(), args  # refused before anything was imported
    # where the environment allows it, the same config may narrow to it
    allowed = grpo(
        "config", "check", str(widening), cwd=tmp_path, env=env | {ALLOW_ENV: f"other,{SPY_DIST}"}, unset=[ALLOW_ENV]
    )
    assert allowed.returncode == 0, allowed.stderr
    assert (markers / "spy_plugin.ran").exists()


# ---------------------------------------------------------------- the code a config runs


def user_tree(root: Path) -> None:
    """Modules for every key that names code, each marking its execution."""
    (root / "myrewards.py").write_text(
        marking("myrewards") + "\n\n"
        "def accuracy(completions, **kwargs):\n"
        "    return [0.0] * len(completions)\n"
        "\n"
        "\n"
        "def transform(cfg):\n"
        "    return lambda row: row\n",
        encoding="utf-8",
    )
    pkg = root / "agentpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(marking("agentpkg"), encoding="utf-8")
    (pkg / "sub" / "__init__.py").write_text(marking("agentpkg.sub"), encoding="utf-8")
    (pkg / "sub" / "envs.py").write_text(
        marking("envs") + "\nclass Game:\n    pass\n\n\ndef search(query: str) -> str:\n    return query\n",
        encoding="utf-8",
    )
    (pkg / "rollout.py").write_text(marking("rollout") + "\nrollout = lambda prompts, trainer: {}\n", encoding="utf-8")


def test_config_check_lists_each_module_with_its_file_without_running_it(tmp_path: Path) -> None:
    user_tree(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    path = tmp_path / "c.toml"
    path.write_text(
        CONFIG.format(
            datasets='type = "myrewards.transform"\n',
            trl='reward_funcs = ["myrewards.accuracy", "last_number_match"]\nrollout_func = "agentpkg.rollout.rollout"',
            extra="",
        ),
        encoding="utf-8",
    )
    result = grpo("config", "check", str(path), cwd=tmp_path, env={"MARKERS": str(markers)}, unset=[ALLOW_ENV])
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in markers.iterdir()) == []  # nothing ran, parent packages included
    out = result.stdout
    assert f"trl.reward_funcs[0]: myrewards.accuracy -> {tmp_path / 'myrewards.py'}:5" in out
    assert f"datasets[0].type: myrewards.transform -> {tmp_path / 'myrewards.py'}:9" in out
    assert (
        f"trl.rollout_func: agentpkg.rollout.rollout -> {tmp_path / 'agentpkg' / 'rollout.py'}:4; importing it runs "
        f"{tmp_path / 'agentpkg' / '__init__.py'} first"
    ) in out
    assert "last_number_match ->" not in out  # a registered reward is a plugin, not an import path
    # a module that is not there stops the check (exit 2), still without running anything
    missing = grpo(
        "config",
        "check",
        str(path),
        "--set",
        'trl.reward_funcs=["myrewards.accuracy", "missing_mod.reward"]',
        cwd=tmp_path,
        env={"MARKERS": str(markers)},
    )
    assert missing.returncode == 2 and "trl.reward_funcs[1] = 'missing_mod.reward': no module 'missing_mod'" in (
        missing.stderr
    )
    assert sorted(p.name for p in markers.iterdir()) == []


def test_tools_and_environment_factory_resolve_through_nested_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (their 'tools' environment may not be installed yet, so the
    CLI check could refuse the config before listing)."""
    user_tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MARKERS", str(tmp_path))
    cfg = validate(
        {
            "base_model": "m",
            "datasets": [{"path": "org/data"}],
            "micro_batch_size": 4,
            "trl": {
                "num_generations": 4,
                "reward_funcs": ["r"],
                "tools": ["agentpkg.sub.envs.search"],
                "environment_factory": "agentpkg.sub.envs.Game",
            },
        }
    )
    assert named_user_code(cfg, {"r"}) == [
        ("trl.environment_factory", "agentpkg.sub.envs.Game"),
        ("trl.tools[0]", "agentpkg.sub.envs.search"),
    ]
    game, search = (locate(key, spec) for key, spec in named_user_code(cfg, {"r"}))
    envs = tmp_path / "agentpkg" / "sub" / "envs.py"
    assert (game.file, game.line, search.line) == (str(envs), 4, 8)
    assert game.runs_first == (
        str(tmp_path / "agentpkg" / "__init__.py"),
        str(tmp_path / "agentpkg" / "sub" / "__init__.py"),
    )
    assert "agentpkg" not in sys.modules and not list(tmp_path.glob("*.ran"))
    missing = locate("trl.tools[1]", "agentpkg.sub.nothere.f")
    assert missing.file is None and "no module 'agentpkg.sub.nothere' in the folders of package 'agentpkg.sub'" in (
        missing.problem or ""
    )
    assert (
        locate("k", "myrewards.accuracy.deeper").problem
        == "'myrewards' is a module, not a package, so it has no 'accuracy'"
    )
    assert not list(tmp_path.glob("*.ran"))
    assert locate("k", "sys.exit").describe() == "k: sys.exit -> <built-in: part of Python, no source file>"
    assert locate("k", "agentpkg.nothing").problem is None  # agentpkg/__init__.py resolves; it defines nothing
    assert "no top-level 'nothing' found by reading it" in locate("k", "agentpkg.nothing").describe()

"""Third-party plugins, for real: installed packages found by entry point.

* ``examples/grpo-plugin-example`` is built and installed with pip into a
  temporary ``--target`` directory (not into the shared venv, so other tests
  and other people's runs never see it); the CLI sees it via ``PYTHONPATH``,
  in-process tests via ``sys.path``. Nothing is left behind.
* Broken plugins are a real distribution too: a ``.dist-info`` with
  ``entry_points.txt`` next to a module, written into another temporary
  directory. That is exactly what pip would install for them.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GRPO, REPO, grpo, no_traceback
from pip_target import install_into_target
from plugin_set import only_plugins_from
from tiny_model import random_llama

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, PluginError
from grpo_core.host import plugin_host
from grpo_core.host.plugin_host import ALLOW_ENV, PluginHost
from grpo_core.validation.run_check import check_run_config

EXAMPLE = REPO / "examples" / "grpo-plugin-example"
EXAMPLE_DIST = "grpo-plugin-example"
BROKEN_DIST = "grpo-broken-example"


@contextmanager
def on_path(site: Path, *modules: str) -> Iterator[None]:
    """Make ``site`` importable in this process and forget it afterwards."""
    sys.path.insert(0, str(site))
    plugin_host.rescan()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        for name in list(sys.modules):
            if name.split(".")[0] in modules:
                del sys.modules[name]
        plugin_host.rescan()


def context(tmp_path: Path, **trl: Any) -> RunContext:
    cfg = validate(
        {
            "base_model": "org/m",
            "datasets": [{"path": "org/data"}],
            "micro_batch_size": 4,
            "trl": {"num_generations": 4, "reward_funcs": ["length_bonus"], **trl},
        }
    )
    return RunContext(config=cfg, output_dir=tmp_path)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package, pip-installed into a private target directory."""
    site = install_into_target(EXAMPLE, tmp_path_factory.mktemp("example"))
    assert list(site.glob("grpo_plugin_example-*.dist-info/entry_points.txt"))
    return site


BROKEN_MODULE = '''
from pydantic import BaseModel

from grpo_core.plugin_api import ConfigError, hookimpl


class WrongArg:
    """Its hook asks for an argument the spec does not have."""
    def __init__(self, context):
        self.context = context

    @hookimpl
    def grpo_aggregate_advantages(self, rewardz, group_size):
        return rewardz


class NoHook:
    """Forgot @hookimpl: implements nothing."""
    def __init__(self, context):
        pass

    def grpo_aggregate_advantages(self, rewards):
        return rewards


class Misspelt:
    def __init__(self, context):
        pass

    @hookimpl
    def grpo_aggregate_advantage(self, rewards):
        return rewards


def crashing_factory(context):
    raise RuntimeError("no GPU found")


class BadAlwaysOn:
    @hookimpl
    def grpo_train_start(self, ctx):
        pass


class HelloCommand:
    @hookimpl
    def grpo_register_commands(self, app):
        @app.command("hello")
        def hello(name: str = "world") -> None:
            """Say hello (added by a plugin)."""
            print(f"hello {name}")

        @app.command("wait")
        def wait() -> None:
            """Block until interrupted."""
            import time
            print("waiting", flush=True)
            time.sleep(60)

        @app.command("fail")
        def fail() -> None:
            """Fail the way a lost engine does."""
            from grpo_core.contract.errors import EngineUnavailable
            raise EngineUnavailable("vLLM server at http://127.0.0.1:9 did not answer: start it first")


class BoomCommand:
    @hookimpl
    def grpo_register_commands(self, app):
        raise RuntimeError("boom while adding commands")


# Each gets the contract wrong in a way that would fail late, or be silently ignored, if grpo did not refuse it.
class SettingsButContextOnly:
    class Settings(BaseModel):
        strength: float = 1.0

    def __init__(self, context):  # built as SettingsButContextOnly(context, settings): a TypeError at run time
        pass

    @hookimpl
    def grpo_aggregate_advantages(self, rewards):
        return rewards.sum(dim=1)


class InstanceValidate:
    def __init__(self, context):
        pass

    @hookimpl
    def grpo_validate_config(self, config):  # asked of the class before building it: never called
        raise ConfigError("never seen")

    @hookimpl
    def grpo_aggregate_advantages(self, rewards):
        return rewards.sum(dim=1)


class WrongDeclarations:
    sends = "weights"  # not one of merged_weights / adapter / nothing
    required_capabilities = {"weights_from_path"}  # a set, not a frozenset

    def __init__(self, context):
        pass

    @hookimpl
    def grpo_sync_weights(self, model, version):
        return None


class SetsInInit:
    def __init__(self, context):
        self.sends = "weights"  # read off the built object: checked once it is built

    @hookimpl
    def grpo_sync_weights(self, model, version):
        return None


class HalfState:
    def __init__(self, context):
        self.seen = 0

    def state_dict(self):  # no load_state_dict: not Checkpointable, so never saved
        return {"seen": self.seen}

    @hookimpl
    def grpo_replay_prompts(self, prompts):
        return prompts

    @hookimpl
    def grpo_replay_groups(self, groups):
        return groups
'''

OLD_PATHS_MODULE = """
from grpo_core.types import Prompt  # a module path from before grpo_core's modules moved


class Thing:
    def __init__(self, context):
        pass
"""

BROKEN_ENTRY_POINTS = """
[grpo.advantage_aggregation]
missing_module = grpo_broken_nowhere.impl:Thing
wrong_arg = grpo_broken_example.impls:WrongArg
no_hook = grpo_broken_example.impls:NoHook
misspelt = grpo_broken_example.impls:Misspelt
crashing = grpo_broken_example.impls:crashing_factory
settings_but_context_only = grpo_broken_example.impls:SettingsButContextOnly
instance_validate = grpo_broken_example.impls:InstanceValidate
old_paths = grpo_broken_example.old_paths:Thing

[grpo.weight_sync]
wrong_declarations = grpo_broken_example.impls:WrongDeclarations
sets_in_init = grpo_broken_example.impls:SetsInInit

[grpo.replay]
half_state = grpo_broken_example.impls:HalfState

[grpo.plugins]
bad_always_on = grpo_broken_example.impls:BadAlwaysOn
hello_command = grpo_broken_example.impls:HelloCommand
boom_command = grpo_broken_example.impls:BoomCommand
"""


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("broken")
    package = site / "grpo_broken_example"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "impls.py").write_text(textwrap.dedent(BROKEN_MODULE), encoding="utf-8")
    (package / "old_paths.py").write_text(OLD_PATHS_MODULE, encoding="utf-8")
    info = site / "grpo_broken_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {BROKEN_DIST}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(BROKEN_ENTRY_POINTS, encoding="utf-8")
    return site


# ---------------------------------------------------------------- the example package


def test_cli_lists_the_example_plugin_with_its_distribution(example_site: Path) -> None:
    result = grpo("plugins", "--json", pythonpath=example_site, plugins_from=(example_site,))
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    reward = {i["name"]: i for i in listing["reward"]["implementations"]}
    advantages = {i["name"]: i for i in listing["advantage_aggregation"]["implementations"]}
    assert reward["length_bonus"] == {
        "name": "length_bonus",
        "target": "grpo_plugin_example.rewards:length_bonus",
        "distribution": EXAMPLE_DIST,
        "summary": "1.0 for completions of `target_tokens` tokens, falling linearly to 0.0 at zero length and at "
        "twice the target.",  # the first sentence of its docstring: what `grpo plugins` shows
        "error": None,
        "status": "OK",
    }
    assert advantages["rank"]["distribution"] == EXAMPLE_DIST and advantages["rank"]["error"] is None
    assert advantages["rank"]["target"] == "grpo_plugin_example.ranking:RankAdvantages"
    # without the package's site, it is gone (whether or not someone pip-installed the example into the venv)
    plain = json.loads(grpo("plugins", "--json", plugins_from=()).stdout)
    assert {i["name"] for i in plain["advantage_aggregation"]["implementations"]} == {
        "normalize_then_sum",
        "sum_then_normalize",
        "turn_returns",
    }
    assert "length_bonus" not in {i["name"] for i in plain["reward"]["implementations"]}


def test_example_reward_and_aggregation_load_and_run(example_site: Path, tmp_path: Path) -> None:
    with on_path(example_site, "grpo_plugin_example"):
        host = PluginHost()
        ctx = context(tmp_path, multi_objective_aggregation="rank")
        reward = host.load_reward("length_bonus", ctx)
        scores = reward(
            prompts=["p"] * 4, completions=["a", "b", "c", "d"], completion_ids=[[1] * 64, [1] * 32, [], [1] * 200]
        )
        assert scores == [1.0, 0.5, 0.0, 0.0]

        obj = host.load_implementation("advantage_aggregation", "rank", ctx)
        assert type(obj).__module__ == "grpo_plugin_example.ranking" and obj.context is ctx
        assert host.chosen == {"advantage_aggregation": "rank"}
        nan = float("nan")
        rewards = torch.tensor(
            [
                [0.2, 1.0],
                [0.9, 0.0],
                [5.0, 1.0],
                [0.0, 0.0],  # group 1: distinct totals
                [1.0, 1.0],
                [1.0, 1.0],
                [nan, nan],
                [1.0, 1.0],
            ]
        )  # group 2: no signal
        advantages = host.hook.grpo_aggregate_advantages(
            rewards=rewards,
            weights=torch.tensor([1.0, 0.5]),
            group_size=4,
            scale_rewards="group",
            completions=[],
            reward_names=["a", "b"],
        )
        # group 1 totals 0.7, 0.9, 5.5, 0.0 -> ranks 1, 2, 3, 0 -> centred on [-1, 1]
        assert advantages[:4].tolist() == pytest.approx([-1 / 3, 1 / 3, 1.0, -1.0])
        assert advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_config_check_accepts_the_plugin_by_name(example_site: Path, tmp_path: Path) -> None:
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(
        'base_model = "org/m"\nmicro_batch_size = 4\n[[datasets]]\npath = "org/data"\n'
        '[trl]\nnum_generations = 4\nreward_funcs = ["length_bonus"]\nmulti_objective_aggregation = "rank"\n',
        encoding="utf-8",
    )
    ok = grpo("config", "check", str(cfg_path), pythonpath=example_site, plugins_from=(example_site,))
    assert ok.returncode == 0, ok.stderr
    assert "advantage_aggregation=rank" in ok.stdout
    missing = grpo("config", "check", str(cfg_path), plugins_from=())
    assert missing.returncode == 2
    assert "trl.multi_objective_aggregation = 'rank': no installed package publishes 'rank'" in missing.stderr


# ---------------------------------------------------------------- allowlist


def test_allowlist_env_blocks_a_distribution(
    example_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = grpo("plugins", "--json", pythonpath=example_site, env={ALLOW_ENV: "some-other-dist"})
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    rank = next(i for i in listing["advantage_aggregation"]["implementations"] if i["name"] == "rank")
    assert "allowlist" in rank["error"] and rank["status"] == "NOT ALLOWED"
    builtin = next(i for i in listing["advantage_aggregation"]["implementations"] if i["name"] == "sum_then_normalize")
    assert builtin["error"] is None or "allowlist" not in builtin["error"]  # grpo itself is always allowed

    with on_path(example_site, "grpo_plugin_example"):
        monkeypatch.setenv(ALLOW_ENV, "some-other-dist")
        ctx = context(tmp_path)
        with pytest.raises(PluginError) as info:
            PluginHost().load_reward("length_bonus", ctx)
        assert "not allowed" in str(info.value) and EXAMPLE_DIST in str(info.value) and ALLOW_ENV in str(info.value)
        with pytest.raises(PluginError, match="not allowed"):
            PluginHost().load_implementation("advantage_aggregation", "rank", ctx)
        monkeypatch.setenv(ALLOW_ENV, f"some-other-dist, {EXAMPLE_DIST.upper().replace('-', '_')}")
        assert PluginHost().load_reward("length_bonus", ctx).__name__ == "length_bonus"  # names are normalised


def test_config_allowlist_blocks_a_chosen_implementation(example_site: Path, tmp_path: Path) -> None:
    with on_path(example_site, "grpo_plugin_example"):
        blocked = validate(
            {
                "base_model": "org/m",
                "datasets": [{"path": "org/d"}],
                "micro_batch_size": 4,
                "trl": {
                    "num_generations": 4,
                    "reward_funcs": ["last_number_match"],
                    "multi_objective_aggregation": "rank",
                },
                "plugins": {"allow": ["someone-else"]},
            }
        )
        with pytest.raises(ConfigError, match="rank.*not allowed.*plugins.allow"):
            check_run_config(blocked, PluginHost(allow=set(blocked.plugins.allow or [])))
        check_run_config(blocked, PluginHost(allow={EXAMPLE_DIST}))


# ---------------------------------------------------------------- broken plugins


def test_cli_plugins_still_works_and_marks_broken_ones(broken_site: Path) -> None:
    result = grpo("plugins", "--json", pythonpath=broken_site)
    assert result.returncode == 0, result.stderr
    no_traceback(result)
    listing = json.loads(result.stdout)
    aggregations = {i["name"]: i for i in listing["advantage_aggregation"]["implementations"]}
    always_on = {i["name"]: i for i in listing["plugins"]["implementations"]}
    assert "ModuleNotFoundError" in aggregations["missing_module"]["error"]
    assert "rewardz" in aggregations["wrong_arg"]["error"]
    assert "does not implement ['grpo_aggregate_advantages']" in aggregations["no_hook"]["error"]
    assert "grpo_aggregate_advantage'" in aggregations["misspelt"]["error"]
    assert aggregations["crashing"]["error"] is None  # a factory function is only checked when called
    assert "make it a @staticmethod" in aggregations["instance_validate"]["error"]
    assert (
        "sends = 'weights'"
        in {i["name"]: i for i in listing["weight_sync"]["implementations"]}["wrong_declarations"]["error"]
    )
    assert "ctx" in always_on["bad_always_on"]["error"]
    assert always_on["hello_command"]["error"] is None
    assert {aggregations[n]["distribution"] for n in ("wrong_arg", "no_hook", "missing_module")} == {BROKEN_DIST}
    assert aggregations["sum_then_normalize"]["distribution"] == "grpo"  # built-ins listed as before


def test_broken_always_on_plugins_do_not_break_other_commands(broken_site: Path) -> None:
    help_result = grpo("--help", pythonpath=broken_site)
    assert help_result.returncode == 0, help_result.stderr
    assert "hello" in help_result.stdout  # the healthy plugin's command is there
    assert "boom while adding commands" in help_result.stderr
    assert "bad_always_on" in help_result.stderr and BROKEN_DIST in help_result.stderr
    no_traceback(help_result)
    hello = grpo("hello", "--name", "plugin", pythonpath=broken_site)
    assert hello.returncode == 0 and hello.stdout.strip() == "hello plugin"
    schema = grpo("config", "schema", pythonpath=broken_site)
    assert schema.returncode == 0 and json.loads(schema.stdout)["title"] == "GRPOConfig"


def test_grpo_errors_and_ctrl_c_map_to_exit_codes(broken_site: Path) -> None:
    failed = grpo("fail", pythonpath=broken_site)
    assert failed.returncode == 3  # EngineUnavailable.exit_code
    assert "error: vLLM server at http://127.0.0.1:9 did not answer" in failed.stderr
    no_traceback(failed)

    env = {**os.environ, "PYTHONPATH": str(broken_site)}
    # A disposition of "ignore" is inherited through exec, and Python then installs no KeyboardInterrupt
    # handler: the child starts with the default one, whatever this process has (a suite started as a
    # background job of a script has SIGINT ignored, and `grpo wait` then slept through the signal).
    proc = subprocess.Popen(
        [GRPO, "wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    no_traceback(stderr)


def test_config_check_refuses_a_run_with_a_broken_always_on_plugin(broken_site: Path) -> None:
    result = grpo("config", "check", "config.yaml", pythonpath=broken_site, cwd=REPO / "examples" / "quickstart")
    assert result.returncode == 2
    assert "bad_always_on" in result.stderr and BROKEN_DIST in result.stderr
    no_traceback(result)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("missing_module", "ModuleNotFoundError"),
        ("wrong_arg", "rewardz"),
        ("no_hook", "does not implement ['grpo_aggregate_advantages']"),
        ("misspelt", "no such hook"),
        ("crashing", "failed to start: RuntimeError: no GPU found"),
    ],
)
def test_broken_implementation_raises_plugin_error_naming_dist_and_entry_point(
    broken_site: Path, tmp_path: Path, name: str, fragment: str
) -> None:
    with on_path(broken_site, "grpo_broken_example"):
        host = PluginHost()
        with pytest.raises(PluginError) as info:
            host.load_implementation("advantage_aggregation", name, context(tmp_path))
        message = str(info.value)
        assert f"entry point '{name}'" in message and BROKEN_DIST in message and fragment in message
        assert "advantage_aggregation" not in host.chosen
        # nothing half-registered remains: a good implementation still loads
        assert not [p for p in host.pm.get_plugins() if type(p).__module__ == "grpo_broken_example.impls"]


def test_a_declaration_set_when_built_is_checked_once_built(broken_site: Path, tmp_path: Path) -> None:
    with on_path(broken_site, "grpo_broken_example"):
        host = PluginHost()
        with pytest.raises(PluginError, match="'sets_in_init'.*declares sends = 'weights': it must be one of"):
            host.load_implementation("weight_sync", "sets_in_init", context(tmp_path))
        assert "weight_sync" not in host.chosen


def test_broken_always_on_plugin_strict_and_lenient(broken_site: Path) -> None:
    with on_path(broken_site, "grpo_broken_example"):
        with pytest.raises(PluginError) as info:
            PluginHost().load_always_on(strict=True)
        assert "bad_always_on" in str(info.value) and BROKEN_DIST in str(info.value)
        host = PluginHost()
        with pytest.warns(UserWarning):
            problems = host.load_always_on(strict=False)
        assert any("bad_always_on" in p for p in problems)
        names = {host.pm.get_name(p) for p in host.pm.get_plugins()}
        assert f"grpo.plugins:{BROKEN_DIST}:hello_command" in names
        assert f"grpo.plugins:{BROKEN_DIST}:bad_always_on" not in names


def test_unknown_implementation_name_lists_the_available_ones(tmp_path: Path) -> None:
    with only_plugins_from(), pytest.raises(PluginError) as info:  # grpo's own: the listing is exact
        PluginHost().load_implementation("advantage_aggregation", "nope", context(tmp_path))
    message = str(info.value)
    assert "no installed package publishes 'nope'" in message and "grpo.advantage_aggregation" in message
    assert "normalize_then_sum, sum_then_normalize" in message


# ---------------------------------------------------------------- one index: ambiguity and qualification

TWIN_DIST = "grpo-rank-twin"


@pytest.fixture(scope="module")
def twin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second distribution that also publishes 'rank' (and a marker-writing
    always-on plugin, for the allowlist test)."""
    site = tmp_path_factory.mktemp("twin")
    package = site / "grpo_rank_twin"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os, pathlib\n"
        "marker = os.environ.get('GRPO_TWIN_MARKER')\n"
        "if marker:\n    pathlib.Path(marker).write_text('imported')\n"
        "from grpo_core.plugin_api import hookimpl\n\n"
        "class Twin:\n    def __init__(self, context):\n        pass\n\n"
        "    @hookimpl\n    def grpo_aggregate_advantages(self, rewards):\n        return rewards.sum(dim=1)\n\n"
        "class Hello:\n    @hookimpl\n    def grpo_register_commands(self, app):\n"
        "        app.command('twin-hello')(lambda: print('twin'))\n",
        encoding="utf-8",
    )
    info = site / "grpo_rank_twin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {TWIN_DIST}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[grpo.advantage_aggregation]\n"
        "rank = grpo_rank_twin:Twin\n"
        "\n"
        "[grpo.plugins]\n"
        "twin_hello = grpo_rank_twin:Hello\n",
        encoding="utf-8",
    )
    return site


def test_a_name_published_twice_is_refused_naming_both_and_qualifies(
    example_site: Path, twin_site: Path, tmp_path: Path
) -> None:
    with on_path(example_site, "grpo_plugin_example"), on_path(twin_site, "grpo_rank_twin"):
        host = PluginHost()
        with pytest.raises(PluginError) as info:
            host.load_implementation("advantage_aggregation", "rank", context(tmp_path))
        message = str(info.value)
        assert "ambiguous" in message and EXAMPLE_DIST in message and TWIN_DIST in message
        assert f"'{EXAMPLE_DIST}:rank'" in message and f"'{TWIN_DIST}:rank'" in message
        obj = host.load_implementation("advantage_aggregation", f"{TWIN_DIST}:rank", context(tmp_path))
        assert type(obj).__module__ == "grpo_rank_twin"
        # the allowlist can settle it too: only one of them may load
        only = PluginHost(allow={EXAMPLE_DIST}).load_implementation("advantage_aggregation", "rank", context(tmp_path))
        assert type(only).__module__ == "grpo_plugin_example.ranking"
        listing = {(i.name, i.distribution): i.error for i in host.list_group("grpo.advantage_aggregation")}
        assert "ambiguous" in listing[("rank", EXAMPLE_DIST)] and "ambiguous" in listing[("rank", TWIN_DIST)]


def test_cli_says_ambiguous_not_broken_for_a_name_published_twice(example_site: Path, twin_site: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(example_site), str(twin_site)])}
    result = grpo("plugins", env=env, plugins_from=(example_site, twin_site))
    assert result.returncode == 0, result.stderr
    rank = [line for line in result.stdout.splitlines() if line.strip().startswith("rank ")]
    assert len(rank) == 2 and all("AMBIGUOUS: 'rank' is also published by" in line for line in rank), rank
    assert not any("BROKEN" in line for line in rank)
    assert f"choose '{EXAMPLE_DIST}:rank'" in result.stdout and f"choose '{TWIN_DIST}:rank'" in result.stdout
    listing = json.loads(grpo("plugins", "--json", env=env, plugins_from=(example_site, twin_site)).stdout)
    statuses = {
        (i["name"], i["distribution"]): i["status"] for i in listing["advantage_aggregation"]["implementations"]
    }
    assert statuses[("rank", EXAMPLE_DIST)] == statuses[("rank", TWIN_DIST)] == "AMBIGUOUS"
    assert statuses[("sum_then_normalize", "grpo")] == "OK"


# ---------------------------------------------------------------- plugin settings


def write_config(tmp_path: Path, trl: str, extra: str = "") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        'base_model = "org/m"\n'
        "micro_batch_size = 4\n"
        "[[datasets]]\n"
        'path = "org/data"\n'
        "[trl]\n"
        "num_generations = 4\n"
        f"{trl}\n"
        f"{extra}",
        encoding="utf-8",
    )
    return path


def test_length_bonus_is_configured_from_a_toml_file(example_site: Path, tmp_path: Path) -> None:
    from grpo_core.config.loader import load_config

    path = write_config(tmp_path, 'reward_funcs = ["length_bonus"]', "[plugins.length_bonus]\ntarget_tokens = 4\n")
    with on_path(example_site, "grpo_plugin_example"):
        cfg = load_config(path)
        reward = PluginHost().load_reward("length_bonus", RunContext(config=cfg, output_dir=tmp_path))
        assert reward.__name__ == "length_bonus"
        # 4 tokens is now the target: full bonus; 8 tokens is twice the target: none
        assert reward(completions=["a", "b"], completion_ids=[[1] * 4, [1] * 8]) == [1.0, 0.0]
        assert check_run_config(cfg) == []
    ok = grpo("config", "check", str(path), pythonpath=example_site)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        (
            "[plugins.length_bonus]\ntarget_token = 4\n",
            "plugins.length_bonus.target_token: Extra inputs are not permitted",
        ),
        (
            "[plugins.length_bonus]\ntarget_tokens = 0\n",
            "plugins.length_bonus.target_tokens: Input should be greater than or equal to 1",
        ),
        ("[plugins.rank]\nstrength = 2\n", "[plugins.rank] sets ['strength'], but 'rank' declares no settings"),
    ],
)
def test_bad_plugin_settings_name_the_key(example_site: Path, tmp_path: Path, table: str, fragment: str) -> None:
    path = write_config(tmp_path, 'reward_funcs = ["length_bonus"]\nmulti_objective_aggregation = "rank"', table)
    result = grpo("config", "check", str(path), pythonpath=example_site)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    no_traceback(result)


QUALIFIED = f'"{EXAMPLE_DIST}:length_bonus"'


def test_a_qualified_name_reads_its_qualified_settings_table(example_site: Path, tmp_path: Path) -> None:
    """``[plugins."dist:name"]`` configures the implementation chosen as ``"dist:name"``."""
    from grpo_core.config.loader import load_config

    path = write_config(tmp_path, f"reward_funcs = [{QUALIFIED}]", f"[plugins.{QUALIFIED}]\ntarget_tokens = 4\n")
    with on_path(example_site, "grpo_plugin_example"):
        cfg = load_config(path)
        assert check_run_config(cfg, PluginHost()) == []  # read, so not "unused"
        reward = PluginHost().load_reward(f"{EXAMPLE_DIST}:length_bonus", RunContext(config=cfg, output_dir=tmp_path))
        assert reward(completions=["a", "b"], completion_ids=[[1] * 4, [1] * 8]) == [1.0, 0.0]  # target 4, not 64
    typo = write_config(tmp_path, f"reward_funcs = [{QUALIFIED}]", f"[plugins.{QUALIFIED}]\ntarget_token = 4\n")
    result = grpo("config", "check", str(typo), pythonpath=example_site)
    assert (
        result.returncode == 2 and f"plugins.{QUALIFIED}.target_token: Extra inputs are not permitted" in result.stderr
    )
    both = write_config(
        tmp_path,
        f"reward_funcs = [{QUALIFIED}]",
        f"[plugins.{QUALIFIED}]\ntarget_tokens = 4\n[plugins.length_bonus]\ntarget_tokens = 8\n",
    )
    result = grpo("config", "check", str(both), pythonpath=example_site)
    assert (
        result.returncode == 2
        and "both configure 'length_bonus'" in result.stderr
        and "keep one table" in result.stderr
    )
    other = write_config(tmp_path, 'reward_funcs = ["length_bonus"]', '[plugins."someone-else:length_bonus"]\nx = 1\n')
    result = grpo("config", "check", str(other), pythonpath=example_site)
    assert (
        result.returncode == 0
        and (
            "[plugins.\"someone-else:length_bonus\"] configures 'someone-else:length_bonus', "
            "which this run does not use"
        )
        in result.stderr
    )


def test_a_settings_rule_over_the_whole_table_names_the_table() -> None:
    from pydantic import BaseModel, model_validator

    from grpo_core.host.plugin_host import validate_settings

    class Settings(BaseModel):
        low: int = 0
        high: int = 1

        @model_validator(mode="after")
        def _ordered(self) -> Settings:
            if self.low > self.high:
                raise ValueError("low must not exceed high")
            return self

    class Impl:
        pass

    Impl.Settings = Settings  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        validate_settings(Impl, "bounded", {"low": 5})
    assert str(info.value) == "[plugins.bounded]: Value error, low must not exceed high"
    with pytest.raises(ConfigError, match=r'^\[plugins."some-dist:bounded"\]: Value error'):
        validate_settings(Impl, "some-dist:bounded", {"low": 5})


def test_settings_for_an_unused_implementation_are_named(example_site: Path, tmp_path: Path) -> None:
    path = write_config(tmp_path, 'reward_funcs = ["last_number_match"]', "[plugins.length_bonus]\ntarget_tokens = 8\n")
    result = grpo("config", "check", str(path), pythonpath=example_site)
    assert (
        result.returncode == 0
        and "[plugins.length_bonus] configures 'length_bonus', which this run does not use" in result.stderr
    )


# ---------------------------------------------------------------- config check loads what it reports


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"plugins": {"advantage_aggregation": "wrong_arg"}}, "rewardz"),
        ({"plugins": {"advantage_aggregation": "missing_module"}}, "ModuleNotFoundError"),
        (
            {"plugins": {"weight_sync": "full_filesystem"}},
            "weight sync 'full_filesystem' (plugins.weight_sync) needs ['weights_from_path'] from the rollout's "
            "inference engine, but rollout 'transformers'",
        ),
        (
            {"trl": {"use_vllm": True}, "plugins": {"weight_sync": "in_process"}},
            "needs ['samples_trainer_model'] from the rollout's inference engine, but rollout 'vllm'",
        ),
        (
            {"trl": {"use_vllm": True}, "plugins": {"weight_sync": "nccl"}},
            "weight sync 'nccl' broadcasts the weights from a CUDA GPU over NCCL, and this trainer has no CUDA device",
        ),
        # the ways a plugin author gets the contract wrong (docs/plugins.md, "What grpo config check refuses")
        (
            {"plugins": {"advantage_aggregation": "settings_but_context_only"}},
            "declares Settings, so grpo builds it as SettingsButContextOnly(context, settings), but its constructor "
            "takes (context): add the settings parameter",
        ),
        (
            {"plugins": {"advantage_aggregation": "instance_validate"}},
            "has grpo_validate_config as an instance method, which grpo never calls (it checks a config on the class, "
            "before building it): make it a @staticmethod",
        ),
        (
            {"plugins": {"weight_sync": "wrong_declarations"}},
            "declares required_capabilities = {'weights_from_path'}: it must be a frozenset of str, e.g. "
            "frozenset({...}); declares sends = 'weights': it must be one of 'merged_weights', 'adapter', 'nothing'",
        ),
        (
            {"plugins": {"replay": "half_state"}},
            "defines state_dict() but not load_state_dict(), so its state is never checkpointed: define both",
        ),
        (
            {"plugins": {"advantage_aggregation": "old_paths"}},
            "No module named 'grpo_core.types'. A plugin imports grpo only through grpo_core.plugin_api",
        ),
    ],
)
def test_config_check_imports_and_checks_each_chosen_implementation(
    broken_site: Path, changes: dict[str, Any], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: False
    )  # faked: the nccl case is about a machine without CUDA
    data = {
        "base_model": "org/m",
        "datasets": [{"path": "org/d"}],
        "micro_batch_size": 4,
        "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"], **changes.get("trl", {})},
        "plugins": changes.get("plugins", {}),
    }
    with on_path(broken_site, "grpo_broken_example"):
        with pytest.raises(ConfigError) as info:
            check_run_config(validate(data))
    assert fragment in str(info.value)


def test_grpo_config_check_names_each_contract_mistake_and_its_fix(tmp_path: Path) -> None:
    """The command a plugin author runs: every mistake of the chosen
    implementations in one report, each with its fix, and no traceback."""
    config = tmp_path / "config.toml"
    config.write_text(
        'base_model = "org/m"\nmicro_batch_size = 4\n[[datasets]]\npath = "org/d"\n'
        '[trl]\nnum_generations = 4\nreward_funcs = ["last_number_match"]\n'
        '[plugins]\nadvantage_aggregation = "settings_but_context_only"\nweight_sync = "wrong_declarations"\n'
        'replay = "half_state"\n',
        encoding="utf-8",
    )
    site = tmp_path / "site"  # the mistakes alone, as their own distribution (no broken always-on plugin beside them)
    (site / "grpo_contract_mistakes").mkdir(parents=True)
    (site / "grpo_contract_mistakes" / "__init__.py").write_text(textwrap.dedent(BROKEN_MODULE), encoding="utf-8")
    (site / "grpo_contract_mistakes-0.1.dist-info").mkdir()
    (site / "grpo_contract_mistakes-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: grpo-contract-mistakes\nVersion: 0.1\n", encoding="utf-8"
    )
    (site / "grpo_contract_mistakes-0.1.dist-info" / "entry_points.txt").write_text(
        "[grpo.advantage_aggregation]\nsettings_but_context_only = grpo_contract_mistakes:SettingsButContextOnly\n"
        "[grpo.weight_sync]\nwrong_declarations = grpo_contract_mistakes:WrongDeclarations\n"
        "[grpo.replay]\nhalf_state = grpo_contract_mistakes:HalfState\n",
        encoding="utf-8",
    )
    result = grpo("config", "check", str(config), pythonpath=site)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    for fix in ("add the settings parameter", "it must be one of 'merged_weights'", "define both"):
        assert fix in result.stderr, result.stderr


# ---------------------------------------------------------------- the allowlist holds everywhere


def test_allowlist_in_a_config_keeps_other_distributions_unimported(twin_site: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    env = {"GRPO_TWIN_MARKER": str(marker)}
    open_cfg = write_config(tmp_path, 'reward_funcs = ["last_number_match"]')
    sanity = grpo("config", "check", str(open_cfg), pythonpath=twin_site, env=env)
    assert sanity.returncode == 0 and marker.exists()  # without an allowlist its always-on plugin loads
    marker.unlink()

    closed = tmp_path / "closed.toml"
    closed.write_text(
        open_cfg.read_text(encoding="utf-8") + '[plugins]\nallow = ["grpo-plugin-example"]\n', encoding="utf-8"
    )
    for args in (
        ("config", "check", str(closed)),
        ("run", str(closed)),
        ("config", "check", str(open_cfg), "--set", 'plugins.allow=["x"]'),
    ):
        result = grpo(*args, pythonpath=twin_site, env=env)
        assert not marker.exists(), (args, result.stderr)
        no_traceback(result)
    assert "twin-hello" not in grpo("run", str(closed), "--help", pythonpath=twin_site, env=env).stdout


# ---------------------------------------------------------------- a hook that raises


def test_a_raising_hook_is_one_error_naming_hook_implementation_and_distribution(
    broken_site: Path, tmp_path: Path
) -> None:
    with on_path(broken_site, "grpo_broken_example"):
        host = PluginHost()
        host.error_log = tmp_path / "grpo-error.log"
        host.load_implementation("advantage_aggregation", "sum_then_normalize", context(tmp_path))
        with pytest.raises(PluginError) as info:
            host.hook.grpo_aggregate_advantages(
                rewards="not a tensor",
                weights=torch.ones(1),
                group_size=2,
                scale_rewards="group",
                completions=[],
                reward_names=["r"],
            )
    message = str(info.value)
    assert "hook grpo_aggregate_advantages of advantage_aggregation implementation 'sum_then_normalize'" in message
    assert "distribution 'grpo'" in message and str(host.error_log) in message
    assert "Traceback" in host.error_log.read_text(encoding="utf-8")


# ---------------------------------------------------------------- core independence

FORBIDDEN = {"grpo_plugins", "plugins", "vllm", "deepspeed", "liger_kernel", "liger", "grpo_plugin_example"}


def _imported_modules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in {
            "import_module",
            "__import__",
            "find_spec",
        }:
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append(node.args[0].value)
    return found


def test_core_never_imports_plugins_or_engines() -> None:
    sources = sorted((REPO / "grpo_core").rglob("*.py"))
    assert len(sources) >= 10
    offenders = []
    for path in sources:
        for module in _imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if module.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.relative_to(REPO)}: {module}")
    assert offenders == []


def test_the_import_scan_catches_each_form() -> None:
    code = "import vllm\nfrom grpo_plugins.vllm import x\nimportlib.import_module('deepspeed')\n"
    assert {m.split(".")[0] for m in _imported_modules(ast.parse(code))} == {"vllm", "grpo_plugins", "deepspeed"}


# ---------------------------------------------------------------- the contract's own example


def test_the_wrapper_example_in_the_plugin_docs_runs_as_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``wrapper=True`` example of docs/plugins.md, published as a real
    always-on plugin, wraps the chosen weight sync."""
    doc = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    start = doc.index("```python\n", doc.index("timed by a wrapper")) + len("```python\n")
    code = doc[start : doc.index("```", start)]
    site = tmp_path / "site"
    (site / "grpo_sync_timer").mkdir(parents=True)
    (site / "grpo_sync_timer" / "__init__.py").write_text("", encoding="utf-8")
    (site / "grpo_sync_timer" / "timing.py").write_text(code, encoding="utf-8")
    info = site / "grpo_sync_timer-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-sync-timer\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[grpo.plugins]\nsync_timer = grpo_sync_timer.timing:SyncTimer\n", encoding="utf-8"
    )
    with on_path(site, "grpo_sync_timer"), only_plugins_from(site):
        host = PluginHost()
        assert host.load_always_on(strict=True) == []
        host.load_implementation("weight_sync", "in_process", context(tmp_path))
        result = host.hook.grpo_sync_weights(model=None, version=3, engine=None)
        assert result.version == 3 and result.detail == "in-process"  # the chosen sync's own result, passed through
        timer = next(p for p in host.pm.get_plugins() if type(p).__name__ == "SyncTimer")
        assert len(timer.seconds) == 1
    assert "weights v3 synced in" in capsys.readouterr().out


# ---------------------------------------------------------------- the example's weight sync


class PathLoadingEngine:
    """Stands in for an inference engine's ``load_weights_from_path`` (no
    vLLM here, to keep the test fast): a fresh transformers model loads the
    HF-named safetensors, as an engine reloads them. Only this method of the
    engine protocol is used by the sync."""

    def __init__(self, config: Any) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config).eval()
        self.loads: list[Path] = []
        self.missing: set[str] = set()

    def load_weights_from_path(self, path: Path) -> None:
        from safetensors.torch import load_file

        result = self.model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        assert not result.unexpected_keys, result.unexpected_keys  # every name the sync wrote is an HF name
        self.missing = set(result.missing_keys)
        self.loads.append(path)


def test_example_weight_sync_sends_hf_named_merged_weights(example_site: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(
        random_llama(vocab_size=96, tie_word_embeddings=True),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )  # a non-zero delta
    ids = torch.randint(0, 96, (2, 7))
    with on_path(example_site, "grpo_plugin_example"):
        host = PluginHost()
        sync = host.load_implementation("weight_sync", "safetensors_dir", context(tmp_path))
        engine = PathLoadingEngine(policy.get_base_model().config)
        result = host.hook.grpo_sync_weights(model=policy, version=1, engine=engine)
        assert result.version == 1 and result.detail.endswith("v000001/model.safetensors")
        assert engine.missing == {"lm_head.weight"}  # tied: written once, as the embedding
        with torch.no_grad():
            assert torch.allclose(
                engine.model(ids).logits, policy(ids).logits, atol=1e-5
            )  # the engine samples the policy
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.add_(0.5)  # a training step
        first = engine.loads[0]
        host.hook.grpo_sync_weights(model=policy, version=2, engine=engine)
        with torch.no_grad():
            assert torch.allclose(engine.model(ids).logits, policy(ids).logits, atol=1e-5)
        assert (
            not first.exists() and engine.loads[1].name == "v000002"
        )  # the old version goes once the new one is loaded
        root = sync.root
        host.hook.grpo_train_end(context=context(tmp_path), status="completed")  # lifecycle hooks reach it
        assert root is not None and not root.exists()
        with pytest.raises(ConfigError, match="the rollout has none"):
            host.hook.grpo_sync_weights(model=policy, version=3, engine=None)


def test_example_weight_sync_needs_an_engine_that_loads_from_a_path(example_site: Path) -> None:
    def cfg(**trl: Any) -> Any:
        return validate(
            {
                "base_model": "org/m",
                "datasets": [{"path": "org/d"}],
                "micro_batch_size": 4,
                "plugins": {"weight_sync": "safetensors_dir"},
                "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"], **trl},
            }
        )

    with on_path(example_site, "grpo_plugin_example"):
        check_run_config(cfg(use_vllm=True), PluginHost())  # the vllm rollout's engine declares weights_from_path
        with pytest.raises(ConfigError, match="weight sync 'safetensors_dir' .* needs \\['weights_from_path'\\]"):
            check_run_config(cfg(), PluginHost())  # the transformers rollout has no engine

"""The real ``grpo`` console script, run in subprocesses.

Each test runs the installed entry point exactly as a user would and checks
exit codes, stdout and stderr (never a traceback for a user error).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from helpers import GRPO, HUB_OFFLINE, REPO, grpo, no_traceback

from grpo_core.contract.extension_points import EXTENSION_POINTS

POINTS = [point.name for point in EXTENSION_POINTS]

QUICKSTART = REPO / "examples" / "quickstart"


def test_console_script_is_installed() -> None:
    assert Path(GRPO).is_file(), "the `grpo` console script is missing: pip install -e ."


def test_help_lists_every_command() -> None:
    result = grpo("--help")
    assert result.returncode == 0, result.stderr
    for command in ("run", "plugins", "config"):
        assert command in result.stdout
    config_help = grpo("config", "--help")
    assert config_help.returncode == 0
    for command in ("check", "schema", "convert"):
        assert command in config_help.stdout
    run_help = grpo("run", "--help")
    assert run_help.returncode == 0 and "--set" in run_help.stdout and "KEY=VALUE" in run_help.stdout


def test_version() -> None:
    from grpo_core import __version__

    result = grpo("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"grpo {__version__}"


@pytest.mark.parametrize("name", ["config.yaml", "config.toml"])
def test_config_check_quickstart_ok(name: str) -> None:
    # the guide's dataset is a hub id (openai/gsm8k): checked as where the hub is reachable, it is fetched at run time
    result = grpo("config", "check", name, cwd=QUICKSTART, unset=HUB_OFFLINE)
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    assert f"{name}: OK with" in result.stdout
    assert "datasets[0].path = 'openai/gsm8k' is not a local file or folder nor in the hub cache" in result.stderr
    offline = grpo("config", "check", name, cwd=QUICKSTART, env={"HF_HUB_OFFLINE": "1"}, unset=HUB_OFFLINE)
    assert offline.returncode == 2 and "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE forbid fetching it" in offline.stderr
    assert "rewards.accuracy_reward x1" in result.stdout and "rollout=vllm" in result.stdout
    assert "weight_sync=lora_filesystem" in result.stdout


def test_config_check_full_prints_effective_toml() -> None:
    result = grpo(
        "config", "check", "config.toml", "--full", "--set", "trl.beta=0.04", cwd=QUICKSTART, unset=HUB_OFFLINE
    )
    assert result.returncode == 0, result.stderr
    effective = tomllib.loads(result.stdout.rsplit("\n", 2)[0])
    assert effective["trl"]["beta"] == 0.04 and effective["trl"]["loss_type"] == "dapo"
    assert effective["trl"]["epsilon_high"] == 0.2  # a filled default


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--set", "trl.num_generatons=4"], ["'trl.num_generatons'", "'trl.num_generations'"]),
        (["--set", "trl.num_generations=3"], ["not divisible by trl.num_generations = 3"]),
        (
            ["--set", "torch_compile=true", "--set", "torch_compile_backend=nope"],
            ["torch_compile_backend = 'nope' is not a torch.compile backend"],
        ),
        (["--set", "plugins.rollout=warp_drive"], ["'warp_drive'", "grpo.rollout", "transformers"]),
        (["--set", "trl.num_generations"], ["--set expects KEY=VALUE"]),
    ],
)
def test_config_check_broken_exits_2_with_message(args: list[str], fragments: list[str]) -> None:
    result = grpo("config", "check", "config.yaml", *args, cwd=QUICKSTART)
    no_traceback(result)
    assert result.returncode == 2
    assert result.stderr.count("error:") == 1
    for fragment in fragments:
        assert fragment in result.stderr


def test_config_check_malformed_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("base_model = \n", encoding="utf-8")
    result = grpo("config", "check", str(bad))
    no_traceback(result)
    assert result.returncode == 2 and "is not valid TOML" in result.stderr
    result = grpo("config", "check", str(tmp_path / "absent.toml"))
    assert result.returncode == 2 and "config file not found" in result.stderr
    no_traceback(result)


def test_run_rejects_a_bad_config_before_training(tmp_path: Path) -> None:
    result = grpo("run", "config.yaml", "--set", "trl.reward_weights=[1.0]", cwd=QUICKSTART)
    no_traceback(result)
    assert result.returncode == 2 and "1 weight(s)" in result.stderr and "2 function(s)" in result.stderr


def test_usage_errors_exit_2_without_traceback() -> None:
    result = grpo("config", "check")
    no_traceback(result)
    assert result.returncode == 2 and "Missing argument" in result.stdout + result.stderr
    result = grpo("no-such-command")
    assert result.returncode == 2
    no_traceback(result)


def test_config_schema_is_json_schema() -> None:
    result = grpo("config", "schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert schema["title"] == "GRPOConfig"
    assert "num_generations" in schema["$defs"]["TrlSettings"]["properties"]


def test_config_convert_yaml_to_toml(tmp_path: Path) -> None:
    import yaml

    result = grpo("config", "convert", "config.yaml", cwd=QUICKSTART)
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout) == yaml.safe_load((QUICKSTART / "config.yaml").read_text())
    out = tmp_path / "out.toml"
    result = grpo("config", "convert", str(QUICKSTART / "config.yaml"), "-o", str(out))
    assert result.returncode == 0 and f"wrote {out}" in result.stderr
    converted = grpo("config", "check", str(out), cwd=QUICKSTART, unset=HUB_OFFLINE)
    assert converted.returncode == 0, converted.stderr
    refused = grpo("config", "convert", "config.toml", cwd=QUICKSTART)
    assert refused.returncode == 2 and "expected a .yaml" in refused.stderr


def test_config_convert_warns_about_an_invalid_yaml(tmp_path: Path) -> None:
    src = tmp_path / "c.yaml"
    src.write_text("base_model: m\ntrl:\n  num_generatons: 4\n", encoding="utf-8")
    result = grpo("config", "convert", str(src))
    assert result.returncode == 0
    assert "num_generatons = 4" in result.stdout and "did you mean 'trl.num_generations'" in result.stderr


def test_plugins_json_lists_every_point_and_the_builtins() -> None:
    result = grpo("plugins", "--json")
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert set(listing) == {*POINTS, "reward", "plugins", "tracker", "settings"}
    assert (
        len(POINTS) == 7
    )  # rollout, environment, weight_sync, advantage_aggregation, is_correction, policy_loss, replay
    from importlib.metadata import distribution

    published = {
        (ep.group, ep.name, ep.value) for ep in distribution("grpo").entry_points if ep.group.startswith("grpo.")
    }
    listed = {
        (entry["group"], impl["name"], impl["target"])
        for entry in listing.values()
        for impl in entry["implementations"]
        if impl["distribution"] == "grpo"
    }
    assert published == listed
    for point in (*POINTS, "reward"):
        assert any(i["distribution"] == "grpo" for i in listing[point]["implementations"]), point


def test_plugins_table_output() -> None:
    result = grpo("plugins")
    assert result.returncode == 0, result.stderr
    for point in (*POINTS, "reward"):
        assert f"{point} (grpo.{point})" in result.stdout
    assert "sum_then_normalize" in result.stdout


def test_run_time_warnings_from_every_core_folder_read_as_grpo_warnings() -> None:
    """A warning raised anywhere under grpo_core/ (the reward scorer in
    scoring/, the data loader in training/) prints as ``warning: ...``; a
    library's keeps Python's format. The check must follow the package, not
    the folder cli.py happens to sit in (it broke when cli.py moved)."""
    import grpo_core
    from grpo_core.interface.cli import _format_warning

    core = Path(grpo_core.__file__).resolve().parent
    for inside in (core / "scoring" / "rewards.py", core / "training" / "run.py", core / "interface" / "cli.py"):
        assert _format_warning("scored None", UserWarning, str(inside), 1) == "warning: scored None\n"
    library = _format_warning("deprecated", FutureWarning, str(Path(pytest.__file__)), 3)
    assert library.startswith(str(Path(pytest.__file__))) and "FutureWarning: deprecated" in library

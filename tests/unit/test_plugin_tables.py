"""Top-level config tables a plugin owns (grpo_core/config/plugin_tables.py).

``[vllm]`` is the vLLM plugin's table, declared through the ``grpo.settings``
entry point group; a third-party package (installed for real into a folder,
tests/plugin_set.py) claims its own table the same way, with no change to
grpo's core.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_set import only_plugins_from, write_distribution

from grpo_core.config.loader import validate
from grpo_core.config.schema import GRPOConfig, config_model
from grpo_core.contract.errors import ConfigError
from grpo_plugins.vllm.settings import VllmSettings, vllm_settings

BASE: dict[str, Any] = {"base_model": "org/m"}

ENGINE_MODULE = '''
from pydantic import BaseModel, Field, ValidationInfo, model_validator


class EngineSettings(BaseModel):
    """A test engine's server: where it listens and how much it serves at once."""

    endpoint: str = Field("local", description="Where the engine listens.")
    slots: int = Field(1, ge=1, description="Requests served at once. Default: micro_batch_size.")

    @model_validator(mode="after")
    def _slots_follow_the_batch(self, info: ValidationInfo):
        config = (info.context or {}).get("config")
        if config is not None and "slots" not in self.model_fields_set:
            self.slots = config.micro_batch_size
        return self
'''
ENGINE_DIST = "grpo-table-engine"


def problems(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(data)
    return str(info.value)


# ------------------------------------------------------------------ [vllm]


def test_the_vllm_table_is_the_vllm_plugins_not_the_cores() -> None:
    assert "vllm" not in GRPOConfig.model_fields
    assert config_model().model_fields["vllm"].annotation is VllmSettings
    cfg = validate({**BASE, "vllm": {"port": 9001}})
    assert isinstance(cfg.table("vllm"), VllmSettings) and vllm_settings(cfg) is cfg.vllm
    assert (cfg.vllm.port, cfg.vllm.host, cfg.vllm.gpu_memory_utilization) == (9001, "127.0.0.1", 0.85)
    assert validate(BASE).vllm == VllmSettings()  # absent: its defaults


def test_a_vllm_default_may_depend_on_the_core_config() -> None:
    colocate = validate({**BASE, "trl": {"use_vllm": True, "vllm_mode": "colocate"}})
    assert colocate.vllm.gpu_memory_utilization == 0.3
    assert "gpu_memory_utilization" not in colocate.vllm.model_fields_set
    dumped = colocate.model_dump(mode="json", exclude_unset=True)
    assert validate(dumped).vllm.gpu_memory_utilization == 0.3  # derived again, never written


def test_vllm_table_problems_name_the_key_and_the_fix() -> None:
    text = problems({**BASE, "vllm": {"prot": 1, "gpu_memory_utilization": 2}, "vlm": {}, "port": 3})
    assert "4 problem(s)" in text
    assert "unknown key 'vllm.prot': did you mean 'vllm.port'?" in text
    assert "'vllm.gpu_memory_utilization': Input should be less than or equal to 1 (got 2)" in text
    assert "unknown key 'vlm': did you mean 'vllm'?" in text
    assert "unknown key 'port': it belongs in [vllm]: write 'vllm.port'." in text
    assert "'vllm': Input should be a table (got 3)" in problems({**BASE, "vllm": 3})


def test_the_schema_and_a_converted_axolotl_config_keep_vllm(tmp_path: Path, capsys) -> None:
    from grpo_core.interface.cli import main

    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "gpu_memory_utilization" in schema["$defs"]["VllmSettings"]["properties"]
    yaml_config = tmp_path / "axolotl.yaml"
    yaml_config.write_text("base_model: org/m\nvllm:\n  port: 8123\n  gpu_memory_utilization: null\n")
    assert main(["config", "convert", str(yaml_config)]) == 0
    assert "[vllm]\nport = 8123" in capsys.readouterr().out


# ------------------------------------------------------------------ a third-party table


@pytest.fixture
def engine_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package claiming [my_engine], installed into a folder of its own."""
    site = write_distribution(
        tmp_path / "site",
        "grpo_table_engine",
        ENGINE_MODULE,
        ENGINE_DIST,
        "[grpo.settings]\nmy_engine = grpo_table_engine:EngineSettings\n",
    )
    monkeypatch.syspath_prepend(str(site))
    with only_plugins_from(site):
        yield site


def test_a_third_party_table_is_validated_and_defaulted(engine_site: Path) -> None:
    cfg = validate({**BASE, "micro_batch_size": 3, "my_engine": {"endpoint": "http://h:1"}})
    engine = cfg.table("my_engine")
    assert (engine.endpoint, engine.slots) == ("http://h:1", 3)  # slots from the core config's context
    assert validate(BASE).table("my_engine").endpoint == "local"
    assert cfg.table("vllm").port == 8000  # grpo's own plugin table still there


def test_a_third_party_table_refuses_with_the_key_named(engine_site: Path) -> None:
    # its model keeps pydantic's default (an unknown key ignored): refused all the same
    text = problems({**BASE, "my_engine": {"slot": 2, "slots": 0}})
    assert "unknown key 'my_engine.slot': did you mean 'my_engine.slots'?" in text
    assert "'my_engine.slots': Input should be greater than or equal to 1 (got 0)" in text
    assert "unknown key 'my_engin': did you mean 'my_engine'?" in problems({**BASE, "my_engin": {}})


def test_a_third_party_table_is_described_with_grpos(engine_site: Path) -> None:
    import importlib.util

    from helpers import REPO

    assert "my_engine" in config_model().model_json_schema()["properties"]
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)  # type: ignore[union-attr]
    page = reference.render()
    assert "## `[my_engine]`: a test engine's server" in page and "| `my_engine.slots` | `int` | `1` |" in page


def test_the_allowlist_refuses_a_table_of_a_distribution_it_leaves_out(engine_site: Path) -> None:
    text = problems({**BASE, "plugins": {"allow": ["someone-else"]}, "my_engine": {}})
    assert f"[my_engine] is the table of distribution '{ENGINE_DIST}', which the plugin allowlist leaves out" in text
    cfg = validate({**BASE, "plugins": {"allow": ["someone-else"]}})
    with pytest.raises(ConfigError, match=r"no plugin claims a \[my_engine\] table"):
        cfg.table("my_engine")


# ------------------------------------------------------------------ claims that cannot be used


def _install(tmp_path: Path, module: str, source: str, dist: str, claim: str) -> Path:
    return write_distribution(tmp_path / dist, module, source, dist, f"[grpo.settings]\n{claim}\n")


def test_unusable_claims_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sites = [
        _install(
            tmp_path, "grpo_t_broken", "raise ImportError('no engine here')\n", "t-broken", "bad = grpo_t_broken:S"
        ),
        _install(tmp_path, "grpo_t_core", ENGINE_MODULE, "t-core", "trl = grpo_t_core:EngineSettings"),
        _install(tmp_path, "grpo_t_one", ENGINE_MODULE, "t-one", "twice = grpo_t_one:EngineSettings"),
        _install(tmp_path, "grpo_t_two", ENGINE_MODULE, "t-two", "twice = grpo_t_two:EngineSettings"),
    ]
    for site in sites:
        monkeypatch.syspath_prepend(str(site))
    with only_plugins_from(*sites):
        with pytest.warns(UserWarning) as caught:
            cfg = validate(BASE)  # none written: each is a warning, the config still loads
        said = " ".join(str(w.message) for w in caught)
        assert "grpo ignores [trl]" in said and "one of grpo's own keys" in said and "grpo ignores [bad]" in said
        assert cfg.trl.num_generations == 8  # grpo's own [trl]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per process, not at every validation
            validate(BASE)
        text = problems({**BASE, "bad": {}, "twice": {}})
        assert "entry point 'bad' in group 'grpo.settings' of distribution 't-broken' failed to load" in text
        assert "ImportError: no engine here" in text
        assert "[twice] is claimed by 't-one' (grpo_t_one:EngineSettings) and 't-two'" in text

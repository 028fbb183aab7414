"""Nothing a model ships as code runs unless the config says so.

A model directory whose config maps its classes to its own Python files
(``auto_map``, as hub repositories with custom architectures do) is built
here; each file writes a marker when imported. transformers is real: with
``trust_remote_code`` off (the default) grpo refuses the base model, its
tokenizer and a reward model with a message naming the option, and no
marker appears; with it on, the code runs (the control).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import ConfigError, GrpoError

FILES = ("configuration", "modeling", "tokenization")


def shipped_code_model(root: Path) -> tuple[Path, Path]:
    model = root / "custom-model"
    model.mkdir()
    markers = root / "markers"
    markers.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "custom_remote",
                "architectures": ["CustomForSequenceClassification"],
                "auto_map": {
                    "AutoConfig": "configuration_custom.CustomConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomModel",
                    "AutoModelForSequenceClassification": "modeling_custom.CustomModel",
                },
            }
        )
    )
    (model / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}})
    )
    for name in FILES:
        (model / f"{name}_custom.py").write_text(f"open({str(markers / name)!r}, 'w').write('ran')\n")
    return model, markers


def config(model: Path, tmp_path: Path, **extra: object):
    return validate({"base_model": str(model), "output_dir": str(tmp_path / "out"), **extra})


def test_base_model_and_tokenizer_with_their_own_code_are_refused(tmp_path: Path) -> None:
    from grpo_core.modeling.models import _load_causal_lm, load_tokenizer

    model, markers = shipped_code_model(tmp_path)
    cfg = config(model, tmp_path)
    assert cfg.trust_remote_code is False
    with pytest.raises(ConfigError, match=r"base_model: .* ships its own Python code .*`trust_remote_code = true`"):
        load_tokenizer(cfg, str(model))
    with pytest.raises(ConfigError, match=r"base_model: .*trust_remote_code = true"):
        _load_causal_lm(cfg, str(model))
    assert not list(markers.iterdir())

    trusted = config(model, tmp_path, trust_remote_code=True)
    with pytest.raises(Exception):  # noqa: B017 - the shipped code is only a marker, not a model
        _load_causal_lm(trusted, str(model))
    assert (markers / "configuration").read_text() == "ran"  # the control: trusting it does run it


def test_a_reward_model_with_its_own_code_is_refused(tmp_path: Path) -> None:
    from grpo_plugins.rewards.loaders import reward_model_from_dir

    model, markers = shipped_code_model(tmp_path)
    cfg = config(model, tmp_path)
    function = reward_model_from_dir("custom-rm", model, RunContext(config=cfg, output_dir=tmp_path / "out"))
    with pytest.raises(GrpoError, match=r"reward model 'custom-model' .*`trust_remote_code = true`"):
        function._load()
    assert not list(markers.iterdir())


def test_trust_remote_code_reaches_vllm_and_the_config_summary(tmp_path: Path, smollm2_dir: str) -> None:
    from grpo_core.interface.cli import summary
    from grpo_plugins.vllm.command_line import server_spec

    cfg = validate({"base_model": smollm2_dir, "output_dir": str(tmp_path / "out"), "trl": {"use_vllm": True}})
    assert "--trust-remote-code" not in server_spec(cfg, port=8123).argv
    assert "trust:" not in summary(cfg)
    cfg.trust_remote_code = True
    assert "--trust-remote-code" in server_spec(cfg, port=8123).argv
    assert "trust:        trust_remote_code = true" in summary(cfg)

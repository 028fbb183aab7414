"""Axolotl's own GRPO/GDPO configs through the real ``grpo`` command: ``grpo
config check`` passes them unchanged (or refuses the guide's fragment as TRL
does), and ``grpo config convert`` keeps or explains every key. The key-by-key
answers, in process, are tests/unit/test_axolotl_compat.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import HUB_OFFLINE, TESTS, grpo, no_traceback

from grpo_core.config.loader import read_raw

DATA = TESTS / "data" / "axolotl"


# ------------------------------------------------------------ Axolotl's own configs

CONFIGS = sorted(DATA.glob("*/*.yaml"))
PASSING = [p for p in CONFIGS if p.parent.name != "rlhf-gdpo"]


@pytest.mark.parametrize("path", PASSING, ids=lambda p: p.parent.name)
def test_axolotl_configs_pass_config_check_unchanged(path: Path, tmp_path: Path) -> None:
    result = grpo("config", "check", str(path), cwd=tmp_path, unset=HUB_OFFLINE)
    assert result.returncode == 0, result.stderr
    no_traceback(result)
    assert f"{path}: OK" in result.stdout


def test_rlhf_gdpo_fragment_is_refused_as_trl_refuses_it(tmp_path: Path) -> None:
    # The guide's GDPO snippet sets no batch size: 1 completion per step cannot hold a group of 4
    # (TRL's GRPOConfig raises for generation_batch_size 1 with num_generations 4 as well).
    result = grpo("config", "check", str(DATA / "rlhf-gdpo" / "config.yaml"), cwd=tmp_path, unset=HUB_OFFLINE)
    assert result.returncode == 2
    assert (
        "not divisible by trl.num_generations = 4" in result.stderr
        and "gradient_accumulation_steps = 4" in result.stderr
    )
    fixed = grpo(
        "config",
        "check",
        str(DATA / "rlhf-gdpo" / "config.yaml"),
        "--set",
        "gradient_accumulation_steps=4",
        cwd=tmp_path,
        unset=HUB_OFFLINE,
    )
    assert fixed.returncode == 0, fixed.stderr
    assert "advantage_aggregation=normalize_then_sum" in fixed.stdout


def _source_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        out.append(prefix + key)
        if isinstance(value, dict) and key in {"trl", "vllm"}:
            out += _source_keys(value, f"{prefix}{key}.")
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_convert_keeps_or_explains_every_key(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "converted.toml"
    result = grpo("config", "convert", str(path), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    converted = tomllib.loads(text)
    source = read_raw(path)
    for key in _source_keys(source):
        table, _, name = key.rpartition(".")
        node = converted.get(table, {}) if table else converted
        value = source.get(table, {}).get(name) if table else source.get(name)
        kept = name in node
        explained = value is None and re.search(rf"^# null in the source.*\b{re.escape(key)}\b", text, re.M)
        assert kept or explained, f"{key} neither kept nor explained"
    if path in PASSING:  # the TOML checks as the YAML does
        checked = grpo("config", "check", str(out), cwd=path.parent, unset=HUB_OFFLINE)
        assert checked.returncode == 0, checked.stderr
    assert "# GRPO with trl.multi_objective_aggregation" in text if source.get("rl") == "gdpo" else True


def test_convert_comments_out_refused_keys_with_the_reason(tmp_path: Path) -> None:
    src = tmp_path / "axolotl.yaml"
    src.write_text(
        "base_model: some/model\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nxformers_attention: true\n"
        "flash_attn_rms_norm: false\nsample_packing: false\nmicro_batch_size: 4\nlearning_rate: 5e-5\n"
        "datasets:\n  - path: d.jsonl\n    field_messages: messages\n"
        "trl:\n  num_generations: 4\n  reward_funcs: [last_number_match]\n"
    )
    (tmp_path / "d.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')  # check: the dataset exists
    out = tmp_path / "c.toml"
    result = grpo("config", "convert", str(src), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert '# plugins = ["axolotl.integrations.liger.LigerPlugin"]  # Axolotl plugin classes: grpo plugins are' in text
    assert "# xformers_attention = true  # not supported by grpo: one of Axolotl's GPU kernel patches" in text
    assert "flash_attn_rms_norm = false  # no effect in grpo" in text
    assert "sample_packing = false  # accepted, no effect" in text
    assert '# field_messages = "messages"  # not supported by grpo' in text
    data = tomllib.loads(text)
    assert data["learning_rate"] == 5e-5  # YAML's 5e-5 is a number, as in YAML 1.2
    assert "plugins" not in data and "xformers_attention" not in data
    assert grpo("config", "check", str(out), cwd=tmp_path).returncode == 0

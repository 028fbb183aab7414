"""Broken configs and the files they name, generated: each is one
:class:`~grpo_core.contract.errors.ConfigError` naming the key or the file
with the fix, or a value the run can use; never another exception.

Readers under test, in process (what ``grpo run`` and ``grpo config check``
call before anything heavy): the config file itself (TOML and the
reference's YAML, cut short and byte-flipped), every number of the schema
given a wrong type or an out-of-range value, the DeepSpeed JSON ``deepspeed``
names, ``fsdp_config``, every installed plugin's ``[plugins.<name>]``
settings, and the tokenizer and chat-template files (the real SmolLM2 ones,
damaged). A value that passes is then used the way the run uses it before
the model loads (seeding, the step count, the batch shape, sampling, the
loss settings, the optimizer and its schedule), which must not raise either.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from grpo_core.config.loader import load_config, validate
from grpo_core.config.schema import GRPOConfig, config_model
from grpo_core.contract.errors import ConfigError, GrpoError
from grpo_core.validation.run_check import check_run_config

BASE: dict[str, Any] = {
    "base_model": "org/m",  # hub ids: the config check does not look for them offline
    "datasets": [{"path": "org/data"}],
    "micro_batch_size": 4,
    "trl": {"num_generations": 2, "reward_funcs": ["think_answer_format"]},
}
WRONG = {
    "negative": -1,
    "zero": 0,
    "huge_int": 2**63,
    "inf": math.inf,
    "minus_inf": -math.inf,
    "nan": math.nan,
    "huge_float": 1e308,
    "text": "x",
    "list": [1],
    "table": {"a": 1},
}
TABLES = ("trl", "vllm", "alerts", "episodes")


def numeric_keys() -> list[tuple[str, ...]]:
    """Every key of the schema whose type takes a number (tables walked)."""
    keys = []
    for name, field in config_model().model_fields.items():  # [vllm], the vLLM plugin's table, included
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        table = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if table is not None and name in TABLES:
            for sub, sub_field in table.model_fields.items():
                if any(c in (int, float) for c in (sub_field.annotation, *typing.get_args(sub_field.annotation))):
                    keys.append((name, sub))
        elif any(c in (int, float) for c in candidates):
            keys.append((name,))
    return keys


def with_value(key: tuple[str, ...], value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    node = raw
    for part in key[:-1]:
        node = node.setdefault(part, {})
    node[key[-1]] = value
    return raw


def use_before_the_model(cfg: GRPOConfig) -> None:
    """What a run computes from the config before any model loads."""
    from grpo_core.config.eval_schedule import eval_every
    from grpo_core.generation.producer import sampling_from_config
    from grpo_core.modeling.precision import resolve_precision
    from grpo_core.optimization.loss import LossSettings
    from grpo_core.optimization.optimizer import advance_schedule, build_optimizer, build_scheduler
    from grpo_core.training.run import prompts_per_batch, seed_everything, steps_for_epochs

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        seed_everything(cfg.seed)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
    if cfg.num_epochs is not None:
        steps_for_epochs(cfg, 10)
    prompts_per_batch(cfg)
    eval_every(cfg)
    sampling_from_config(cfg, [0])
    LossSettings.from_config(cfg)
    resolve_precision(cfg)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    advance_schedule(scheduler)


@pytest.mark.parametrize("key", numeric_keys(), ids=".".join)
def test_every_number_given_a_wrong_type_or_an_out_of_range_value(key: tuple[str, ...]) -> None:
    for label, value in WRONG.items():
        try:
            cfg = validate(with_value(key, value))
            check_run_config(cfg)
        except ConfigError as exc:
            assert key[-1] in str(exc), f"{'.'.join(key)} = {label}: the error does not name the key: {exc}"
            continue
        try:
            use_before_the_model(cfg)
        except GrpoError:
            pass
        except Exception as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"{'.'.join(key)} = {label} passed the checks, then {type(exc).__name__}: {exc}")


CONFIG_FILES = [REPO / "examples" / "arithmetic" / "config.toml", REPO / "examples" / "quickstart" / "config.yaml"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(CONFIG_FILES), offset=st.integers(0, 2**20), cut=st.booleans())
def test_a_config_file_cut_or_flipped_is_named(tmp_path_factory: pytest.TempPathFactory, which, offset, cut) -> None:
    """Cut anywhere, or one byte flipped anywhere: one ConfigError naming the
    file (and where TOML/YAML says the problem is), or a config that validates."""
    data = which.read_bytes()
    if cut:
        damaged = data[: offset % len(data)]
    else:
        buffer = bytearray(data)
        buffer[offset % len(data)] ^= 0xFF
        damaged = bytes(buffer)
    path = tmp_path_factory.mktemp("cfg") / which.name
    path.write_bytes(damaged)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc) or "config" in str(exc), str(exc)


def test_a_config_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b'base_model = "m"\n# caf\xe9\n[[datasets]]\npath = "d.jsonl"\n')
    with pytest.raises(ConfigError, match=r"c.toml is not UTF-8 text: line 2 \(byte 22\)"):
        load_config(path)


# ------------------------------------------------------------------ DeepSpeed JSON and fsdp_config

DEEPSPEED = {
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "offload_optimizer": {"device": "none"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "bf16": {"enabled": "auto"},
}


def _paths(node: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in node.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
    return out


def deepspeed_variants() -> dict[str, bytes]:
    good = json.dumps(DEEPSPEED, indent=1).encode()
    variants = {f"cut_{n}": good[:n] for n in (0, 1, len(good) // 2, len(good) - 1)}
    for n in (0, len(good) // 2, len(good) - 1):
        buffer = bytearray(good)
        buffer[n] ^= 0xFF
        variants[f"flip_{n}"] = bytes(buffer)
    for path in _paths(DEEPSPEED):
        for label, value in {**WRONG, "null": None, "true": True}.items():
            if label in ("nan", "inf", "minus_inf"):
                continue  # not JSON
            changed = copy.deepcopy(DEEPSPEED)
            node = changed
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = value
            variants[f"{'.'.join(path)}={label}"] = json.dumps(changed).encode()
    variants["not_an_object"] = b"[1, 2]"
    return variants


def test_every_broken_deepspeed_json_is_named(tmp_path: Path) -> None:
    file = tmp_path / "ds.json"
    file.write_bytes(json.dumps(DEEPSPEED).encode())
    assert check_run_config(validate({**BASE, "deepspeed": str(file)}), num_processes=2) is not None  # the control
    for name, content in deepspeed_variants().items():
        file.write_bytes(content)
        try:
            check_run_config(validate({**BASE, "deepspeed": str(file)}), num_processes=2)
        except ConfigError as exc:
            assert "deepspeed" in str(exc), f"{name}: {exc}"
        except Exception as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"DeepSpeed JSON {name}: {type(exc).__name__}: {exc}")


FSDP = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
    "fsdp_offload_params": False,
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_reshard_after_forward": True,
    "fsdp_activation_checkpointing": False,
    "fsdp_state_dict_type": "FULL_STATE_DICT",
}


def test_every_fsdp_config_value_of_the_wrong_kind_is_named() -> None:
    fsdp = {"fsdp": ["full_shard", "auto_wrap"]}
    assert check_run_config(validate({**BASE, **fsdp, "fsdp_config": FSDP}), num_processes=2) is not None
    for key in FSDP:
        for label, value in {**WRONG, "false_as_text": "false"}.items():
            if key in ("fsdp_state_dict_type",) and isinstance(value, str):
                continue  # any name: grpo always saves the full state dict
            try:
                check_run_config(validate({**BASE, **fsdp, "fsdp_config": {**FSDP, key: value}}), num_processes=2)
            except ConfigError as exc:
                assert "fsdp" in str(exc), f"{key} = {label}: {exc}"
                continue
            except Exception as exc:  # pragma: no cover
                pytest.fail(f"fsdp_config.{key} = {label}: {type(exc).__name__}: {exc}")
            assert isinstance(value, type(FSDP[key])) and not (isinstance(value, bool) ^ isinstance(FSDP[key], bool)), (
                f"fsdp_config.{key} = {value!r} was accepted"
            )


# ------------------------------------------------------------------ plugin settings


def declared_settings() -> list[tuple[str, str, type[BaseModel]]]:
    """(entry point group, name, Settings) of every installed implementation that declares settings."""
    from grpo_core.contract.extension_points import EXTENSION_POINTS, REWARD_GROUP
    from grpo_core.host.plugin_host import PluginHost

    host = PluginHost()
    found = []
    for group in [p.group for p in EXTENSION_POINTS] + [REWARD_GROUP]:
        for info in host.list_group(group):
            if info.error:
                continue
            try:
                obj = host.import_entry_point(group, info.name, "test")[1]
            except Exception:
                continue
            model = getattr(obj, "Settings", None)
            if isinstance(model, type) and issubclass(model, BaseModel):
                found.append((group, info.name, model))
    return found


def test_every_plugin_setting_given_a_wrong_value_is_named() -> None:
    from grpo_core.host.plugin_host import validate_settings

    found = declared_settings()
    assert found, "no installed implementation declares Settings"
    for _group, name, model in found:
        holder = type("Holder", (), {"Settings": model})
        for field in model.model_fields:
            for label, value in {**WRONG, "null": None}.items():
                try:
                    validate_settings(holder, name, {field: value})
                except ConfigError as exc:
                    assert f"plugins.{name}.{field}" in str(exc) or f"plugins.{name}" in str(exc), str(exc)
                except Exception as exc:  # pragma: no cover
                    pytest.fail(f"[plugins.{name}] {field} = {label}: {type(exc).__name__}: {exc}")
        with pytest.raises(ConfigError, match=f"plugins.{name}.no_such_setting"):
            validate_settings(holder, name, {"no_such_setting": 1})


class _Example(BaseModel):
    model_config = {"extra": "forbid"}
    target_tokens: int = 32
    scale: float = 1.0
    names: list[str] = []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(table=st.dictionaries(st.sampled_from(["target_tokens", "scale", "names", "other"]), _json, max_size=4))
def test_any_settings_table_validates_or_names_its_key(table: dict[str, Any]) -> None:
    from grpo_core.host.plugin_host import validate_settings

    holder = type("Holder", (), {"Settings": _Example})
    try:
        validate_settings(holder, "length_bonus", table)
    except ConfigError as exc:
        assert any(f"plugins.length_bonus.{key}" in str(exc) for key in table), str(exc)


# ------------------------------------------------------------------ tokenizer and chat template files


@pytest.fixture(scope="module")
def tokenizer_source(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(Path(smollm2_dir) / name, folder / name)
    return folder


def _load_tokenizer(folder: Path, **changes: Any) -> Any:
    from grpo_core.data.prompts import tokenize_prompt
    from grpo_core.modeling.models import load_tokenizer

    cfg = validate({**BASE, "tokenizer_config": str(folder), **changes})
    tokenizer = load_tokenizer(cfg, str(folder))
    return tokenize_prompt([{"role": "user", "content": "What is 1 + 1?"}], tokenizer)


@pytest.mark.parametrize("name", ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
def test_a_damaged_tokenizer_file_is_named(tokenizer_source: Path, tmp_path: Path, name: str) -> None:
    data = (tokenizer_source / name).read_bytes()
    variants = {"empty": b"", "8_bytes": data[:8], "half": data[: len(data) // 2]}
    for at in (0, len(data) // 2):
        buffer = bytearray(data)
        buffer[at] ^= 0xFF
        variants[f"flip_{at}"] = bytes(buffer)
    for label, content in variants.items():
        folder = shutil.copytree(tokenizer_source, tmp_path / label)
        (folder / name).write_bytes(content)
        try:
            _load_tokenizer(folder)
        except ConfigError as exc:
            message = str(exc)
            assert name in message or "chat template" in message, f"{name} {label}: {message}"
            continue
        except Exception as exc:  # pragma: no cover
            pytest.fail(f"{name} {label}: {type(exc).__name__}: {exc}")
        assert name == "chat_template.jinja" and label in ("empty", "8_bytes"), f"{name} {label} loaded"


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        (b"{% for m in messages %}{{ m['content'] }}", "not a valid Jinja template"),
        (b"{{ messages[0]['content'] \xe9 }}", "not UTF-8"),
        ("missing.jinja", "not a known template name"),
        ("{{ messages[0]['content'] ", "not a valid Jinja template"),
    ],
    ids=["syntax", "not_utf8", "missing_file", "inline_syntax"],
)
def test_a_broken_chat_template_is_named_when_the_tokenizer_loads(
    tokenizer_source: Path, tmp_path: Path, template: Any, fragment: str
) -> None:
    if isinstance(template, bytes):
        path = tmp_path / "template.jinja"
        path.write_bytes(template)
        template = str(path)
    elif template.endswith(".jinja"):
        template = str(tmp_path / template)
    with pytest.raises(ConfigError) as refused:
        _load_tokenizer(tokenizer_source, chat_template=template)
    assert fragment in str(refused.value) and "chat_template" in str(refused.value), str(refused.value)

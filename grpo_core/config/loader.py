"""Reading configs: TOML (ours) or the reference's YAML layout, with
``--set key=value`` overrides, and turning pydantic's errors into messages
that name the key path and the fix."""

from __future__ import annotations

import copy
import difflib
import glob
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_core.config.axolotl import adapt
from grpo_core.config.ranges import range_problems
from grpo_core.config.schema import EFFECTIVE_DEFAULTS, DatasetSpec, GRPOConfig, config_model
from grpo_core.config.trl_names import unknown_key_hint
from grpo_core.contract.errors import ConfigError


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``5e-5`` (no dot) is a string; YAML 1.2,
    and every config in the wild, mean a number."""


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_raw(path: str | Path) -> dict[str, Any]:
    """Parse a .toml or .yaml/.yml file into a plain dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} is not UTF-8 text: line {line} (byte {exc.start}) holds byte 0x{exc.object[exc.start]:02x}. "
            "Save the config as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config {path}: {exc.strerror or exc}.") from None
    if path.suffix in {".yaml", ".yml"}:
        try:
            data = yaml.load(text, Loader=_Yaml12Floats) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table of settings at the top level")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """``trl.num_generations=4`` -> (["trl", "num_generations"], 4).

    The value is read as a TOML value when it parses as one (numbers, bools,
    quoted strings, arrays, inline tables) and as a bare string otherwise.
    A bare ``null`` is ``None``, as in a YAML config (TOML has no null): the
    key reads as unset (``--set adapter=null`` trains full weights);
    ``'"null"'`` is the string.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got '{item}'")
    if raw.strip() == "null":
        value: Any = None
    else:
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
    # datasets[0].path and datasets.0.path both index the list
    return [part.strip() for part in re.sub(r"\[(\d+)\]", r".\1", key).split(".")], value


def _step(node: Any, key: str, item: str, last: bool) -> Any:
    """One level of an override path: a table key, or a list index."""
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise ConfigError(f"--set {item}: '{key}' is not an index of a list of {len(node)} entries")
        return int(key)
    if not isinstance(node, dict):
        raise ConfigError(f"--set {item}: '{key}' is not inside a table")
    if not last:
        node.setdefault(key, {})
    return key


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        keys, value = parse_override(item)
        node: Any = data
        for key in keys[:-1]:
            child = node[_step(node, key, item, last=False)]
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {item}: '{key}' is not a table")
            node = child
        node[_step(node, keys[-1], item, last=True)] = value
    return data


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc``'s parent."""
    model: Any = config_model()  # with the tables plugins claim
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        candidates = [annotation, *(inner or [])]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _where_else(key: str) -> str | None:
    """A key written in the wrong table: say which table has it."""
    schema = config_model()
    tables = ["trl", *(name for name in schema.model_fields if name not in GRPOConfig.model_fields), "plugins"]
    for table in tables:  # the plugins' own tables ([vllm]) between [trl] and [plugins]
        cls = schema.model_fields[table].annotation
        if key in cls.model_fields:  # type: ignore[union-attr]
            return table
    if key in GRPOConfig.model_fields:
        return "the top level"
    return None


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} problem(s) in the config:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _key_path(loc)
        if err["type"] == "extra_forbidden":
            key = str(loc[-1])
            model = _model_at(loc)
            known = list(model.model_fields) if model else []
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            tables = [part for part in loc[:-1] if not isinstance(part, int)]
            home = _where_else(key) if len(tables) <= 1 else None
            trl_hint = unknown_key_hint(tables[0] if tables else None, key) if len(tables) <= 1 else None
            if trl_hint is not None:  # TRL's name for a grpo key: its grpo name, never the nearest spelling
                hint = trl_hint
            elif home == "the top level" and tables:
                hint = (
                    f"it belongs at the top level, not in [{tables[0]}]: move '{key}' above the first [table] "
                    "header (in TOML, keys written after a header belong to that table)."
                )
            elif home and home != "the top level" and home != loc[0]:
                hint = f"it belongs in [{home}]: write '{home}.{key}'."
            elif close:
                hint = f"did you mean '{_key_path(loc[:-1] + (close[0],))}'?"
            else:
                hint = "remove it (see `grpo config schema` for every key)."
            lines.append(f"  - unknown key '{path}': {hint}")
        elif err["type"] == "missing":
            lines.append(f"  - '{path}' is required.")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # A table's own validator: its message names the keys and the fix.
            lines.append(f"  - {str(err['msg']).removeprefix('Value error, ')}")
        else:
            given = err.get("input")
            given_s = json.dumps(given, default=str) if not isinstance(given, dict) else "a table"
            lines.append(f"  - '{path}': {err['msg']} (got {given_s}).")
    return "\n".join(lines)


def apply_effective_defaults(cfg: GRPOConfig) -> GRPOConfig:
    """Replace ``None`` ("reference default") by the value that runs.

    ``trl.model_fields_set`` still says what the user wrote afterwards (the
    filled-in values are not "set"): the checks warn about an option only
    where the user set it, and a config dumped with ``exclude_unset`` derives
    these defaults again from its other values."""
    trl = cfg.trl
    written = set(trl.model_fields_set)
    if cfg.rl == "gdpo":
        if (
            "multi_objective_aggregation" in trl.model_fields_set
            and trl.multi_objective_aggregation != "normalize_then_sum"
        ):
            raise ConfigError(
                f"rl = 'gdpo' is GRPO with trl.multi_objective_aggregation = 'normalize_then_sum', but the config sets "
                f"'{trl.multi_objective_aggregation}': drop one of the two (rl = 'grpo' keeps your aggregation)."
            )
        trl.multi_objective_aggregation = "normalize_then_sum"
    for key, value in EFFECTIVE_DEFAULTS.items():
        if getattr(trl, key) is None:
            setattr(trl, key, value)
    if trl.epsilon_high is None:
        trl.epsilon_high = trl.epsilon
    if trl.vllm_importance_sampling_correction is None:
        trl.vllm_importance_sampling_correction = trl.use_vllm
    if trl.vllm_mode is None and trl.use_vllm:
        trl.vllm_mode = "server"
    if trl.max_prompt_length is None:
        trl.max_prompt_length = cfg.sequence_len
    object.__setattr__(trl, "__pydantic_fields_set__", written)  # assignment above marked the filled keys as set
    return cfg


def validate(data: dict[str, Any], source: str = "config") -> GRPOConfig:
    """Validate a raw config dict (ours, or written for Axolotl: its keys are
    adapted or refused with a reason first, see :mod:`grpo_core.config.axolotl`)."""
    data, notes = adapt(copy.deepcopy(data), source)
    try:
        cfg = GRPOConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    problems = range_problems(cfg)
    if problems:
        raise ConfigError(
            "\n".join([f"{source}: {len(problems)} problem(s) in the config:", *(f"  - {p}" for p in problems)])
        )
    cfg._notes = notes
    return apply_effective_defaults(cfg)


def anchor_to_config_dir(cfg: GRPOConfig, config_dir: Path) -> GRPOConfig:
    """Let a config find the files that sit next to it.

    A relative dataset path that does not exist from the working directory
    but does from the config's folder is taken from there, and that folder
    goes on ``sys.path`` after the working directory, so
    ``grpo run examples/arithmetic/config.toml`` finds ``rewards.py`` and
    ``data/`` beside it while a file in the working directory still wins.
    """
    config_dir = config_dir.resolve()
    for spec in [*cfg.datasets, *cfg.test_datasets]:
        candidate = config_dir / spec.path
        if not Path(spec.path).is_absolute() and not Path(spec.path).exists() and candidate.exists():
            spec.path = str(candidate)
        _anchor_data_files(spec, config_dir)
    if str(config_dir) not in sys.path:
        sys.path.append(str(config_dir))
    return cfg


def _anchor_data_files(spec: DatasetSpec, config_dir: Path) -> None:
    """``path = "json"`` (a packaged builder of ``datasets``) reads
    ``data_files`` from the working directory; like a dataset path, one that
    is not there but is beside the config is taken from there."""
    if spec.data_files is None or "/" in spec.path or Path(spec.path).exists():
        return
    # imported only for a config whose path may name a builder: `datasets` is slow to import
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    if spec.path not in _PACKAGED_DATASETS_MODULES:
        return
    files = [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files)
    anchored = [
        str(config_dir / f)
        if not Path(f).is_absolute() and "://" not in f and not glob.glob(f) and glob.glob(str(config_dir / f))
        else f
        for f in files
    ]
    spec.data_files = anchored[0] if isinstance(spec.data_files, str) else anchored


def load_config(path: str | Path, overrides: list[str] | None = None) -> GRPOConfig:
    """Read, override, validate and complete a config file."""
    data = apply_overrides(read_raw(path), overrides or [])
    return anchor_to_config_dir(validate(data, str(path)), Path(path).parent)

"""Top-level config tables that plugins own (``[vllm]`` is the vLLM plugin's).

A plugin claims a top-level table by publishing the pydantic ``Settings``
model that validates it under the entry point group ``grpo.settings``,
named as the table::

    [project.entry-points."grpo.settings"]
    vllm = "grpo_plugins.vllm.settings:VllmSettings"

The model is the kind a ``[plugins.<name>]`` table is validated with (an
unknown key is an error naming it). The config validates the table with it
(its errors listed with the core's, ``vllm.port: ...``), fills in its
defaults when the config leaves the table out, and hands it out as
``config.table("vllm")``. The model's validators receive the validated core
config as ``info.context["config"]`` (a default that depends on another
table; ``None`` when the core config itself has errors).

Claims are read from the distributions' metadata; only those of
distributions the plugin allowlist lets load are imported. A claim that
cannot be used (refused by the allowlist, made by two distributions, not
importable, not a pydantic model, or naming one of grpo's own keys) is an
error where the config writes that table, and a warning otherwise.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ValidationError

from grpo_core.config.allowlist import ALLOW_ENV, effective_allowlist, normalise
from grpo_core.contract.errors import ConfigError

TABLE_GROUP = "grpo.settings"
_warned: set[str] = set()  # the unusable claims already warned about


@dataclass(frozen=True)
class TableClaim:
    """One published claim of a top-level table."""

    name: str
    target: str
    distribution: str

    def describe(self) -> str:
        return f"entry point '{self.name}' in group '{TABLE_GROUP}' of distribution '{self.distribution}'"


@cache
def published_claims() -> dict[str, tuple[TableClaim, ...]]:
    """table -> every claim of it, from the installed distributions'
    metadata (nothing imported; a distribution found twice counts once)."""
    found: dict[str, dict[tuple[str, str], TableClaim]] = {}
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if ep.group == TABLE_GROUP:
                claim = TableClaim(ep.name, ep.value, dist_name)
                found.setdefault(ep.name, {}).setdefault((normalise(dist_name), ep.value), claim)
    return {name: tuple(claims.values()) for name, claims in found.items()}


@cache
def _load(claim: TableClaim) -> type[BaseModel] | str:
    """The claim's model, or why it is unusable."""
    try:
        model = importlib.metadata.EntryPoint(claim.name, claim.target, TABLE_GROUP).load()
    except Exception as exc:  # any import-time error of a third-party module
        return f"{claim.describe()} failed to load: {type(exc).__name__}: {exc}"
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return f"{claim.describe()} names {model!r}, which is not a pydantic model (the table's Settings model)"
    return model


def rescan() -> None:
    """Forget the claims (packages installed, or ``sys.path`` changed, in this process)."""
    published_claims.cache_clear()
    _load.cache_clear()
    _warned.clear()


@dataclass(frozen=True)
class Tables:
    """The claimed tables a config may have: ``models`` usable, ``refused``
    (a broken claim) and ``excluded`` (by the allowlist) with why not."""

    models: dict[str, type[BaseModel]]
    refused: dict[str, str]
    excluded: dict[str, str]


def claimed_tables(config_allow: Iterable[str] | None, own_keys: Collection[str]) -> Tables:
    """The tables plugins claim, under the allowlist (``GRPO_PLUGINS_ALLOW``
    narrowed by the config's ``plugins.allow``); ``own_keys`` are grpo's own
    top-level keys, which no plugin may claim."""
    allow = effective_allowlist(set(config_allow) if config_allow is not None else None)
    own = set(own_keys)
    models: dict[str, type[BaseModel]] = {}
    refused: dict[str, str] = {}
    excluded: dict[str, str] = {}
    for name, claims in sorted(published_claims().items()):
        usable = [c for c in claims if allow is None or normalise(c.distribution) in allow]
        if name in own:
            refused[name] = f"{claims[0].describe()} claims '{name}', which is one of grpo's own keys"
        elif not usable:
            excluded[name] = (
                f"[{name}] is the table of distribution '{claims[0].distribution}', which the plugin allowlist "
                f"leaves out: add it to plugins.allow (and to {ALLOW_ENV} where that is set), or remove the table"
            )
        elif len(usable) > 1:
            refused[name] = (
                f"[{name}] is claimed by "
                + " and ".join(f"'{c.distribution}' ({c.target})" for c in sorted(usable, key=lambda c: c.distribution))
                + ": uninstall one, or leave one out of plugins.allow"
            )
        else:
            loaded = _load(usable[0])
            if isinstance(loaded, str):
                refused[name] = loaded
            else:
                models[name] = loaded
    return Tables(models, refused, excluded)


def allow_in(data: dict[str, Any]) -> list[str] | None:
    """The raw config's ``plugins.allow``, when it is a list of names."""
    plugins = data.get("plugins")
    allow = plugins.get("allow") if isinstance(plugins, dict) else None
    return [str(d) for d in allow] if isinstance(allow, list) else None


def validate_tables(
    data: dict[str, Any], config: Any, own_keys: Collection[str]
) -> tuple[dict[str, BaseModel], list[dict[str, Any]]]:
    """Validate every claimed table ``data`` has, and default those it has
    not. Returns the tables and the problems as pydantic error dicts (``loc``
    starting with the table's name), for the caller to report with its own."""
    try:
        tables = claimed_tables(allow_in(data), own_keys)
    except ConfigError:  # plugins.allow outside GRPO_PLUGINS_ALLOW: the plugin host says so when it loads
        tables = claimed_tables(None, own_keys)
    values: dict[str, BaseModel] = {}
    errors: list[dict[str, Any]] = []
    for name, why in (tables.refused | tables.excluded).items():
        if name in data and name not in own_keys:
            errors.append({"type": "value_error", "loc": (name,), "msg": f"Value error, {why}.", "input": data[name]})
        elif name in tables.refused and why not in _warned:  # once: every validation would repeat it
            _warned.add(why)
            warnings.warn(f"grpo ignores [{name}]: {why}.", stacklevel=2)
    for name, model in tables.models.items():
        raw = data.get(name, {})
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            errors.append({"type": "dict_type", "loc": (name,), "msg": "Input should be a table", "input": raw})
            continue
        unknown = _unknown_keys(model, raw)
        errors += [
            {"type": "extra_forbidden", "loc": (name, key), "msg": "Extra inputs are not permitted", "input": raw[key]}
            for key in unknown
        ]
        try:
            values[name] = model.model_validate(
                {k: v for k, v in raw.items() if k not in unknown}, context={"config": config}
            )
        except ValidationError as exc:
            errors += [{**err, "loc": (name, *err["loc"])} for err in exc.errors()]
    return values, errors


def _unknown_keys(model: type[BaseModel], table: dict[str, Any]) -> list[str]:
    """Keys a model would silently drop (pydantic's default ignores an
    unknown key): a typo must not go unseen, as in ``[plugins.<name>]``."""
    if model.model_config.get("extra") not in (None, "ignore"):
        return []  # "forbid" reports them itself; "allow" wants them
    known = {key for field_name, field in model.model_fields.items() for key in (field_name, field.alias) if key}
    return sorted(str(key) for key in table if key not in known)

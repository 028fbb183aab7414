"""Finding, loading, checking and calling plugins.

One index of the installed entry points (:func:`published_entry_points`,
read from the distributions' metadata) answers every question: which names a
group offers, which distribution publishes each, whether the allowlist lets
it load. A name published by two distributions is ambiguous: it is refused
naming both, never taken first-wins, and the user qualifies it with the
distribution (``"grpo-plugin-example:rank"``). pluggy holds the loaded
objects and calls their hooks.

Everything a plugin can get wrong (it does not import, it misses a hook, a
hook has an argument the spec does not know, a hook raises at run time)
becomes a :class:`~grpo_core.contract.errors.PluginError` naming the distribution and
the entry point, raised only when that plugin is actually needed, so one
broken package never takes down unrelated commands.

Loading can be restricted to an allowlist of distributions
(``GRPO_PLUGINS_ALLOW=grpo-plugin-a,grpo-plugin-b`` or ``plugins.allow`` in
the config); grpo's own distribution is always allowed. The environment's
list is an upper bound that a config can only narrow (a config may come
from someone else; the environment is the administrator's). Nothing outside
the allowlist is imported: the index is built from metadata alone.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from grpo_core.config import plugin_tables
from grpo_core.config.allowlist import (  # re-exported: the host's callers read them here
    ALLOW_ENV,
    effective_allowlist,
    normalise,
)
from grpo_core.config.implementations import chosen_implementations, source_key
from grpo_core.contract import hookspecs
from grpo_core.contract.declarations import declaration_problems
from grpo_core.contract.errors import ConfigError, GrpoError, PluginError
from grpo_core.contract.extension_points import (
    ALWAYS_ON_GROUP,
    BY_NAME,
    GROUP_PREFIX,
    POINT_HOOKS,
    REWARD_GROUP,
    SETTINGS_ATTRIBUTE,
    ExtensionPoint,
    declared,
)
from grpo_core.runtime.failure import TRACEBACK_FILE

AMBIGUOUS = "ambiguous:"  # how an ambiguity's error starts (EntryPointInfo.status reads it)
NOT_ALLOWED = "not in the plugin allowlist"
QUALIFIER = ":"
ERROR_LOG = TRACEBACK_FILE  # one file per run collects every traceback (grpo_core.runtime.failure)


def group_for(point: str) -> str:
    """The entry point group of an extension point (``grpo.<point>``)."""
    return GROUP_PREFIX + point


@dataclass(frozen=True)
class EntryPointInfo:
    """One published implementation: where it comes from, and why it cannot
    be used if it cannot."""

    group: str
    name: str
    target: str
    distribution: str
    error: str | None = None
    summary: str = ""  # what it does: the first sentence of its docstring (``grpo plugins``), once loaded

    @property
    def qualified(self) -> str:
        return f"{self.distribution}{QUALIFIER}{self.name}"

    @property
    def status(self) -> str:
        """How ``grpo plugins`` labels it: ``OK``, ``AMBIGUOUS`` (usable once
        qualified), ``NOT ALLOWED`` (the allowlist) or ``BROKEN``."""
        if self.error is None:
            return "OK"
        if self.error.startswith(AMBIGUOUS):
            return "AMBIGUOUS"
        return "NOT ALLOWED" if self.error.startswith(NOT_ALLOWED) else "BROKEN"

    def describe(self) -> str:
        return f"entry point '{self.name}' in group '{self.group}' of distribution '{self.distribution}'"


@cache
def published_entry_points() -> dict[str, dict[str, tuple[tuple[EntryPointInfo, importlib.metadata.EntryPoint], ...]]]:
    """group -> name -> every (info, entry point) publishing that name.

    The one index of installed plugins. Built from distribution metadata, so
    nothing is imported; a distribution found twice on ``sys.path`` counts
    once."""
    index: dict[str, dict[str, dict[tuple[str, str], tuple[EntryPointInfo, importlib.metadata.EntryPoint]]]] = {}
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if not ep.group.startswith(GROUP_PREFIX):
                continue
            info = EntryPointInfo(ep.group, ep.name, ep.value, dist_name)
            index.setdefault(ep.group, {}).setdefault(ep.name, {}).setdefault(
                (normalise(dist_name), ep.value), (info, ep)
            )
    return {group: {name: tuple(found.values()) for name, found in names.items()} for group, names in index.items()}


def rescan() -> None:
    """Forget the index: needed only when packages are installed or
    ``sys.path`` changes inside a running process (tests, notebooks)."""
    importlib.invalidate_caches()
    published_entry_points.cache_clear()
    plugin_tables.rescan()


def split_qualified(spec: str) -> tuple[str | None, str]:
    """``"dist:name"`` -> ("dist", "name"); ``"name"`` -> (None, "name")."""
    dist, sep, name = spec.rpartition(QUALIFIER)
    return (dist, name) if sep and dist else (None, spec)


def _unknown_hooks(pm: pluggy.PluginManager, obj: Any) -> list[str]:
    """Hook implementations of ``obj`` that match no hook spec."""
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(obj) or []
        if caller.spec is None and any(i.plugin is obj and not i.optionalhook for i in caller.get_hookimpls())
    )


def _implemented(pm: pluggy.PluginManager, obj: Any) -> set[str]:
    """Hooks ``obj`` implements (wrappers excluded)."""
    return {
        caller.name
        for caller in pm.get_hookcallers(obj) or []
        if any(i.plugin is obj and not (i.wrapper or i.hookwrapper) for i in caller.get_hookimpls())
    }


def _role_problem(implemented: set[str], point: ExtensionPoint | None) -> str | None:
    """What is wrong with the hooks an object implements, for its role: an
    implementation of ``point``, or an always-on plugin (``None``)."""
    if point is None:
        stray = sorted(implemented & POINT_HOOKS)
        return (
            f"always-on plugin implements extension-point hooks {stray}; publish it under the group of that "
            "extension point (e.g. grpo.rollout) so the config can choose it"
            if stray
            else None
        )
    missing = sorted(set(point.hooks) - implemented)
    if missing:
        return f"does not implement {missing}, required by extension point '{point.name}'"
    foreign = sorted(implemented & (POINT_HOOKS - set(point.hooks) - set(point.optional_hooks)))
    if foreign:
        return f"implements {foreign}, which belong to other extension points than '{point.name}'"
    return None


def contract_problem(group: str, obj: Any) -> str | None:
    """Check a loaded entry point against the contract without building it.

    Classes are registered as they are in a scratch plugin manager (pluggy
    validates unbound methods the same way), so a wrong argument name, a
    misspelt hook or a missing required hook shows in ``grpo plugins`` and
    ``grpo config check`` before any run needs the plugin. A factory
    function cannot be checked until it is called; ``None`` then.
    """
    if group == REWARD_GROUP:
        return None if callable(obj) else f"not callable ({type(obj).__name__})"
    point = BY_NAME.get(group.removeprefix(GROUP_PREFIX))
    if point is None and group != ALWAYS_ON_GROUP:
        return None
    if point is not None and not isinstance(obj, type):
        return None if callable(obj) else f"not a factory: {type(obj).__name__} is not callable"
    scratch = pluggy.PluginManager(hookspecs.PROJECT)
    scratch.add_hookspecs(hookspecs)
    try:
        scratch.register(obj)
    except pluggy.PluginValidationError as exc:
        return f"does not match grpo's hook contract: {exc}"
    except ValueError as exc:
        return str(exc)
    unknown = _unknown_hooks(scratch, obj)
    if unknown:
        return f"marks {unknown} with @hookimpl, but grpo has no such hook"
    return _role_problem(_implemented(scratch, obj), point) or (
        _declaration_problem(obj, point) if point is not None else None
    )


def _declaration_problem(cls: type, point: ExtensionPoint) -> str | None:
    """What an implementation class gets wrong beyond its hooks: how it is
    built, its own config check, its declared attributes, its state. Each
    would otherwise fail late or, worse, be silently ignored."""
    problems = [f"declares {p}" for p in declaration_problems(cls, point.declares)]
    problems += filter(None, (_constructor_problem(cls), _validate_config_problem(cls), _state_problem(cls)))
    if not problems:
        return None
    return "; ".join(problems) + f" (the contract: grpo_core.plugin_api.{point.declares.__name__}, docs/plugins.md)"


def _constructor_problem(cls: type) -> str | None:
    """Whether ``cls`` can be built as grpo builds it: ``cls(context, settings)``
    when it declares ``Settings``, ``cls(context)`` otherwise."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin or C-implemented constructor: nothing to read
        return None
    settings = getattr(cls, SETTINGS_ATTRIBUTE, None) is not None
    try:
        signature.bind(*(("context", "settings") if settings else ("context",)))
    except TypeError:
        if settings:
            return (
                f"declares Settings, so grpo builds it as {cls.__name__}(context, settings), but its constructor takes "
                f"{signature}: add the settings parameter (def __init__(self, context, settings))"
            )
        return (
            f"is built as {cls.__name__}(context), but its constructor takes {signature}: take the context alone "
            "(give other parameters defaults), or declare Settings to receive the [plugins.<name>] table as well"
        )
    return None


def _validate_config_problem(cls: type) -> str | None:
    """``grpo_validate_config`` runs on the class before anything is built:
    an instance method would never be called."""
    raw = inspect.getattr_static(cls, "grpo_validate_config", None)
    if raw is None or isinstance(raw, (staticmethod, classmethod)):
        return None
    return (
        "has grpo_validate_config as an instance method, which grpo never calls (it checks a config on the class, "
        "before building it): make it a @staticmethod taking config"
    )


def _state_problem(cls: type) -> str | None:
    """State is saved and restored as a pair: one method alone is silently unused."""
    has = {name for name in ("state_dict", "load_state_dict") if callable(getattr(cls, name, None))}
    if len(has) != 1:
        return None
    missing = ({"state_dict", "load_state_dict"} - has).pop()
    return (
        f"defines {has.pop()}() but not {missing}(), so its state is never checkpointed: define both "
        "(state_dict() returning plain JSON data, load_state_dict(state) restoring it), or neither"
    )


def validate_settings(obj: Any, name: str, table: dict[str, Any] | None) -> BaseModel | None:
    """The ``[plugins.<name>]`` table validated by the ``Settings`` model
    ``obj`` declares; ``None`` when it declares none (and no table is given)."""
    model = getattr(obj, SETTINGS_ATTRIBUTE, None)
    ref = table_ref(name)
    if model is None:
        if table:
            raise ConfigError(f"[{ref}] sets {sorted(table)}, but '{name}' declares no settings: remove the table.")
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginError(f"'{name}' declares Settings = {model!r}, which is not a pydantic model")
    if model.model_config.get("extra") in (
        None,
        "ignore",
    ):  # pydantic's default drops an unknown key: a typo went unseen
        known = {key for field_name, field in model.model_fields.items() for key in (field_name, field.alias) if key}
        unknown = sorted(str(key) for key in (table or {}) if key not in known)
        if unknown:
            fields = ", ".join(sorted(model.model_fields)) or "none"
            raise ConfigError(
                "; ".join(
                    f"{ref}.{key}: Extra inputs are not permitted (settings of '{name}': {fields})" for key in unknown
                )
            )
    try:
        return model.model_validate(table or {})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            fields = sorted(model.model_fields)
            hint = f" (settings of '{name}': {', '.join(fields) or 'none'})" if err["type"] == "extra_forbidden" else ""
            where = f"{ref}.{key}" if key else f"[{ref}]"  # a model-level rule names the table, no key
            problems.append(f"{where}: {err['msg']}{hint}")
        raise ConfigError("; ".join(problems)) from None


def table_ref(key: str) -> str:
    """``plugins.<key>`` as the config spells it (a qualified key is quoted in TOML)."""
    return f'plugins."{key}"' if QUALIFIER in key else f"plugins.{key}"


def settings_key(tables: dict[str, Any], info: EntryPointInfo) -> str | None:
    """Which ``[plugins.<key>]`` table configures ``info``: its bare name, or
    its qualified ``"distribution:name"`` (the spelling an ambiguous choice
    needs); ``None`` when neither is there. Both at once is refused."""
    keys = [key for key in tables if key == info.name or _qualifies(key, info)]
    if len(keys) > 1:
        raise ConfigError(
            f"[{table_ref(keys[0])}] and [{table_ref(keys[1])}] both configure '{info.name}' of "
            f"'{info.distribution}': keep one table."
        )
    return keys[0] if keys else None


def _qualifies(key: str, info: EntryPointInfo) -> bool:
    dist, name = split_qualified(key)
    return dist is not None and name == info.name and normalise(dist) == normalise(info.distribution)


def docstring_summary(obj: Any) -> str:
    """The first sentence of ``obj``'s docstring, as plain text: what
    ``grpo plugins`` shows beside a name ('' when it has none)."""
    doc = inspect.getdoc(obj) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    return sentence.replace("``", "`")


def own_checks(cls: Any, cfg: Any, num_processes: int = 1) -> list[str]:
    """An implementation class's own ``grpo_validate_config`` (a static or
    class method: it runs before anything is built), given ``num_processes``
    when it takes that argument. Returns its warnings."""
    raw = inspect.getattr_static(cls, "grpo_validate_config", None)
    if not isinstance(raw, (staticmethod, classmethod)):
        return []
    accepts = inspect.signature(cls.grpo_validate_config).parameters
    extra = {"num_processes": num_processes} if "num_processes" in accepts else {}
    result = cls.grpo_validate_config(config=cfg, **extra)
    return [result] if isinstance(result, str) else [str(item) for item in result or []]


class PluginFailure(PluginError):
    """A plugin's hook raised an exception that is not a :class:`GrpoError`."""


class GuardedHooks:
    """``host.hook``: pluggy's hook relay, with every non-user error a hook
    raises turned into one :class:`PluginFailure` naming the hook, the
    implementation and its distribution (the traceback goes to the error log)."""

    def __init__(self, host: PluginHost) -> None:
        self._host = host

    def __getattr__(self, name: str) -> Callable[..., Any]:
        caller = getattr(self._host.pm.hook, name)

        def call(**kwargs: Any) -> Any:
            try:
                return caller(**kwargs)
            except GrpoError:
                raise
            except Exception as exc:
                raise self._host.failure(name, exc) from exc

        call.__name__ = name
        return call


class PluginHost:
    """The pluggy manager plus the entry-point loading around it."""

    def __init__(self, allow: set[str] | None = None) -> None:
        self.allow = effective_allowlist(allow)  # the environment's list bounds ``allow``
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.chosen: dict[str, str] = {}  # extension point -> implementation name
        self.error_log: Path | None = None  # where tracebacks of plugin failures go
        self._origin: dict[str, EntryPointInfo] = {}  # pluggy plugin name -> its entry point
        self._always_on_loaded = False
        self.hook = GuardedHooks(self)

    # ------------------------------------------------------------------ discovery

    def allowed(self, distribution: str) -> bool:
        return self.allow is None or normalise(distribution) in self.allow

    def _refusal(self, info: EntryPointInfo) -> str | None:
        return None if self.allowed(info.distribution) else f"{NOT_ALLOWED} ({ALLOW_ENV} or plugins.allow)"

    def published(self, group: str) -> dict[str, list[EntryPointInfo]]:
        """name -> every publication of it in ``group``, each with the
        allowlist's verdict as ``error``. Nothing is imported."""
        return {
            name: [EntryPointInfo(i.group, i.name, i.target, i.distribution, self._refusal(i)) for i, _ in found]
            for name, found in published_entry_points().get(group, {}).items()
        }

    def resolve(
        self, group: str, spec: str, key: str | None = None
    ) -> tuple[EntryPointInfo, importlib.metadata.EntryPoint]:
        """The one publication ``spec`` (``name`` or ``distribution:name``)
        means in ``group``, or a :class:`PluginError` saying why there is none."""
        dist, name = split_qualified(spec)
        found = published_entry_points().get(group, {}).get(name, ())
        where = f"{key} = '{spec}'" if key else f"'{spec}'"
        if dist is not None:
            found = tuple(f for f in found if normalise(f[0].distribution) == normalise(dist))
        if not found:
            available = ", ".join(sorted(self.published(group))) or "none"
            owner = f" from distribution '{dist}'" if dist else ""
            raise PluginError(
                f"{where}: no installed package publishes '{name}'{owner} under '{group}' (available: {available})."
            )
        usable = tuple(f for f in found if self.allowed(f[0].distribution))
        if not usable:
            info = found[0][0]
            raise PluginError(
                f"{where}: {info.describe()} is not allowed: add '{info.distribution}' to plugins.allow "
                f"(and to {ALLOW_ENV} where that is set: a config can only narrow it)."
            )
        if len(usable) > 1:
            choices = " or ".join(f"'{f[0].qualified}'" for f in usable)
            raise PluginError(
                f"{where} is ambiguous: '{name}' is published under '{group}' by "
                + ", ".join(f"'{f[0].distribution}' ({f[0].target})" for f in usable)
                + f". Choose one by qualifying it with its distribution: {choices}."
            )
        return usable[0]

    def import_entry_point(self, group: str, spec: str, key: str | None = None) -> tuple[EntryPointInfo, Any]:
        """Resolve ``spec`` and import the object it names."""
        info, ep = self.resolve(group, spec, key)
        try:
            return info, ep.load()
        except Exception as exc:  # any import-time error of a third-party module
            raise PluginError(f"{info.describe()} failed to load: {type(exc).__name__}: {exc}{_api_hint(exc)}") from exc

    def list_group(self, group: str) -> list[EntryPointInfo]:
        """Every publication in ``group``, each imported and checked once so
        broken, refused and ambiguous ones show why instead of hiding."""
        out = []
        for name, found in sorted(published_entry_points().get(group, {}).items()):
            usable = [info for info, _ in found if self._refusal(info) is None]
            for info, ep in found:
                error = self._refusal(info)
                if error is None and len(usable) > 1:
                    others = ", ".join(p.distribution for p in usable if p is not info)
                    error = f"{AMBIGUOUS} '{name}' is also published by {others}; choose '{info.qualified}'"
                summary = ""
                if self._refusal(info) is None:  # refused ones are never imported
                    try:
                        obj = ep.load()
                    except Exception as exc:
                        error = f"{type(exc).__name__}: {exc}{_api_hint(exc)}"
                    else:
                        error = contract_problem(group, obj) or error
                        summary = docstring_summary(obj)
                out.append(EntryPointInfo(group, name, info.target, info.distribution, error, summary))
        return out

    def names(self, point: str) -> list[str]:
        return [i.name for i in self.list_group(group_for(point)) if i.error is None]

    # ------------------------------------------------------------------ registration

    def _register(self, obj: Any, info: EntryPointInfo) -> None:
        plugin_name = f"{info.group}:{info.qualified}"
        description = info.describe()
        try:
            self.pm.register(obj, name=plugin_name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{description} does not match grpo's hook contract: {exc}") from exc
        except ValueError as exc:  # registered twice
            raise PluginError(f"{description}: {exc}") from exc
        unknown = _unknown_hooks(self.pm, obj)
        point = BY_NAME.get(info.group.removeprefix(GROUP_PREFIX))
        problem = (
            f"marks {unknown} with @hookimpl, but grpo has no such hook (a misspelt hook name?). See "
            "grpo_core.contract.hookspecs for the hook names"
            if unknown
            else _role_problem(_implemented(self.pm, obj), point)
        )
        if problem:
            self.pm.unregister(obj)
            raise PluginError(f"{description} {problem}.")
        self._origin[plugin_name] = info

    def load_always_on(self, strict: bool = True) -> list[str]:
        """Register every allowed plugin of the ``grpo.plugins`` group (once).

        A plugin that does not import or is not allowed is skipped with a
        warning: it may have nothing to do with what the user runs. One that
        imports but breaks the contract raises :class:`PluginError` when
        ``strict`` (training), or is skipped with a warning otherwise (the CLI
        at start-up, so one bad package never takes down unrelated commands).
        Returns the problems found, one line each.
        """
        if self._always_on_loaded:
            return []
        self._always_on_loaded = True
        problems: list[str] = []
        for _name, publications in sorted(self.published(ALWAYS_ON_GROUP).items()):
            for info in publications:
                if info.error is not None:  # not allowed: never imported, nothing to say
                    continue
                try:
                    try:
                        _, obj = self.import_entry_point(ALWAYS_ON_GROUP, info.qualified)
                    except PluginError as exc:
                        problems.append(f"skipping {exc}")
                        warnings.warn(f"skipping {exc}", stacklevel=2)
                        continue
                    try:
                        obj = obj() if isinstance(obj, type) else obj
                    except Exception as exc:
                        raise PluginError(f"{info.describe()} failed to start: {type(exc).__name__}: {exc}") from exc
                    self._register(obj, info)
                except PluginError as exc:
                    if strict:
                        raise
                    problems.append(f"skipping {exc}")
                    warnings.warn(f"skipping {exc}", stacklevel=2)
        return problems

    def implementation_class(self, point: str, spec: str, key: str | None = None) -> tuple[EntryPointInfo, Any]:
        """Import the implementation ``spec`` of ``point`` and check it
        against the contract, without building it (for config checks)."""
        group = group_for(point)
        info, factory = self.import_entry_point(group, spec, key)
        problem = contract_problem(group, factory)
        if problem:
            raise PluginError(f"{info.describe()} {problem}.")
        return info, factory

    def engine_requirements(self, cfg: Any) -> frozenset[str]:
        """What the config's weight sync needs from the rollout's engine (its
        declared ``required_capabilities``), so the engine starts accordingly."""
        point = BY_NAME["weight_sync"]
        _, cls = self.implementation_class(
            point.name, chosen_implementations(cfg)[point.name], key=source_key(cfg, point)
        )
        return frozenset(declared(cls, point, "required_capabilities"))

    def load_implementation(self, point: str, spec: str, context: Any) -> Any:
        """Load, build and register the implementation ``spec`` of ``point``,
        with its ``[plugins.<name>]`` settings from ``context.config``."""
        if point not in BY_NAME:
            raise PluginError(f"unknown extension point '{point}'")
        info, factory = self.implementation_class(point, spec)
        settings = validate_settings(factory, *_settings_table(context, info))
        if getattr(context, "config", None) is not None:
            # torch (through processes): loaded when a run builds its plugins, not with the host
            from grpo_core.runtime.processes import world_size

            own_checks(factory, context.config, world_size())  # raises for a config it cannot run
        try:
            obj = factory(context) if settings is None else factory(context, settings)
        except GrpoError:
            raise
        except Exception as exc:
            raise PluginError(f"{info.describe()} failed to start: {type(exc).__name__}: {exc}") from exc
        declared_wrong = declaration_problems(obj, BY_NAME[point].declares)  # set in __init__, or by a factory
        if declared_wrong:
            raise PluginError(
                f"{info.describe()} declares " + "; declares ".join(declared_wrong) + " (the contract: "
                f"grpo_core.plugin_api.{BY_NAME[point].declares.__name__}, docs/plugins.md)."
            )
        self._register(obj, info)
        self.chosen[point] = info.name
        return obj

    # ------------------------------------------------------------------ rewards

    def load_reward(self, spec: str, context: Any) -> Callable[..., Any]:
        """Resolve one ``reward_funcs`` entry: a ``grpo.reward`` name first
        (with its ``[plugins.<name>]`` settings), then any plugin's
        :func:`grpo_load_reward`."""
        _, name = split_qualified(spec)
        if name in self.published(REWARD_GROUP):  # no need to import every other reward module
            info, func = self.import_entry_point(REWARD_GROUP, spec, "trl.reward_funcs")
            if not callable(func):
                raise PluginError(f"{info.describe()} is not callable")
            settings = validate_settings(func, *_settings_table(context, info))
            return func if settings is None else _with_settings(func, settings)
        self.load_always_on()
        func = self.hook.grpo_load_reward(spec=spec, context=context)
        if func is None:
            named = ", ".join(self.names("reward")) or "none"
            raise PluginError(
                f"cannot resolve reward function '{spec}': not a registered reward name ({named}), "
                "not an importable 'module.function' path from the working directory, and not a "
                "reward-model directory."
            )
        return func

    # ------------------------------------------------------------------ failures

    def origin_of(self, plugin: Any) -> EntryPointInfo | None:
        name = self.pm.get_name(plugin)
        return self._origin.get(name) if name else None

    def _culprit(self, hook_name: str, exc: BaseException) -> EntryPointInfo | None:
        """Which registered plugin raised ``exc`` from ``hook_name``: the only
        implementation, else the outermost traceback frame in a plugin's module."""
        impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if not (i.wrapper or i.hookwrapper)]
        if len(impls) == 1:
            return self.origin_of(impls[0].plugin)
        modules = {getattr(i.function, "__module__", None): i.plugin for i in impls}
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            plugin = modules.get(frame.f_globals.get("__name__"))
            if plugin is not None:
                return self.origin_of(plugin)
        return None

    def failure(self, hook_name: str, exc: BaseException) -> PluginFailure:
        """One error for a hook that raised: which hook, which plugin, where
        the traceback went."""
        info = self._culprit(hook_name, exc)
        who = (
            f"{info.group.removeprefix(GROUP_PREFIX)} implementation '{info.name}' ({info.describe()})"
            if info
            else "a plugin"
        )
        where = ""
        if self.error_log is not None:
            try:
                self.error_log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.error_log, "a", encoding="utf-8") as handle:
                    handle.write(f"--- {hook_name} raised in {who}\n")
                    handle.write("".join(traceback.format_exception(exc)))
                where = f" The traceback is in {self.error_log}."
            except OSError:
                where = ""
        return PluginFailure(f"hook {hook_name} of {who} raised {type(exc).__name__}: {exc}.{where}")


def _api_hint(exc: BaseException) -> str:
    """For a plugin that imports a grpo_core module that is not there (an old
    path, or one grpo moved): where its names are."""
    name = getattr(exc, "name", None) or ""
    if isinstance(exc, ModuleNotFoundError) and name.startswith("grpo_core."):
        return (
            f". A plugin imports grpo only through grpo_core.plugin_api (its other modules move without notice): "
            f"import the names it takes from {name} from grpo_core.plugin_api instead"
        )
    return ""


def _with_settings(func: Callable[..., Any], settings: BaseModel) -> Callable[..., Any]:
    """A reward function called with its validated settings as keyword arguments."""
    values = settings.model_dump()
    if inspect.iscoroutinefunction(func):

        async def configured(*args: Any, **kwargs: Any) -> Any:
            return await func(*args, **kwargs, **values)

    else:

        def configured(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            return func(*args, **kwargs, **values)

    configured.__name__ = configured.__qualname__ = getattr(func, "__name__", "reward")
    configured.__wrapped__ = func  # type: ignore[attr-defined]  # signature (required columns) is func's
    return configured


def _settings_table(context: Any, info: EntryPointInfo) -> tuple[str, dict[str, Any] | None]:
    """The key and contents of the ``[plugins.<key>]`` table configuring ``info``."""
    config = getattr(context, "config", None)
    if config is None:
        return info.name, None
    key = settings_key(config.plugins.settings_tables(), info)
    return (info.name, None) if key is None else (key, config.plugins.settings_table(key))

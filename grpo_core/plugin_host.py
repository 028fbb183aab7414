"""Finding, loading and checking plugins.

stevedore discovers entry points and loads the one named driver an
extension point needs; pluggy holds the loaded objects and calls their
hooks. Everything a plugin can get wrong (it does not import, it misses a
hook, a hook has an argument the spec does not know) becomes a
:class:`~grpo_core.errors.PluginError` naming the distribution and the entry
point, raised only when that plugin is actually needed, so one broken
package never takes down unrelated commands.

Loading can be restricted to an allowlist of distributions
(``GRPO_PLUGINS_ALLOW=grpo-plugin-a,grpo-plugin-b`` or ``plugins.allow`` in
the config); grpo's own distribution is always allowed.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import pluggy
from stevedore import DriverManager, ExtensionManager

from grpo_core import hookspecs
from grpo_core.errors import PluginError

GROUP_PREFIX = "grpo."
SELF_DISTRIBUTION = "grpo"
ALLOW_ENV = "GRPO_PLUGINS_ALLOW"


def group_for(point: str) -> str:
    """The entry point group of an extension point (``grpo.<point>``)."""
    return GROUP_PREFIX + point


def rescan() -> None:
    """Forget every cached view of the installed distributions.

    Needed only when packages are installed or ``sys.path`` changes inside a
    running process (tests, notebooks): importlib, stevedore and this module
    each cache what they found.
    """
    importlib.invalidate_caches()
    _distribution_index.cache_clear()
    ExtensionManager.ENTRY_POINT_CACHE.clear()


@cache
def _distribution_index() -> dict[tuple[str, str], str]:
    """(group, entry point name) -> distribution that publishes it."""
    index: dict[tuple[str, str], str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if ep.group.startswith(GROUP_PREFIX):
                index.setdefault((ep.group, ep.name), name)
    return index


def distribution_of(group: str, name: str) -> str:
    return _distribution_index().get((group, name), "?")


@dataclass(frozen=True)
class EntryPointInfo:
    """One published implementation, for ``grpo plugins``."""

    group: str
    name: str
    target: str
    distribution: str
    error: str | None = None  # why it cannot be loaded, if it cannot


def allowlist_from_env() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    return {part.strip().lower() for part in raw.split(",") if part.strip()}


def _normalise(dist: str) -> str:
    return dist.lower().replace("_", "-")


def _unknown_hooks(pm: pluggy.PluginManager, obj: Any) -> list[str]:
    """Hook implementations of ``obj`` that match no hook spec."""
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(obj) or []
        if caller.spec is None and any(i.plugin is obj and not i.optionalhook for i in caller.get_hookimpls())
    )


def contract_problem(group: str, obj: Any) -> str | None:
    """Check a loaded entry point against the contract without building it.

    Classes are registered as they are in a scratch plugin manager (pluggy
    validates unbound methods the same way), so a wrong argument name, a
    misspelt hook or a missing required hook shows in ``grpo plugins`` before
    any run needs the plugin. A factory function cannot be checked until it
    is called; ``None`` then.
    """
    point = group.removeprefix(GROUP_PREFIX)
    if group == hookspecs.REWARD_GROUP:
        return None if callable(obj) else f"not callable ({type(obj).__name__})"
    if point not in hookspecs.NAMED_EXTENSION_POINTS and group != hookspecs.ALWAYS_ON_GROUP:
        return None
    if point in hookspecs.NAMED_EXTENSION_POINTS and not isinstance(obj, type):
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
    implemented = {
        caller.name
        for caller in scratch.get_hookcallers(obj) or []
        if any(i.plugin is obj and not (i.wrapper or i.hookwrapper) for i in caller.get_hookimpls())
    }
    if group == hookspecs.ALWAYS_ON_GROUP:
        stray = sorted(implemented & {h for hs in hookspecs.NAMED_EXTENSION_POINTS.values() for h in hs})
        return f"always-on plugin implements extension-point hooks {stray}" if stray else None
    missing = sorted(set(hookspecs.NAMED_EXTENSION_POINTS[point]) - implemented)
    return f"does not implement {missing}, required by extension point '{point}'" if missing else None


class _Skip(Exception):
    """An always-on plugin that is skipped, never fatal."""


class PluginHost:
    """The pluggy manager plus the entry-point loading around it."""

    def __init__(self, allow: set[str] | None = None) -> None:
        env_allow = allowlist_from_env()
        merged = (allow or set()) | (env_allow or set()) if (allow or env_allow) else None
        self.allow = {_normalise(d) for d in merged} | {SELF_DISTRIBUTION} if merged else None
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.chosen: dict[str, str] = {}  # extension point -> implementation name
        self._always_on_loaded = False

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # ------------------------------------------------------------------ discovery

    def _allowed(self, group: str, name: str) -> bool:
        if self.allow is None:
            return True
        return _normalise(distribution_of(group, name)) in self.allow

    def _describe(self, group: str, name: str) -> str:
        return f"entry point '{name}' in group '{group}' of distribution '{distribution_of(group, name)}'"

    def list_group(self, group: str) -> list[EntryPointInfo]:
        """Every entry point of ``group``, each tried once so broken ones show
        their error instead of hiding."""
        failures: dict[str, str] = {}

        def on_failure(_manager: Any, ep: Any, err: BaseException) -> None:
            failures[ep.name] = f"{type(err).__name__}: {err}"

        manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
        loaded = {ext.name: ext.plugin for ext in manager.extensions}
        infos = []
        for ep in manager.list_entry_points():
            error = failures.get(ep.name)
            if error is None and ep.name in loaded:
                error = contract_problem(group, loaded[ep.name])
            if not self._allowed(group, ep.name):
                error = f"not in the plugin allowlist ({ALLOW_ENV})"
            infos.append(EntryPointInfo(group, ep.name, ep.value, distribution_of(group, ep.name), error))
        return sorted(infos, key=lambda i: i.name)

    def published(self, group: str) -> dict[str, EntryPointInfo]:
        """Entry points of ``group`` by name, *without importing them* (cheap:
        for config checks). ``error`` is set only for allowlist refusals."""
        out: dict[str, EntryPointInfo] = {}
        for ep in importlib.metadata.entry_points(group=group):
            if ep.name in out:
                continue
            error = None if self._allowed(group, ep.name) else f"not in the plugin allowlist ({ALLOW_ENV})"
            out[ep.name] = EntryPointInfo(group, ep.name, ep.value, distribution_of(group, ep.name), error)
        return out

    def names(self, point: str) -> list[str]:
        return [i.name for i in self.list_group(group_for(point)) if i.error is None]

    def _load_entry_point(self, group: str, name: str) -> Any:
        if not self._allowed(group, name):
            raise PluginError(
                f"{self._describe(group, name)} is not allowed: add '{distribution_of(group, name)}' to "
                f"{ALLOW_ENV} or `plugins.allow`."
            )
        errors: list[BaseException] = []

        def on_failure(_manager: Any, _ep: Any, err: BaseException) -> None:
            errors.append(err)

        try:
            driver = DriverManager(group, name, invoke_on_load=False, on_load_failure_callback=on_failure)
        except Exception as exc:  # stevedore raises NoMatches / RuntimeError
            if errors:
                err = errors[0]
                raise PluginError(f"{self._describe(group, name)} failed to load: {type(err).__name__}: {err}") from err
            available = ", ".join(self.names(group.removeprefix(GROUP_PREFIX))) or "none"
            raise PluginError(f"no plugin named '{name}' in group '{group}' (available: {available})") from exc
        return driver.driver

    # ------------------------------------------------------------------ registration

    def _register(self, obj: Any, plugin_name: str, description: str) -> None:
        try:
            self.pm.register(obj, name=plugin_name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{description} does not match grpo's hook contract: {exc}") from exc
        except ValueError as exc:  # registered twice
            raise PluginError(f"{description}: {exc}") from exc
        unknown = _unknown_hooks(self.pm, obj)
        if unknown:
            self.pm.unregister(obj)
            raise PluginError(
                f"{description} marks {unknown} with @hookimpl, but grpo has no such hook "
                "(a misspelt hook name?). See grpo_core.hookspecs for the hook names."
            )

    def _point_hooks(self, obj: Any) -> set[str]:
        """Extension-point hooks ``obj`` implements (wrappers excluded)."""
        found = set()
        for hook_names in hookspecs.NAMED_EXTENSION_POINTS.values():
            for hook_name in hook_names:
                for impl in self.pm.get_hookcallers(obj) or []:
                    if impl.name != hook_name:
                        continue
                    if any(i.plugin is obj and not (i.wrapper or i.hookwrapper) for i in impl.get_hookimpls()):
                        found.add(hook_name)
        return found

    def load_always_on(self, strict: bool = True) -> list[str]:
        """Register every plugin of the ``grpo.plugins`` group (once).

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
        import warnings

        group = hookspecs.ALWAYS_ON_GROUP
        problems: list[str] = []
        for name, info in sorted(self.published(group).items()):
            description = self._describe(group, name)
            try:
                if info.error is not None:
                    raise _Skip(f"skipping {description}: {info.error}")
                try:
                    obj = self._load_entry_point(group, name)
                except PluginError as exc:  # does not import: skipped, never fatal
                    raise _Skip(f"skipping {exc}") from exc
                try:
                    obj = obj() if isinstance(obj, type) else obj
                except Exception as exc:
                    raise PluginError(f"{description} failed to start: {type(exc).__name__}: {exc}") from exc
                self._register(obj, f"{group}:{name}", description)
                stray = self._point_hooks(obj)
                if stray:
                    self.pm.unregister(obj)
                    raise PluginError(
                        f"{description} implements extension-point hooks {sorted(stray)}; publish it under the "
                        "group of that extension point (e.g. grpo.rollout) so the config can choose it."
                    )
            except _Skip as skip:
                problems.append(str(skip))
                warnings.warn(str(skip), stacklevel=2)
            except PluginError as exc:
                if strict:
                    raise
                problems.append(f"skipping {exc}")
                warnings.warn(f"skipping {exc}", stacklevel=2)
        return problems

    def load_implementation(self, point: str, name: str, context: Any) -> Any:
        """Load, build and register the implementation ``name`` of ``point``."""
        if point not in hookspecs.NAMED_EXTENSION_POINTS:
            raise PluginError(f"unknown extension point '{point}'")
        group = group_for(point)
        description = self._describe(group, name)
        factory = self._load_entry_point(group, name)
        try:
            obj = factory(context)
        except PluginError:
            raise
        except Exception as exc:
            if hasattr(exc, "exit_code"):  # a GrpoError subclass: already user-facing
                raise
            raise PluginError(f"{description} failed to start: {type(exc).__name__}: {exc}") from exc
        self._register(obj, f"{group}:{name}", description)
        missing = set(hookspecs.NAMED_EXTENSION_POINTS[point]) - self._point_hooks(obj)
        if missing:
            self.pm.unregister(obj)
            raise PluginError(f"{description} does not implement {sorted(missing)}, required by extension point '{point}'")
        self.chosen[point] = name
        return obj

    # ------------------------------------------------------------------ rewards

    def load_reward(self, spec: str, context: Any) -> Callable[..., Any]:
        """Resolve one ``reward_funcs`` entry: a ``grpo.reward`` name first,
        then any plugin's :func:`grpo_load_reward`."""
        group = hookspecs.REWARD_GROUP
        if spec in self.published(group):  # no need to import every other reward module
            func = self._load_entry_point(group, spec)
            if not callable(func):
                raise PluginError(f"{self._describe(group, spec)} is not callable")
            return func
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

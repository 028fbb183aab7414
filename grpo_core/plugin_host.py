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
        infos = []
        for ep in manager.list_entry_points():
            error = failures.get(ep.name)
            if not self._allowed(group, ep.name):
                error = f"not in the plugin allowlist ({ALLOW_ENV})"
            infos.append(EntryPointInfo(group, ep.name, ep.value, distribution_of(group, ep.name), error))
        return sorted(infos, key=lambda i: i.name)

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

    def load_always_on(self) -> None:
        """Register every plugin of the ``grpo.plugins`` group (once)."""
        if self._always_on_loaded:
            return
        self._always_on_loaded = True
        group = hookspecs.ALWAYS_ON_GROUP
        for info in self.list_group(group):
            if info.error is not None:
                # Broken or disallowed always-on plugins are reported, never fatal:
                # they may have nothing to do with what the user runs.
                import warnings

                warnings.warn(f"skipping {self._describe(group, info.name)}: {info.error}", stacklevel=2)
                continue
            obj = self._load_entry_point(group, info.name)
            obj = obj() if isinstance(obj, type) else obj
            description = self._describe(group, info.name)
            self._register(obj, f"{group}:{info.name}", description)
            stray = self._point_hooks(obj)
            if stray:
                self.pm.unregister(obj)
                raise PluginError(
                    f"{description} implements extension-point hooks {sorted(stray)}; publish it under the "
                    "group of that extension point (e.g. grpo.rollout) so the config can choose it."
                )

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
        if spec in {i.name for i in self.list_group(group)}:
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

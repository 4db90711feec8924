"""Finding platform plugins and choosing one.

One ``pluggy.PluginManager("podium")`` loads every module registered under the ``podium``
entry-point group. Each plugin returns platforms from ``podium_platforms``; a platform whose
hardware is missing is listed as unavailable with its reason, while a plugin that breaks the
contract (unknown hook, wrong hook signature, incompatible API version, broken import) stops
discovery with an error naming its distribution, and one that implements a deprecated hook gets
a ``PluginApiDeprecationWarning`` naming it. Selection picks the available platform with
the highest priority unless ``--device`` / ``PODIUM_DEVICE`` names one.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from podium_plugin_api import API_VERSION, Availability, Platform, compatibility_problem, hookimpl, hookspecs

ENTRY_POINT_GROUP = "podium"
DEVICE_ENV = "PODIUM_DEVICE"


class PluginError(RuntimeError):
    """A plugin broke the contract; the message names the distribution."""


class PlatformSelectionError(RuntimeError):
    """No platform could be selected; the message lists the choices."""


@dataclass(frozen=True)
class PlatformEntry:
    platform: Platform
    distribution: str
    version: str
    availability: Availability

    @property
    def name(self) -> str:
        return self.platform.name


class _BuiltinHooks:
    """The core's own hook implementations, registered like any plugin's."""

    @hookimpl
    def podium_custom_ops(self, platform: Platform) -> dict | None:
        return platform.custom_ops() or None


def _distribution_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return f"<entry point {ep.name}>", "?"
    return dist.metadata["Name"], dist.version


def _register(pm: pluggy.PluginManager, obj: Any, name: str, origin: tuple[str, str]) -> None:
    """Register one plugin; pluggy's warnings (deprecated hooks, ``warn_on_impl``) are re-emitted
    naming the distribution, at the plugin's own source line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pm.register(obj, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"podium plugin {origin[0]} {origin[1]} breaks the hook contract: {exc}") from exc
    for w in caught:
        warnings.warn_explicit(f"podium plugin {origin[0]} {origin[1]}: {w.message}", w.category, w.filename, w.lineno)


def build_plugin_manager(extra_plugins: dict[str, Any] | None = None) -> tuple[pluggy.PluginManager, dict[str, tuple[str, str]]]:
    """Load every ``podium`` entry point (plus ``extra_plugins``: name -> module/object).

    Returns the manager and a map from plugin name to (distribution, version).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(_BuiltinHooks(), name="podium-core")
    origins: dict[str, tuple[str, str]] = {"podium-core": ("podium", "builtin")}
    candidates: list[tuple[str, Any, tuple[str, str]]] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        origin = _distribution_of(ep)
        try:
            module = ep.load()
        except Exception as exc:  # a plugin that cannot even import is broken, and says so
            raise PluginError(
                f"podium plugin {origin[0]} {origin[1]} (entry point {ep.name} = {ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        candidates.append((ep.name, module, origin))
    for name, obj in (extra_plugins or {}).items():
        candidates.append((name, obj, (name, "registered in-process")))
    for name, obj, origin in candidates:
        if pm.has_plugin(name):
            continue
        _register(pm, obj, name, origin)
        origins[name] = origin
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin_name = pm.get_name(exc.plugin) or "?"
        dist = origins.get(plugin_name, (plugin_name, "?"))
        raise PluginError(f"podium plugin {dist[0]} {dist[1]} implements a hook podium does not define: {exc}") from exc
    return pm, origins


def _safe_availability(platform: Platform) -> Availability:
    try:
        result = platform.availability()
    except Exception as exc:  # hardware probing must never take the others down
        return Availability(False, f"availability check raised {type(exc).__name__}: {exc}")
    if not isinstance(result, Availability):
        return Availability(False, f"availability() returned {result!r}, not an Availability")
    return result


def discover_platforms(extra_plugins: dict[str, Any] | None = None) -> list[PlatformEntry]:
    """Every platform every plugin provides, sorted by priority (highest first)."""
    pm, origins = build_plugin_manager(extra_plugins)
    entries: list[PlatformEntry] = []
    seen: dict[str, str] = {}
    for impl in pm.hook.podium_platforms.get_hookimpls():
        dist, version = origins.get(impl.plugin_name, (impl.plugin_name, "?"))
        for item in impl.function() or []:
            platform = _instantiate(item, dist)
            problem = compatibility_problem(platform.api_version, API_VERSION)
            if problem:
                raise PluginError(f"podium plugin {dist} {version} (platform {platform.name!r}) cannot be loaded: {problem}")
            if platform.name in seen:
                raise PluginError(
                    f"platform name {platform.name!r} is provided by both {seen[platform.name]} and {dist}; "
                    f"uninstall one of them"
                )
            seen[platform.name] = dist
            entries.append(PlatformEntry(platform, dist, version, _safe_availability(platform)))
    entries.sort(key=lambda e: (-e.platform.priority, e.name))
    return entries


def _instantiate(item: Any, dist: str) -> Platform:
    platform = item() if isinstance(item, type) else item
    if not isinstance(platform, Platform):
        raise PluginError(f"podium plugin {dist} returned {item!r} from podium_platforms; expected a Platform subclass")
    if not platform.name:
        raise PluginError(f"podium plugin {dist} returned platform {type(platform).__name__} with an empty name")
    return platform


def describe_choices(entries: list[PlatformEntry]) -> str:
    lines = []
    for e in entries:
        state = "available" if e.availability.ok else f"unavailable: {e.availability.reason}"
        lines.append(f"  {e.name} ({e.distribution}, priority {e.platform.priority}): {state}")
    return "\n".join(lines) or "  (no platform plugin is installed; pip install podium-cpu)"


def select_platform(requested: str | None = None, entries: list[PlatformEntry] | None = None) -> PlatformEntry:
    """The platform to run on: ``requested`` (or $PODIUM_DEVICE) if given, else the best available."""
    entries = discover_platforms() if entries is None else entries
    requested = requested or os.environ.get(DEVICE_ENV) or None
    if requested:
        for entry in entries:
            if entry.name == requested:
                if entry.availability.ok:
                    return entry
                raise PlatformSelectionError(
                    f"platform {requested!r} is unavailable here: {entry.availability.reason}\nplatforms:\n"
                    + describe_choices(entries)
                )
        raise PlatformSelectionError(f"no platform named {requested!r} is installed; choices:\n" + describe_choices(entries))
    for entry in entries:
        if entry.availability.ok:
            return entry
    raise PlatformSelectionError("no available platform; platforms:\n" + describe_choices(entries))


def selected_name(entries: list[PlatformEntry], requested: str | None = None) -> str | None:
    try:
        return select_platform(requested, entries).name
    except PlatformSelectionError:
        return None

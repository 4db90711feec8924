"""Finding platform plugins and choosing one: the only discovery there is (the core and the kit use it).

``load_plugins()`` builds one ``pluggy.PluginManager("podium")`` over every module registered under
the ``podium`` entry-point group, validated against ``hookspecs``, and asks each plugin for its
platforms. A plugin that breaks the contract (it fails to import, implements an unknown hook or a
hook with a wrong signature, declares an incompatible API version, returns something that is not a
``Platform``) stops discovery with a ``PluginError`` naming its distribution. A platform whose
hardware is missing is listed as unavailable with its reason and never stops the others. A plugin
implementing a deprecated hook gets a ``PluginApiDeprecationWarning`` naming it.

Creating a platform object has no side effects (the contract says so): discovery instantiates every
installed platform to ask it ``availability()``. Process-wide settings are applied later, by
``Platform.activate``, on the one platform a run selects.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .platform import Availability, Platform
from .version import API_VERSION, compatibility_problem

if TYPE_CHECKING:
    from torch import nn

    from .quantization import QuantizationMethod

ENTRY_POINT_GROUP = "podium"
DEVICE_ENV = "PODIUM_DEVICE"  # the environment's alias of --device


class PluginError(RuntimeError):
    """A plugin broke the contract; the message names the distribution."""


class PlatformSelectionError(RuntimeError):
    """No platform could be selected; the message lists the choices."""


@dataclass(frozen=True)
class PlatformEntry:
    """One discovered platform, where it came from, and whether it can run here."""

    platform: Platform
    distribution: str
    version: str
    availability: Availability

    @property
    def name(self) -> str:
        return self.platform.name


@dataclass(frozen=True)
class Plugins:
    """The installed ``podium`` plugins under one plugin manager, and the platforms they provide.

    ``platforms`` is sorted by priority, highest first. ``deprecations``: one message per deprecated
    hook the plugins implement, naming the distribution.
    """

    manager: pluggy.PluginManager
    origins: dict[str, tuple[str, str]]  # plugin name -> (distribution, version)
    platforms: tuple[PlatformEntry, ...]
    deprecations: tuple[str, ...] = ()

    def select(self, requested: str | None = None) -> PlatformEntry:
        """The platform to run on: ``requested`` (or ``$PODIUM_DEVICE``) if given, else the best available."""
        requested = requested or os.environ.get(DEVICE_ENV) or None
        if requested:
            for entry in self.platforms:
                if entry.name == requested:
                    if entry.availability.ok:
                        return entry
                    raise PlatformSelectionError(f"platform {requested!r} is unavailable here: "
                                                 f"{entry.availability.reason}\nplatforms:\n{self.describe()}")
            raise PlatformSelectionError(f"no platform named {requested!r} is installed; choices:\n{self.describe()}")
        for entry in self.platforms:
            if entry.availability.ok:
                return entry
        raise PlatformSelectionError(f"no available platform; platforms:\n{self.describe()}")

    def describe(self) -> str:
        """One line per platform: name, distribution, priority, available or why not."""
        lines = []
        for e in self.platforms:
            state = "available" if e.availability.ok else f"unavailable: {e.availability.reason}"
            lines.append(f"  {e.name} ({e.distribution}, priority {e.platform.priority}): {state}")
        return "\n".join(lines) or "  (no platform plugin is installed; pip install podium-cpu)"

    def quantization_methods(self) -> dict[str, type[QuantizationMethod]]:
        """Every plugin's ``podium_quantization_methods``, merged (later plugins win)."""
        merged: dict[str, type[QuantizationMethod]] = {}
        for methods in self.manager.hook.podium_quantization_methods():
            merged.update(methods or {})
        return merged

    def model_architectures(self) -> dict[str, type[nn.Module]]:
        """Every plugin's ``podium_model_architectures``, merged (later plugins win)."""
        merged: dict[str, type[nn.Module]] = {}
        for archs in self.manager.hook.podium_model_architectures():
            merged.update(archs or {})
        return merged


def load_plugins(extra_plugins: dict[str, Any] | None = None, emit_warnings: bool = True) -> Plugins:
    """Every installed ``podium`` plugin (plus ``extra_plugins``: name -> module or object, registered
    in-process as if installed), validated, and their platforms.

    Deprecated hooks are warned about (``warnings``, at the plugin's own source line) unless
    ``emit_warnings`` is False; either way ``Plugins.deprecations`` lists them."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    origins: dict[str, tuple[str, str]] = {}
    deprecations: list[str] = []
    for name, obj, origin in _candidates(extra_plugins):
        if manager.has_plugin(name):
            continue
        deprecations += _register(manager, obj, name, origin, emit_warnings)
        origins[name] = origin
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        dist, version = origins.get(manager.get_name(exc.plugin) or "?", ("?", "?"))
        raise PluginError(f"podium plugin {dist} {version} implements a hook podium does not define: {exc}") from exc
    return Plugins(manager, origins, _platforms(manager, origins), tuple(deprecations))


def _candidates(extra_plugins: dict[str, Any] | None) -> list[tuple[str, Any, tuple[str, str]]]:
    """(plugin name, module, (distribution, version)) of every entry point, then the extra plugins."""
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        origin = _distribution_of(ep)
        try:
            module = ep.load()
        except Exception as exc:  # a plugin that cannot even import is broken, and says so
            raise PluginError(
                f"podium plugin {origin[0]} {origin[1]} (entry point {ep.name} = {ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        found.append((ep.name, module, origin))
    for name, obj in (extra_plugins or {}).items():
        found.append((name, obj, (name, "registered in-process")))
    return found


def _distribution_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return f"<entry point {ep.name}>", "?"
    return dist.metadata["Name"], dist.version


def _register(manager: pluggy.PluginManager, obj: Any, name: str, origin: tuple[str, str], emit: bool) -> list[str]:
    """Register one plugin; returns pluggy's deprecation messages for it, naming the distribution
    (and re-emits them at the plugin's own source line when ``emit``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            manager.register(obj, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"podium plugin {origin[0]} {origin[1]} breaks the hook contract: {exc}") from exc
    messages = []
    for w in caught:
        message = f"podium plugin {origin[0]} {origin[1]}: {w.message}"
        messages.append(message)
        if emit:
            warnings.warn_explicit(message, w.category, w.filename, w.lineno)
    return messages


def _platforms(manager: pluggy.PluginManager, origins: dict[str, tuple[str, str]]) -> tuple[PlatformEntry, ...]:
    """Every platform every plugin provides, checked, sorted by priority (highest first)."""
    entries: list[PlatformEntry] = []
    seen: dict[str, str] = {}
    for impl in manager.hook.podium_platforms.get_hookimpls():
        dist, version = origins.get(impl.plugin_name, (impl.plugin_name, "?"))
        for item in impl.function() or []:
            platform = _instantiate(item, dist)
            problem = compatibility_problem(str(platform.api_version), API_VERSION)
            if problem:
                raise PluginError(f"podium plugin {dist} {version} (platform {platform.name!r}) cannot be loaded: "
                                  f"{problem}")
            if platform.name in seen:
                raise PluginError(f"platform name {platform.name!r} is provided by both {seen[platform.name]} and "
                                  f"{dist}; uninstall one of them")
            seen[platform.name] = dist
            entries.append(PlatformEntry(platform, dist, version, _safe_availability(platform)))
    entries.sort(key=lambda e: (-e.platform.priority, e.name))
    return tuple(entries)


def _instantiate(item: Any, dist: str) -> Platform:
    platform = item() if isinstance(item, type) else item
    if not isinstance(platform, Platform):
        raise PluginError(f"podium plugin {dist} returned {item!r} from podium_platforms; expected a Platform subclass")
    if not platform.name:
        raise PluginError(f"podium plugin {dist} returned platform {type(platform).__name__} with an empty name")
    return platform


def _safe_availability(platform: Platform) -> Availability:
    try:
        result = platform.availability()
    except Exception as exc:  # hardware probing must never take the others down
        return Availability(False, f"availability() raised {type(exc).__name__}: {exc} (it must return, not raise)")
    if not isinstance(result, Availability):
        return Availability(False, f"availability() returned {result!r}, not an Availability")
    return result

"""Finding the platform under test with pluggy alone.

The kit must not import the core (``podium``), so it repeats the small part of discovery it
needs: one ``pluggy.PluginManager`` over the ``podium`` entry-point group, validated against
``podium_plugin_api.hookspecs``, asked for its platforms. Anything that would stop the core from
starting (a plugin that fails to import or breaks the hook contract) stops the kit too, with a
message naming the distribution.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from .. import hookspecs
from ..platform import Availability, Platform

ENTRY_POINT_GROUP = "podium"


class KitSetupError(Exception):
    """The platform under test cannot be found or cannot run here; the message says why."""


@dataclass(frozen=True)
class FoundPlatform:
    """The platform under test and where it came from."""

    platform: Platform
    distribution: str
    version: str
    plugin_manager: pluggy.PluginManager
    deprecations: tuple[str, ...] = ()  # deprecated hooks the installed plugins implement

    @property
    def label(self) -> str:
        return f"platform {self.platform.name!r} ({self.distribution} {self.version})"

    def hook_custom_ops(self) -> dict[str, Callable[..., Any]]:
        """Ops every plugin's ``podium_custom_ops`` hook returns for this platform, merged."""
        merged: dict[str, Callable[..., Any]] = {}
        for result in self.plugin_manager.hook.podium_custom_ops(platform=self.platform):
            merged.update(result or {})
        return merged


def _origin(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return f"<entry point {ep.name}>", "?"
    return dist.metadata["Name"], dist.version


def register_plugin(pm: pluggy.PluginManager, module: Any, name: str, origin: tuple[str, str]) -> list[str]:
    """Register one plugin; returns the deprecation messages pluggy raised for it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:
            raise KitSetupError(f"podium plugin {origin[0]} {origin[1]} breaks the hook contract: {exc}") from exc
    return [f"podium plugin {origin[0]} {origin[1]}: {w.message}" for w in caught]


def load_plugins() -> tuple[pluggy.PluginManager, dict[str, tuple[str, str]], list[str]]:
    """Every installed ``podium`` plugin: (manager, plugin name -> (distribution, version), deprecations)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    origins: dict[str, tuple[str, str]] = {}
    deprecations: list[str] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        origin = _origin(ep)
        if pm.has_plugin(ep.name):
            continue
        try:
            module = ep.load()
        except Exception as exc:
            raise KitSetupError(
                f"podium plugin {origin[0]} {origin[1]} (entry point {ep.name} = {ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        deprecations += register_plugin(pm, module, ep.name, origin)
        origins[ep.name] = origin
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        dist, version = origins.get(pm.get_name(exc.plugin) or "?", ("?", "?"))
        raise KitSetupError(f"podium plugin {dist} {version} implements a hook podium does not define: {exc}") from exc
    return pm, origins, deprecations


def _platforms(pm: pluggy.PluginManager, origins: dict[str, tuple[str, str]]) -> list[tuple[Platform, str, str]]:
    found = []
    for impl in pm.hook.podium_platforms.get_hookimpls():
        dist, version = origins.get(impl.plugin_name, (impl.plugin_name, "?"))
        for item in impl.function() or []:
            platform = item() if isinstance(item, type) else item
            if not isinstance(platform, Platform):
                raise KitSetupError(
                    f"podium plugin {dist} returned {item!r} from podium_platforms; expected a Platform"
                )
            found.append((platform, dist, version))
    return found


def _availability(platform: Platform) -> Availability:
    try:
        result = platform.availability()
    except Exception as exc:  # availability() must not raise; say so instead of crashing
        return Availability(False, f"availability() raised {type(exc).__name__}: {exc} (it must return, not raise)")
    if not isinstance(result, Availability):
        return Availability(False, f"availability() returned {result!r}, not an Availability")
    return result


def find_platform(name: str) -> FoundPlatform:
    """The installed, available platform called ``name``; KitSetupError saying why not otherwise."""
    pm, origins, deprecations = load_plugins()
    found = _platforms(pm, origins)
    for platform, dist, version in found:
        if platform.name != name:
            continue
        availability = _availability(platform)
        if not availability.ok:
            raise KitSetupError(
                f"platform {name!r} ({dist} {version}) is installed but unavailable here: {availability.reason}; "
                f"run the kit where its hardware and runtime are present"
            )
        return FoundPlatform(platform, dist, version, pm, tuple(deprecations))
    choices = "\n".join(f"  {p.name} ({d} {v})" for p, d, v in found) or "  (none)"
    raise KitSetupError(
        f"no platform named {name!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}); installed platforms:\n"
        f"{choices}\ninstall your plugin into this environment (pip install -e <your plugin folder>) and check that "
        f"its podium_platforms hook returns a Platform whose name is {name!r}"
    )

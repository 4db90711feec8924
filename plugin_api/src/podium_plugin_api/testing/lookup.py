"""Finding the platform under test, exactly as the core finds it (``podium_plugin_api.discovery``).

The kit must not import the core (``podium``), and it need not: discovery lives in the contract.
Anything that would stop the core from starting (a plugin that fails to import or breaks the hook
contract) stops the kit too, with a message naming the distribution. The platform found is
activated as the engine would activate it, with its options resolved the same way (the values
given to the kit, then their environment aliases, then the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..discovery import ENTRY_POINT_GROUP, PluginError, load_plugins
from ..options import resolve_options
from ..platform import Platform


class KitSetupError(Exception):
    """The platform under test cannot be found or cannot run here; the message says why."""


@dataclass(frozen=True)
class FoundPlatform:
    """The platform under test (activated) and where it came from."""

    platform: Platform
    distribution: str
    version: str
    deprecations: tuple[str, ...] = ()  # deprecated hooks the installed plugins implement

    @property
    def label(self) -> str:
        return f"platform {self.platform.name!r} ({self.distribution} {self.version})"


def find_platform(name: str, options: Mapping[str, Any] | None = None) -> FoundPlatform:
    """The installed, available platform called ``name``, activated with ``options``; KitSetupError
    saying why not otherwise."""
    try:
        plugins = load_plugins(emit_warnings=False)
    except PluginError as exc:
        raise KitSetupError(str(exc)) from exc
    for entry in plugins.platforms:
        if entry.name != name:
            continue
        if not entry.availability.ok:
            raise KitSetupError(
                f"platform {name!r} ({entry.distribution} {entry.version}) is installed but unavailable here: "
                f"{entry.availability.reason}; run the kit where its hardware and runtime are present"
            )
        _activate(entry.platform, options)
        return FoundPlatform(entry.platform, entry.distribution, entry.version, plugins.deprecations)
    choices = "\n".join(f"  {e.name} ({e.distribution} {e.version})" for e in plugins.platforms) or "  (none)"
    raise KitSetupError(
        f"no platform named {name!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}); installed platforms:\n"
        f"{choices}\ninstall your plugin into this environment (pip install -e <your plugin folder>) and check that "
        f"its podium_platforms hook returns a Platform whose name is {name!r}"
    )


def _activate(platform: Platform, options: Mapping[str, Any] | None) -> None:
    try:
        values = resolve_options(platform.name, platform.options(), options)
    except ValueError as exc:
        raise KitSetupError(str(exc)) from None
    try:
        platform.activate(values)
    except Exception as exc:  # the platform's own failure: say where it came from
        raise KitSetupError(f"platform {platform.name!r}: activate() raised {type(exc).__name__}: {exc}") from exc

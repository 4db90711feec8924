"""The plugin API's semantic version.

A plugin declares the version it was built for (``Platform.api_version``). The core accepts a
plugin whose major version equals ``API_VERSION``'s major and whose minor is not newer than ours;
anything else is refused at discovery with an error naming the plugin and both versions.
"""

from __future__ import annotations

API_VERSION = "1.7.0"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.2.3"`` -> ``(1, 2, 3)``; missing parts are 0. Raises ValueError on garbage."""
    parts = str(text).strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a semantic version: {text!r} (expected MAJOR.MINOR.PATCH)")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def compatibility_problem(plugin_version: str, api_version: str = API_VERSION) -> str | None:
    """Why a plugin built for ``plugin_version`` cannot run on ``api_version``; None if it can."""
    try:
        p_major, p_minor, _ = parse_version(plugin_version)
    except ValueError as exc:
        return str(exc)
    a_major, a_minor, _ = parse_version(api_version)
    if p_major != a_major:
        return (
            f"it was built for plugin API {plugin_version} but this Podium provides {api_version} "
            f"(major versions differ); install a plugin release built for API {a_major}.x "
            f"or a Podium release providing API {p_major}.x"
        )
    if p_minor > a_minor:
        return (
            f"it needs plugin API {plugin_version} but this Podium provides only {api_version}; "
            f"upgrade podium-plugin-api and podium"
        )
    return None

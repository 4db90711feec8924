"""pytest plugin of the conformance kit: ``pytest --podium-platform NAME``.

Registered through pytest's ``pytest11`` entry point, so it is loaded in every pytest run of an
environment holding podium-plugin-api; without ``--podium-platform`` it does nothing. With it:

1. before collection, the suite module (``suite.py`` beside this file) is added to the paths
   pytest collects, so ``pytest --podium-platform NAME`` runs the suite from any folder (and
   alongside the vendor's own tests when paths are given too);
2. at configure time the platform is looked up by the contract's discovery (never through the
   core) and activated with its options (``--podium-platform-option NAME=VALUE``, repeated, then
   their environment aliases); a missing, broken or unavailable platform, or a bad option, stops
   the run with one clear usage error instead of a wall of failing tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..hookspecs import PluginApiDeprecationWarning
from ..version import API_VERSION

SUITE = Path(__file__).with_name("suite.py")
FOUND_KEY = pytest.StashKey["FoundPlatform"]()  # noqa: F821 -- imported lazily: no torch without the option


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("podium", "Podium platform conformance kit")
    group.addoption(
        "--podium-platform",
        action="store",
        default=None,
        metavar="NAME",
        help="run Podium's platform conformance suite against the installed platform NAME",
    )
    group.addoption(
        "--podium-platform-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a platform option for the platform under test (repeatable; see podium platforms --verbose)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Add the suite to the paths to collect (``args`` is the command line pytest is about to parse)."""
    if getattr(early_config.known_args_namespace, "podium_platform", None) and str(SUITE) not in args:
        args.append(str(SUITE))


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Give the suite a short node id (``podium-kit::test_...``) instead of a path outside the rootdir."""
    if module_path == SUITE:
        return pytest.Module.from_parent(parent, path=module_path, nodeid="podium-kit")
    return None


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("podium_platform", None)
    if not name:
        return
    from ..options import parse_option_pairs
    from .lookup import KitSetupError, find_platform  # torch loads only when the kit is asked for

    try:
        found = find_platform(name, parse_option_pairs(config.getoption("podium_platform_option")))
    except (KitSetupError, ValueError) as exc:
        raise pytest.UsageError(f"podium platform kit: {exc}") from None
    config.stash[FOUND_KEY] = found
    for message in found.deprecations:
        config.issue_config_time_warning(PluginApiDeprecationWarning(message), stacklevel=2)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    found = config.stash.get(FOUND_KEY, None)
    if found is None:
        return None
    try:
        backend = type(found.platform.attention_backend()).__name__
    except Exception as exc:  # reported by the suite's tests; the header only describes
        backend = f"<attention_backend() raised {type(exc).__name__}>"
    return [
        f"podium platform kit: {found.label}, attention backend {backend}, built for plugin API "
        f"{found.platform.api_version}, this podium-plugin-api is {API_VERSION}"
    ]

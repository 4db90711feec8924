"""pytest plugin entry point of the conformance kit; inactive unless ``--podium-platform`` is given."""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("podium", "Podium platform conformance kit")
    group.addoption(
        "--podium-platform",
        action="store",
        default=None,
        help="run Podium's platform conformance suite against the installed platform NAME",
    )

"""Podium's platform plugin contract.

A platform plugin depends on this package only: it subclasses ``Platform`` (and optionally
``AttentionBackend`` and ``GraphRunner``) and returns its platforms from a ``podium_platforms``
hook implementation registered under the ``podium`` entry-point group.
"""

from .attention import AttentionBackend
from .hookspecs import PROJECT_NAME, hookimpl, hookspec
from .metadata import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from .platform import Availability, Capabilities, GraphRunner, MemoryInfo, Platform
from .reference import reference_paged_attention
from .version import API_VERSION, compatibility_problem, parse_version

__all__ = [
    "API_VERSION",
    "PROJECT_NAME",
    "AttentionBackend",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "Availability",
    "Capabilities",
    "GraphRunner",
    "KVCacheSpec",
    "MemoryInfo",
    "Platform",
    "compatibility_problem",
    "hookimpl",
    "hookspec",
    "parse_version",
    "reference_paged_attention",
]

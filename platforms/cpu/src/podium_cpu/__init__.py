"""Podium's CPU platform plugin."""

from .platform import CpuPlatform

__all__ = ["CpuPlatform"]

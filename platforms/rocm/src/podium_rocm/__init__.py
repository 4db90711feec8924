"""Podium's AMD ROCm platform plugin. Importing it never imports triton."""

from .platform import RocmPlatform

__all__ = ["RocmPlatform"]

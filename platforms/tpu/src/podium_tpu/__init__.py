"""Podium's Google TPU platform plugin (torch-xla). Importing it never imports torch_xla."""

from .platform import TpuPlatform

__all__ = ["TpuPlatform"]

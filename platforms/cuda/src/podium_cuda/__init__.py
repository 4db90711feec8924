"""Podium's NVIDIA CUDA platform plugin. Importing it never imports triton."""

from .platform import CudaPlatform

__all__ = ["CudaPlatform"]

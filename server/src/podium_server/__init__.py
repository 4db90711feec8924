"""Podium's OpenAI-compatible server. Reaches the core only through ``podium``'s public API."""

__version__ = "0.1.0"

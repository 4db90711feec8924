"""Subcommands of the ``podium`` CLI that live in the core."""

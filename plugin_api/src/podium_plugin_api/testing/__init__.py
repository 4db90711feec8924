"""Conformance test kit for platform plugins (``pytest --podium-platform NAME``)."""

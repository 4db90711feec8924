"""The engine's typed errors. The server maps each class to an HTTP status and an OpenAI (or
Anthropic) error body by type, never by matching message text.

``InvalidParameter`` and its subclasses are the caller's fault (HTTP 400) and name the parameter;
``RequestFailed`` aborts one request after it entered the engine (HTTP 500-class, the others go on);
``EngineDead`` means the engine cannot serve anyone any more (HTTP 503, ``/health`` fails).
"""

from __future__ import annotations


class PodiumError(Exception):
    """Base of the errors the engine raises on purpose."""


class InvalidParameter(PodiumError, ValueError):
    """A request parameter the engine cannot honour. ``param`` names it (OpenAI's ``param`` field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidParameter):
    """The prompt (plus the requested tokens) does not fit the model's context."""

    def __init__(self, message: str, prompt_len: int, max_model_len: int, param: str | None = "messages") -> None:
        super().__init__(message, param)
        self.prompt_len, self.max_model_len = prompt_len, max_model_len


class ChatTemplateError(InvalidParameter):
    """The chat template could not render the messages (or the model has no template)."""


class RequestFailed(PodiumError):
    """One request was aborted inside the engine (a fault pinned to it); the others go on."""


class EngineDead(PodiumError):
    """The engine (device or worker process) is gone; every request fails fast until a restart."""

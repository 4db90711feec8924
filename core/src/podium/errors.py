"""The engine's typed errors. The server maps each class to an HTTP status and an OpenAI (or
Anthropic) error body by type, never by matching message text.

``InvalidParameter`` and its subclasses are the caller's fault (HTTP 400) and name the parameter;
``RequestFailed`` aborts one request after it entered the engine (HTTP 500-class, the others go on);
``EngineDead`` means the engine cannot serve anyone any more (HTTP 503, ``/health`` fails).
``StepFault`` is raised inside a step by code that knows which request caused a problem: the engine
aborts that request alone (``RequestFailed`` for its caller) and goes on.
"""

from __future__ import annotations


class PodiumError(Exception):
    """Base of the errors the engine raises on purpose. They pickle with their fields (a server's
    engine process sends them over a pipe)."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


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


class AdapterNotFound(InvalidParameter):
    """A request names a LoRA adapter the engine does not serve (HTTP 404). ``name`` is that name."""

    def __init__(self, message: str, name: str, param: str | None = "model") -> None:
        super().__init__(message, param)
        self.name = name


class RequestFailed(PodiumError):
    """One request was aborted inside the engine (a fault pinned to it); the others go on."""


class StepFault(PodiumError):
    """An exception inside an engine step pinned to one request: only ``request_id`` is aborted."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class EngineDead(PodiumError):
    """The engine (device or worker process) is gone; every request fails fast until a restart."""


def check_context(max_model_len: int, prompt_len: int, max_tokens: int | None) -> None:
    """``PromptTooLong`` unless the prompt plus the requested tokens fit the context (OpenAI's wording)."""
    if prompt_len >= max_model_len:
        raise PromptTooLong(
            f"This model's maximum context length is {max_model_len} tokens, but you requested {prompt_len} tokens "
            f"in the prompt, which leaves none for the completion. Please reduce the length of the prompt.",
            prompt_len, max_model_len, param="prompt")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise PromptTooLong(
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or the completion (max_tokens).",
            prompt_len, max_model_len, param="prompt")


def _rebuild(cls: type, args: tuple, fields: dict) -> PodiumError:
    error = Exception.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error

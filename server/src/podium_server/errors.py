"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` (and, on Anthropic's
``/v1/messages``, Anthropic's: ``{"type": "error", "error": {"type", "message"}}``).

Handlers raise ``APIError``; the exception handlers installed by ``install_error_handlers`` turn
it, pydantic validation errors, Starlette's HTTP errors (404 route, 405 method) and anything
unexpected into that body. A malformed request is always a 4xx.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from podium.errors import (
    AdapterNotFound,
    ChatTemplateError,
    EngineDead,
    InvalidParameter,
    PodiumError,
    PromptTooLong,
    RequestFailed,
)

logger = logging.getLogger("podium_server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status)


_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> APIError:
    return APIError(400, f"{feature} not supported yet by this server", param=param, code="not_supported")


def from_engine_error(exc: BaseException, prompt_param: str | None = None) -> APIError | None:
    """The API error for an exception the engine raised, chosen by its type (``podium.errors``);
    None for one that is not the engine's to report (a bug: the caller lets it through).
    ``prompt_param`` names the request field that holds the prompt ("prompt", "messages")."""
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, PromptTooLong):
        return bad_request(str(exc), param=prompt_param or exc.param, code="context_length_exceeded")
    if isinstance(exc, AdapterNotFound):
        return APIError(404, str(exc), param=exc.param, code="model_not_found")
    if isinstance(exc, ChatTemplateError):
        return bad_request(str(exc), param=exc.param if exc.param != "messages" else prompt_param or exc.param)
    if isinstance(exc, InvalidParameter):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, ValueError):  # the engine refusing a request without a typed error
        return bad_request(str(exc))
    return None


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One readable line per problem, e.g. ``temperature: Input should be less than or equal to 2 (got 3)``."""
    problems, first_param = [], None
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        where = ".".join(loc)
        if err.get("type") == "extra_forbidden":
            problems.append(f"Unrecognized request argument supplied: {where}")
        elif err.get("type") == "json_invalid":
            problems.append(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            got = f" (got {err['input']!r})" if "input" in err and _short(err["input"]) else ""
            problems.append(f"{where}: {msg}{got}" if where else msg)
        first_param = first_param or (loc[0] if loc else None)
    return bad_request("; ".join(problems) or "invalid request", param=first_param)


def _short(value: object) -> bool:
    return isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 80


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(is_anthropic(request.url.path))

    @app.exception_handler(PodiumError)
    async def _engine_error(_: Request, exc: PodiumError) -> JSONResponse:
        return (from_engine_error(exc) or APIError(500, str(exc))).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response(is_anthropic(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return APIError(exc.status_code, message).response(is_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        return error.response(is_anthropic(request.url.path))

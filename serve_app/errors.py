"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

`OpenAIError` is raised anywhere in the serving path; the HTTP layer renders it, a handle caller
receives it as an exception. 400 for bad input (FastAPI's 422 included), 401 for keys, 404 for
unknown models and routes, 429 when the queue is full, 503 while no healthy engine is available,
500 only for bugs. On Anthropic's Messages routes the same error is rendered in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with the same status.
"""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}
# The same errors in Anthropic's shape, on its Messages routes (`anthropic_error_body`).
MESSAGES_ROUTE = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


class OpenAIError(Exception):
    """An error with the HTTP status and the OpenAI error fields it is rendered with."""

    def __init__(self, message: str, status_code: int = 400, *, type: str | None = None,
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _TYPES.get(status_code, "server_error" if status_code >= 500
                                       else "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (_rebuild, (self.message, self.status_code, self.type, self.param, self.code,
                           self.retry_after_s))

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def to_response(self, path: str = "") -> JSONResponse:
        """The error as an HTTP response, in the shape of the route at `path`."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = anthropic_error_body(self) if is_messages_route(path) else self.to_dict()
        return JSONResponse(body, status_code=self.status_code, headers=headers)

    def sse_event(self) -> str:
        return f"data: {json.dumps(self.to_dict())}\n\n"


def _rebuild(message, status_code, type, param, code, retry_after_s) -> OpenAIError:
    return OpenAIError(message, status_code, type=type, param=param, code=code,
                       retry_after_s=retry_after_s)


def is_messages_route(path: str) -> bool:
    """Whether errors on `path` (under any route prefix) take Anthropic's shape."""
    return path.endswith(MESSAGES_ROUTE) or f"{MESSAGES_ROUTE}/" in path


def anthropic_error_body(exc: OpenAIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; the message names the field at fault,
    as Anthropic's body has no `param`."""
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    kind = _ANTHROPIC_TYPES.get(exc.status_code,
                                "api_error" if exc.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def renamed(exc: OpenAIError, names: dict[str, str]) -> OpenAIError:
    """The error naming its field as a door spells it: `names` maps a field of the chat or
    completion request (the head of a dotted param such as "messages.2.content") to the door's."""
    head, dot, rest = (exc.param or "").partition(".")
    if head not in names:
        return exc
    param = names[head] + dot + rest
    message = re.sub(rf"(?<![\w.]){re.escape(exc.param)}(?![\w.])", param, exc.message)
    return OpenAIError(message, exc.status_code, type=exc.type, param=param, code=exc.code,
                       retry_after_s=exc.retry_after_s)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param, code=code)


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than {limit} bytes.", 413,
                       code="request_too_large")


def request_timeout(timeout_s: float) -> OpenAIError:
    return OpenAIError(f"The request did not complete within request_timeout_s ({timeout_s:g} s).",
                       408, type="timeout_error", code="request_timeout")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", 404, param="model",
                       code="model_not_found")


def unauthorized(message: str = "Incorrect or missing API key.") -> OpenAIError:
    return OpenAIError(message, 401, code="invalid_api_key")


def overloaded(retry_after_s: int) -> OpenAIError:
    return OpenAIError("The engine is currently overloaded, please try again later.", 429,
                       code="engine_overloaded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(message, 503, code="service_unavailable", retry_after_s=retry_after_s)


def internal_error(exc: BaseException) -> OpenAIError:
    return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def from_validation_error(errors: list[dict]) -> OpenAIError:
    """The first pydantic/FastAPI validation error as one readable 400."""
    if not errors:
        return bad_request("invalid request body")
    error = errors[0]
    loc = [str(p) for p in error.get("loc", ()) if p not in ("body",)]
    # Drop pydantic's union-branch names ("str", "list[int]", "function-after[...]").
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "list")]
    param = ".".join(loc) or None
    if error.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON body: {error.get('ctx', {}).get('error', error['msg'])}",
                           code="invalid_json")
    if error.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if error.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param)
    message = error.get("msg", "invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    given = error.get("input")
    shown = "" if isinstance(given, (dict, list)) or given is None else f" (got {given!r})"
    return bad_request(f"Invalid value for '{param}': {message}{shown}" if param else message,
                       param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.to_response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return from_validation_error(list(exc.errors())).to_response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return OpenAIError(message, exc.status_code).to_response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        logger.exception("unhandled error in the serving path")
        return internal_error(exc).to_response(request.url.path)

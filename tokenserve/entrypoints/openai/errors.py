"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}`.

Every failure of a request becomes one of these bodies with its HTTP status: 400 for
invalid parameters (ValueError from the Processor or SamplingParams, and pydantic's
validation errors), 401 for a missing or wrong API key, 404 for an unknown model,
413 for a body over --max-request-body-size, 431 for too many headers, 503 (with
Retry-After) when the server is full or shutting down, 500 when the engine is gone.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenserve.engine.core_client import EngineDeadError
from tokenserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """A request failed in a way the client should hear about, with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503

    def to_response(self) -> ErrorResponse:
        error_type = _ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase)
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code)
        )


def error_from_exception(error: BaseException) -> OpenAIError:
    """The OpenAIError a request's exception maps to."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, ValueError):
        return OpenAIError(400, str(error))
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"The engine is not running: {error}", code="engine_dead")
    logger.exception("Unexpected error while serving a request.", exc_info=error)
    return OpenAIError(500, f"Internal server error: {type(error).__name__}: {error}")


def error_json(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error.to_response().model_dump(), status_code=error.status, headers=error.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error_json(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_json(OpenAIError(400, *_describe_validation_error(error)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_json(OpenAIError(error.status_code, str(error.detail)))

    @app.exception_handler(ValueError)
    async def value_error(request: Request, error: ValueError) -> JSONResponse:
        return error_json(error_from_exception(error))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return error_json(error_from_exception(error))


def _describe_validation_error(error: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic's error list."""
    messages = []
    param = None
    for item in error.errors():
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        where = ".".join(location)
        if param is None and location:
            param = location[0]
        messages.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(messages) or "Invalid request.", param

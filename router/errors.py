"""OpenAI-shaped errors: one exception type, and handlers that give every failure the same body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.router")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


class APIError(Exception):
    """An error the client should see as `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid_body(errors: list[dict]) -> APIError:
    """The 400 for a body pydantic rejected (FastAPI would answer 422), naming its first error.
    A body that is not JSON has no field to blame: `param` is null, the position is in the message."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # FastAPI puts the character position in `loc`
        position = next((part for part in first.get("loc", ()) if isinstance(part, int)), None)
        return not_json(position)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request body").removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", loc[0] if loc else None)


def not_json(position: int | None) -> APIError:
    where = f" (at character {position})" if position is not None else ""
    return APIError(400, f"request body is not valid JSON{where}")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return invalid_body(list(error.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # Starlette's own headers stay: a 405 carries `Allow`, listing the route's methods.
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error").response()

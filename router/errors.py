"""OpenAI-shaped errors: one exception type, and handlers that give every failure the same body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.router")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
               504: "TimeoutError"}


class APIError(Exception):
    """An error the client should see as `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request body").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error").response()

"""OpenAI-style error answers: {"error": {"message", "type", "param", "code"}} with the right status.

FastAPI answers a bad body with 422 and its own shape; OpenAI clients expect 400 and this shape, so the
gateway installs handlers that translate validation errors, malformed JSON and HTTP exceptions.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from alignedserve.gateway.protocol import ErrorInfo, ErrorResponse, ParamError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's, with code "invalid_api_key"
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI error body with `status`."""

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
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(
            message=self.message, type=_TYPES.get(self.status, "error"), param=self.param, code=self.code
        )
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_to_api_error(exc: RequestValidationError) -> APIError:
    """The first problem, phrased for a client: which parameter and what is wrong with it."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    error = errors[0]
    if error.get("type") == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ParamError):
        return bad_request(str(cause), param=cause.param)
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = _param_name(loc)
    if error.get("type") == "missing":
        return bad_request(f"missing required parameter: {param}", param=param)
    if error.get("type") == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {param}", param=param)
    if param is None:
        return bad_request(_strip_prefix(str(error.get("msg", "invalid request"))))
    message = f"invalid value for {param}: {_strip_prefix(str(error.get('msg', '')))}"
    if "input" in error and error.get("type") != "model_attributes_type":
        message += f" (got {_short(error['input'])})"
    return bad_request(message, param=param)


def _param_name(loc: list[str]) -> str | None:
    # Union members add their type to the location (prompt.str, prompt.list[int].0); keep the field path.
    parts = [p for p in loc if not any(c in p for c in "[]") and p not in {"str", "int", "float", "bool"}]
    return ".".join(parts) if parts else None


def _strip_prefix(message: str) -> str:
    return message.removeprefix("Value error, ")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

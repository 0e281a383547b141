"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedq.worker.protocol.job import FinalRecord

# status -> OpenAI's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


DEEP_JSON = "the JSON body is nested too deeply"


class RaisedOpenAIError(StarletteHTTPException):
    """An OpenAIError raised from `receive` (the body's cap and deadline, intake.py): FastAPI passes only
    HTTPExceptions through its body reading (anything else becomes "There was an error parsing the body")."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


def record_error(record: FinalRecord) -> OpenAIError:
    """The HTTP error for a job that did not complete (its final record's status and reason)."""
    status = {"rejected": 400, "expired": 504, "cancelled": 409}.get(record.status, 500)
    return OpenAIError(status, f"job {record.id} {record.status}: {record.error or record.status}", code=record.status)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = param or where
        if err.get("type") == "extra_forbidden":
            parts.append(f"{where}: unsupported field")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return JSONResponse(
        OpenAIError(400, "; ".join(parts) or "invalid request", param=param, code="invalid_request").body(),
        status_code=400,
    )


def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc, RaisedOpenAIError):
        return _openai_error(_, exc.error)
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
        return _openai_error(_, OpenAIError(400, DEEP_JSON, param="body", code="invalid_request"))
    return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


def install(app: FastAPI) -> None:
    # Starlette types every handler as taking Exception, though it calls each only with the class it is
    # registered for: a handler typed with that class is right, and mypy cannot see it.
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]

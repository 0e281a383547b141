"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from functools import partial

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedq.engine.errors import ContextLengthExceeded
from pagedq.worker.protocol.job import FinalRecord

CONTEXT_LENGTH_EXCEEDED = ContextLengthExceeded.code
# A failure that retrying the same request cannot mend: OpenAI's SDKs honour this header before their status rules
NO_RETRY = {"x-should-retry": "false"}

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


def record_error(record: FinalRecord, prompt_param: str | None = None) -> OpenAIError:
    """The HTTP error for a job that did not complete (its final record's status and reason). A prompt too long for
    the model's context is OpenAI's and vLLM's 400 (code context_length_exceeded, their message, param: the request's
    prompt field), which client libraries recognise. An expired job is not worth retrying as it was (504 with
    x-should-retry: false: the SDK would enqueue it again, twice, by default)."""
    if record.error_code == CONTEXT_LENGTH_EXCEEDED:
        return OpenAIError(400, record.error or CONTEXT_LENGTH_EXCEEDED, param=prompt_param, code=record.error_code)
    status = {"rejected": 400, "expired": 504, "cancelled": 409}.get(record.status, 500)
    headers = NO_RETRY if record.status == "expired" else None
    message = f"job {record.id} {record.status}: {record.error or record.status}"
    return OpenAIError(status, message, code=record.status, headers=headers)


# Redis unreachable, refusing, silent past the socket timeout, or no free connection in time: the gateway can take
# nothing in or give nothing out; the client may retry (Retry-After)
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def redis_full(exc: Exception) -> bool:
    """Whether Redis refused a write for want of memory (maxmemory with noeviction, docs/security.md): a plain
    command's OOM error, or the same inside a script's error (Redis 6.2 wraps it)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.exceptions.ResponseError) and "OOM command not allowed" in str(exc)
    )


def redis_unavailable(exc: Exception, retry_after_s: int) -> OpenAIError:
    """A Redis that is lost, silent or full takes no work in until it recovers (a full one: as results expire)."""
    state = "full (maxmemory)" if redis_full(exc) else "unavailable"
    return OpenAIError(
        503,
        f"the queue's Redis is {state} ({type(exc).__name__}); retry later",
        code="redis_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def failure_after_submission(exc: Exception, job_ids: list[str], retry_after_s: int) -> OpenAIError:
    """The answer to a request whose wait for its submitted jobs failed (the caller cancels them)."""
    if isinstance(exc, REDIS_DOWN) or redis_full(exc):
        return redis_unavailable(exc, retry_after_s)
    return OpenAIError(
        500, f"job {job_ids[0]}: reading its results failed ({type(exc).__name__}); its jobs were cancelled"
    )


def _redis_error(retry_after_s: int, _: Request, exc: Exception) -> JSONResponse:
    return _openai_error(_, redis_unavailable(exc, retry_after_s))


def _redis_refusal(retry_after_s: int, request: Request, exc: Exception) -> JSONResponse:
    """A command Redis refused: for want of memory, as unavailable; anything else is the gateway's fault (500)."""
    if redis_full(exc):
        return _redis_error(retry_after_s, request, exc)
    return _openai_error(request, OpenAIError(500, f"the queue's Redis refused a command ({type(exc).__name__})"))


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
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


def install(app: FastAPI, retry_after_s: int = 1) -> None:
    # Starlette types every handler as taking Exception, though it calls each only with the class it is
    # registered for: a handler typed with that class is right, and mypy cannot see it.
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    for redis_error in REDIS_DOWN:
        app.add_exception_handler(redis_error, partial(_redis_error, retry_after_s))
    app.add_exception_handler(redis.exceptions.ResponseError, partial(_redis_refusal, retry_after_s))

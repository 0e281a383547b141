"""x-request-id on every answer of the gateway, refusals included (OpenAI's header, which its SDKs show as an
error's or a response's request id): the client's own when it sent a sane one, else a new one. The id is bound to
every log line of the request (structlog's contextvars) and kept as scope["state"]["request_id"]."""

from __future__ import annotations

import re
import uuid

import structlog
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# A client's id is echoed only when it is short and plain: it goes into a header and into logs
SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(given: str | None) -> str:
    """The client's id when sane, else a new one."""
    return given if given is not None and SANE_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"


class RequestIds:
    """A pure ASGI middleware, outermost: whatever answers inside it, the answer carries the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope).get(HEADER))
        scope.setdefault("state", {})["request_id"] = request_id
        header = (HEADER.encode(), request_id.encode())

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, sending)

"""What a request goes through before any route runs, as one pure ASGI middleware (nothing is buffered).

In order, from the headers alone:
  1. `Host` and `Origin` (a keyless gateway; `Host` also when allowed_hosts is set): DNS rebinding and cross-site
     form posts get 403;
  2. the Bearer key on /v1/*, /tokenize and /detokenize (constant time per key, every key compared): 401;
     the key's tenant and owner (owners.py) go into scope["state"], read by routes as request.state.tenant/owner;
  3. the route's body cap: a Content-Length over it gets 413 before a byte is read.
Then, while the route reads the body: the bytes are counted (a chunked body gets 413 once over the cap) and must
keep coming (408 past body_timeout_s plus a second per body_min_rate bytes, as Apache's mod_reqtimeout).
Every answer given here closes the connection, so the rest of a refused body is never read.

FastAPI's own max_body_size (Starlette's RequestBodyLimitMiddleware) is not used: the body's deadline needs the same
`receive` wrapper anyway, and its answer to a Content-Length over the cap, on a route that reads no body, is a
plain-text 413 rather than OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedq.worker.gateway.errors import DEEP_JSON, OpenAIError, RaisedOpenAIError
from pagedq.worker.gateway.files import MAX_FILE_BYTES
from pagedq.worker.gateway.owners import owner_of
from pagedq.worker.gateway.settings import GatewaySettings

Model = TypeVar("Model", bound=BaseModel)

AUTHENTICATED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
UPLOAD_ROUTE = ("POST", "/v1/files")
MULTIPART_OVERHEAD = 1024 * 1024  # the form's boundaries, part headers and the `purpose` field around the file
LOCAL_NAMES = frozenset({"localhost"})


class KeyRing:
    """The accepted API keys and the tenant each maps to (None: a plain key)."""

    def __init__(self, keys: list[str], tenants: dict[str, str]) -> None:
        self.entries = [(key, key.encode(), tenants.get(key)) for key in keys]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def identify(self, authorization: str) -> tuple[str | None, str] | None:
        """(tenant, owner) of a valid `Authorization: Bearer <key>` header, else None."""
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        # every key compared (constant time per key), so the match's position does not leak through timing
        matches = [(key, tenant) for key, encoded, tenant in self.entries if hmac.compare_digest(given, encoded)]
        if scheme.lower() != "bearer" or not matches:
            return None
        key, tenant = matches[0]
        return tenant, owner_of(key, tenant)


class HostPolicy:
    """Which `Host` and `Origin` headers a gateway accepts (DNS rebinding, cross-site posts)."""

    def __init__(self, bound_host: str, allowed: list[str], check_origin: bool) -> None:
        self.any = "*" in allowed
        self.explicit = frozenset(h.lower() for h in allowed)
        self.names = LOCAL_NAMES | self.explicit | {bound_host.lower().strip("[]")}
        self.check_origin = check_origin

    def refusal(self, headers: Headers) -> str | None:
        """Why the request is refused, or None."""
        host = headers.get("host", "")
        if not self.any and not self._known(urlsplit("//" + host).hostname or ""):
            return f"Host {host!r} is not served here (a local name, an IP address or PAGEDQ_ALLOWED_HOSTS)"
        origin = headers.get("origin")
        if not self.check_origin or origin is None or self.any:
            return None
        parts = urlsplit(origin)
        if origin != "null" and (parts.netloc.lower() == host.lower() or (parts.hostname or "") in self.explicit):
            return None
        return f"cross-site requests are refused (Origin {origin!r}; same-origin or PAGEDQ_ALLOWED_HOSTS)"

    def _known(self, name: str) -> bool:
        """A rebinding attack always carries the attacker's DNS name, never an IP address."""
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return name in self.names


class Intake:
    """The pure ASGI middleware (see the module's docstring)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, routes: list[Any]) -> None:
        self.app, self.settings, self.routes = app, settings, routes
        self.keys = KeyRing(settings.accepted_keys, settings.api_key_tenants)
        keyless = not self.keys
        self.hosts = HostPolicy(settings.host, settings.allowed_hosts, check_origin=keyless)
        self.check_hosts = keyless or bool(settings.allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._name_route(scope)
        cap = self._cap(scope)
        try:
            self._admit(scope, Headers(scope=scope), cap)
        except OpenAIError as error:
            await _answer(error, scope, receive, send)
            return
        await self.app(scope, _BodyReader(receive, cap, self.settings).receive, _closing_on_refusal(send))

    def _admit(self, scope: Scope, headers: Headers, cap: int) -> None:
        if self.check_hosts and (why := self.hosts.refusal(headers)):
            raise OpenAIError(403, why, code="forbidden_host")
        path = scope["path"]
        if self.keys and path.startswith(AUTHENTICATED_PREFIXES):
            identity = self.keys.identify(headers.get("authorization", ""))
            if identity is None:
                raise _unauthenticated()
            state = scope.setdefault("state", {})
            state["tenant"], state["owner"] = identity
        length = headers.get("content-length", "")  # uvicorn's parser refuses a malformed one
        if length.isdigit() and int(length) > cap:
            raise _too_large(cap)

    def _cap(self, scope: Scope) -> int:
        if (scope["method"], scope["path"]) == UPLOAD_ROUTE:
            return MAX_FILE_BYTES + MULTIPART_OVERHEAD
        return self.settings.max_json_bytes

    def _name_route(self, scope: Scope) -> None:
        """The matched route on the scope before any answer here, so metrics and logs name it (ObserveRequests)."""
        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                scope["route"] = child.get("route", route)
                return


class _BodyReader:
    """The route's `receive`: counts the body against the cap and times its arrival; untimed once it is complete
    (a route then waits for the client's disconnect)."""

    def __init__(self, receive: Receive, cap: int, settings: GatewaySettings) -> None:
        self.inner, self.cap = receive, cap
        self.timeout_s, self.min_rate = settings.body_timeout_s, settings.body_min_rate
        self.started = time.monotonic()
        self.received = 0
        self.complete = False

    async def receive(self) -> Message:
        if self.complete:
            return await self.inner()
        allowed = self.started + self.timeout_s + self.received / self.min_rate - time.monotonic()
        try:
            message = await asyncio.wait_for(self.inner(), timeout=max(allowed, 0.0))
        except TimeoutError:
            raise RaisedOpenAIError(
                OpenAIError(
                    408,
                    f"the request body did not arrive in time ({self.received} bytes; PAGEDQ_BODY_TIMEOUT_S, "
                    "PAGEDQ_BODY_MIN_RATE)",
                    code="timeout",
                )
            ) from None
        if message["type"] != "http.request":
            self.complete = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.cap:
            raise RaisedOpenAIError(_too_large(self.cap))
        self.complete = not message.get("more_body", False)
        return message


def _unauthenticated() -> OpenAIError:
    return OpenAIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


def _too_large(cap: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this route takes ({cap} bytes)", code="body_too_large")


REFUSALS = frozenset({401, 403, 408, 413})


def _closing_on_refusal(send: Send) -> Send:
    """Adds `Connection: close` to a refusal, so that uvicorn reads nothing more of its body."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] in REFUSALS:
            message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
        await send(message)

    return sending


async def _answer(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    headers = {**error.headers, "connection": "close"}
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


async def parse_body(request: Request, model: type[Model]) -> Model:
    """The request's JSON body as `model`, validated as FastAPI did (json.loads, then `model_validate`: measured
    faster than pydantic-core's `model_validate_json` on token-id prompts, whose union errors it copies), but a body
    nested past Python's recursion limit is a 400 that says so (FastAPI's: "There was an error parsing the body").
    It runs on the event loop: both parsers hold the GIL, so a thread would not let the loop run meanwhile;
    max_json_bytes bounds how long one body can take (docs/gateway.md)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise OpenAIError(400, "the body must be JSON (Content-Type: application/json)", code="invalid_request")
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise OpenAIError(400, DEEP_JSON, param="body", code="invalid_request") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise OpenAIError(400, f"the body is not valid JSON: {exc}", param="body", code="invalid_request") from None
    await asyncio.sleep(0)  # other requests get a turn between the two: the loop stalls for the longer, not the sum
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_input=False)]
        raise RequestValidationError(errors) from None


def require_key(keys: KeyRing) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: Intake authenticated the request (a route outside its prefixes still needs a key)."""

    async def check(request: Request) -> None:
        if keys and "owner" not in request.scope.get("state", {}):
            raise _unauthenticated()

    return check

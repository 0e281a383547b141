"""The FastAPI application of `pagedq serve`: routes, authentication, the shared AsyncClient."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.gateway import errors
from pagedq.worker.gateway.batch_routes import router as batch_router
from pagedq.worker.gateway.batches import Batches
from pagedq.worker.gateway.chat import ChatEndpoint
from pagedq.worker.gateway.completions import CompletionEndpoint
from pagedq.worker.gateway.errors import NO_RETRY, OpenAIError, failure_after_submission, record_error
from pagedq.worker.gateway.files import FileStore
from pagedq.worker.gateway.files import router as file_router
from pagedq.worker.gateway.intake import Intake, KeyRing, parse_body, require_key
from pagedq.worker.gateway.jobs import build, resolve_model, submit, wait_timeout
from pagedq.worker.gateway.lora_routes import lora_router
from pagedq.worker.gateway.metrics import GatewayMetrics, ObserveRequests
from pagedq.worker.gateway.preflight import say_what_is_missing
from pagedq.worker.gateway.prompt_limits import PromptLimits
from pagedq.worker.gateway.render import now
from pagedq.worker.gateway.request_ids import RequestIds
from pagedq.worker.gateway.responses import router as responses_router
from pagedq.worker.gateway.schemas import ChatCompletionRequest, CompletionRequest
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.streaming import SSEResponse, StreamTracker, hold_start, sse
from pagedq.worker.gateway.tokenize import Tokenizers
from pagedq.worker.gateway.tokenize import router as tokenize_router
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol.connection import AsyncRedis, ConnectionLimits, connect_async
from pagedq.worker.protocol.errors import ResultTimeout
from pagedq.worker.telemetry import provider

SHUTDOWN_WAIT_S = 5.0  # what a stopping gateway gives its batch runs and stream cancels before it closes Redis


class Gateway:
    """What the routes share: settings, the queue client, the live-worker view, open streams."""

    def __init__(self, settings: GatewaySettings, redis: AsyncRedis | None = None) -> None:
        self.settings = settings
        limits = ConnectionLimits(
            settings.redis_max_connections, settings.redis_connect_timeout_s, settings.redis_socket_timeout_s
        )
        self.client = AsyncClient(
            settings.redis_url,
            settings.queue,
            max_queue_depth=settings.max_queue_depth,
            max_tenant_queued=settings.max_tenant_queued,
            redis=redis if redis is not None else connect_async(settings.redis_url, limits),
            shared_reads=True,  # every wait on one blocking read: open requests hold no connection each
            read_buffer=settings.stream_buffer,
        )
        self.live = LiveWorkers(self.client.r, self.client.keys, settings.worker_cache_s)
        self.streams = StreamTracker()
        self.files = FileStore(self.client.r, self.client.keys, settings)
        self.batches = Batches(self.client, self.files, self.live, settings)
        self.tokenizers = Tokenizers(self.client.r, self.client.keys, self.live, settings.queue)
        self.prompt_limits = PromptLimits(self.client.r, self.client.keys, settings.worker_cache_s)

    async def generate(self, endpoint: CompletionEndpoint, request: Request) -> Response:
        body = endpoint.request_body()
        base, lora = await resolve_model(self.live, body.model, self.settings.queue)
        endpoint.model = lora or base  # an adapter's answers name the adapter, as vLLM's
        adapter = {"lora": lora} if lora is not None else {}
        jobs = [build(fields | adapter) for fields in endpoint.jobs_fields(self.settings)]
        if (tenant := getattr(request.state, "tenant", None)) is not None:  # set with the API key (_authenticate)
            jobs = [job.model_copy(update={"tenant": tenant}) for job in jobs]
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        # too long by its size alone: 400 before queuing
        await self.prompt_limits.check(base, jobs, endpoint.prompt_param)
        job_ids = await submit(self.client, jobs, self.settings.retry_after_s)  # all or none: backpressure counts each
        timeout = wait_timeout(body, self.settings)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            retry_after_s = self.settings.retry_after_s
            events = sse(self.client, endpoint, job_ids, include_usage, timeout, self.streams, retry_after_s)
            started = await hold_start(events, _disconnected(request))  # a refusal before any token: its status
            return SSEResponse(started, self.settings.stream_send_timeout_s)
        try:
            records = await self._results_while_connected(request, job_ids, timeout)
        except Exception as exc:  # whatever ends the wait, nobody will read these jobs: they are cancelled
            for job_id in job_ids:
                self.streams.cancel_later(self.client, job_id)
            if isinstance(exc, OpenAIError):  # the client left (499)
                raise
            if isinstance(exc, ResultTimeout):
                raise OpenAIError(
                    504, f"job {job_ids[0]}: no result within {timeout} s", code="timeout", headers=NO_RETRY
                ) from None
            raise failure_after_submission(exc, job_ids, self.settings.retry_after_s) from exc
        for record in records:
            if record.status != "completed":
                raise record_error(record, endpoint.prompt_param)
        return JSONResponse(endpoint.response(records))

    async def models(self) -> dict[str, Any]:
        """GET /v1/models: what the live workers serve, then the LoRA adapters (`parent`: their base model)."""
        served = await self.live.models()
        adapters = await self.live.adapters()
        return {
            "object": "list",
            "data": [_model_object(name, info) for name, info in sorted(served.items())]
            + [_adapter_object(name, info) for name, info in sorted(adapters.items())],
        }

    async def model(self, model: str) -> dict[str, Any]:
        """GET /v1/models/{model}: a served model by its id (or its workers' path, as requests may name it), or a
        LoRA adapter by its name."""
        served = await self.live.models()
        for name, info in served.items():
            if model in (name, info.get("path")):
                return _model_object(name, info)
        adapters = await self.live.adapters() if served else {}
        if model in adapters:
            return _adapter_object(model, adapters[model])
        listed = ", ".join([*sorted(served), *sorted(adapters)]) or "none: no live worker"
        raise OpenAIError(
            404, f"model {model!r} is not served here (served: {listed})", param="model", code="model_not_found"
        )

    async def health(self) -> JSONResponse:
        """GET /health: 503 while Redis is unreachable (the gateway can take nothing in)."""
        try:  # bounded as a whole: a silent server fails the probe within the connect timeout
            live = await asyncio.wait_for(self._probe(), self.settings.redis_connect_timeout_s)
        except Exception as exc:
            reason = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
            return JSONResponse({"status": "unavailable", "redis": reason}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "redis": "ok",
                "live_workers": len(live),
                "open_streams": self.streams.open,
                "buffered_results": self.client.shared.buffered if self.client.shared is not None else 0,
            }
        )

    async def _probe(self) -> list[dict]:
        await self.client.r.ping()
        return await self.live.heartbeats()

    async def _results_while_connected(self, request: Request, job_ids: list[str], timeout: float):
        """The jobs' final records; if the client goes away first, every job is cancelled (nobody will read them)."""
        reads = [asyncio.ensure_future(self.client.result(job_id, timeout=timeout)) for job_id in job_ids]
        waiter = asyncio.gather(*reads)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
            answered = waiter.done()
        finally:
            gone.cancel()
            for read in reads:  # one read failed (timed out) or the client left: the others are not needed
                read.cancel()
        if answered:
            return waiter.result()
        waiter.cancel()
        raise OpenAIError(
            499, f"job {job_ids[0]}: the client closed the connection; its jobs were cancelled", code="client_closed"
        )


def _model_object(name: str, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": info["created"],
        "owned_by": "pagedq",
        "root": info.get("path") or name,
        "parent": None,
        "workers": info["workers"],
    }


def _adapter_object(name: str, info: dict[str, Any]) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists one: `root` its folder, `parent` the model it adapts."""
    return {
        "id": name,
        "object": "model",
        "created": info["created"],
        "owned_by": "pagedq",
        "root": info["root"],
        "parent": info["parent"],
    }


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: GatewaySettings | None = None, redis: AsyncRedis | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gateway = Gateway(settings, redis)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        structlog.get_logger("pagedq.gateway").info(
            "gateway_started",
            queue=settings.queue,
            host=settings.host,
            port=settings.port,
            auth=bool(settings.accepted_keys),
        )
        await say_what_is_missing(settings, gateway._probe)
        yield
        for task in list(gateway.batches.tasks):  # their lease expires: the next GET on any gateway resumes them
            task.cancel()
        # Bounded: a run cancelled inside one of redis-py's shielded commands waits for that command, which closing
        # the client below ends; an unbounded wait kept a stopping gateway alive, renewing its batches' leases.
        pending = {*gateway.batches.tasks, *gateway.streams.cancels}
        if pending:
            await asyncio.wait(pending, timeout=SHUTDOWN_WAIT_S)
        await gateway.client.aclose()

    app = FastAPI(title="pagedq gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    errors.install(app, settings.retry_after_s)
    metrics = GatewayMetrics(lambda: gateway.streams.open)
    # Intake authenticates and bounds every request before its body is read; ObserveRequests (added after: outside)
    # counts what Intake refuses too
    app.add_middleware(Intake, settings=settings, routes=app.router.routes)
    app.add_middleware(ObserveRequests, metrics=metrics)
    app.add_middleware(RequestIds)  # outermost: every answer, and every log line of the request, carries the id
    auth = Depends(require_key(KeyRing(settings.accepted_keys, settings.api_key_tenants)))
    app.include_router(file_router(gateway.files, auth))
    app.include_router(batch_router(gateway.batches, auth))
    app.include_router(tokenize_router(gateway.tokenizers, auth))
    app.include_router(responses_router(gateway.generate, auth))
    if settings.allow_runtime_lora_updating:  # as vLLM: the routes exist only when switched on
        app.include_router(lora_router(gateway.client.r, gateway.live, settings.admin_api_keys, auth))
    if (tracer_provider := provider()) is not None:  # tracing on (OTEL_* variables): the standard instrumentations
        from pagedq.worker.gateway.tracing import instrument

        instrument(app, gateway.client.r, tracer_provider)

    # the bodies are parsed by parse_body, off the event loop when large
    @app.post("/v1/completions", dependencies=[auth])
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await gateway.generate(CompletionEndpoint(body, body.model, now()), request)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await gateway.generate(ChatEndpoint(body, body.model, now()), request)

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> dict[str, Any]:
        return await gateway.models()

    @app.get("/v1/models/{model:path}", dependencies=[auth])  # a path: a model may be named by its folder's path
    async def model(model: str) -> dict[str, Any]:
        return await gateway.model(model)

    @app.get("/metrics")
    async def prometheus() -> Response:
        payload, content_type = metrics.exposition()
        return Response(payload, media_type=content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await gateway.health()

    return app

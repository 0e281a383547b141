"""From an OpenAI request body to one queue job, and its submission (errors mapped to OpenAI's)."""

from __future__ import annotations

import time
from typing import Any

from pagedq.worker.client.async_client import AsyncClient
from pagedq.worker.client.core import make_job
from pagedq.worker.gateway.constraints import structured_outputs_of
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.schemas import SamplingBody
from pagedq.worker.gateway.settings import GatewaySettings
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol.errors import JobRejected, QueueFullError
from pagedq.worker.protocol.job import SAMPLING_FIELDS, Job, from_vllm_priority, new_job_id

# The job's sampling fields the shared body carries under their own names (max_tokens and logprobs are each
# endpoint's: the caller passes the one, CompletionEndpoint/ChatEndpoint set the other)
BODY_SAMPLING_FIELDS = tuple(name for name in SAMPLING_FIELDS if name in SamplingBody.model_fields)


def sampling_fields(body: SamplingBody, settings: GatewaySettings, max_tokens: int | None) -> dict[str, Any]:
    """Job keywords shared by completions and chat; fields the client left out keep the job's defaults. max_tokens
    None: the rest of the model's context after the prompt (the worker works it out)."""
    fields: dict[str, Any] = {
        name: getattr(body, name) for name in BODY_SAMPLING_FIELDS if getattr(body, name) is not None
    }
    if isinstance(body.stop, str):
        fields["stop"] = [body.stop]
    fields.update(
        max_tokens=max_tokens,
        stream=body.stream,
        priority=from_vllm_priority(body.priority),
    )
    if body.timeout is not None:
        if body.timeout > settings.max_timeout_s:
            raise OpenAIError(400, f"timeout must be at most {settings.max_timeout_s} s", param="timeout")
        fields["deadline"] = time.time() + body.timeout
    if body.user is not None:
        fields["metadata"] = {"user": body.user}
    fields.pop("structured_outputs", None)  # vLLM's, or response_format, or tools: one of them
    constraint = structured_outputs_of(body, settings.max_tool_calls)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    return fields


def build(fields: dict[str, Any]) -> Job:
    try:
        return make_job(job_id=new_job_id(), **fields)
    except JobRejected as exc:
        raise OpenAIError(400, str(exc), code="invalid_request") from None


async def check_model(live: LiveWorkers, model: str, queue: str) -> str:
    """resolve_model's base model id (a LoRA adapter's name: the model it adapts)."""
    return (await resolve_model(live, model, queue))[0]


async def resolve_model(live: LiveWorkers, model: str, queue: str) -> tuple[str, str | None]:
    """What a request's `model` names: (the base model's id, None), or (its base model's id, the adapter's name) for
    a LoRA adapter (the workers' --lora-modules and the queue's registry, as vLLM's `model` field selects one).
    503 when no worker is alive on the queue, 404 (OpenAI's model_not_found) when nothing of that name is served."""
    models = await live.models()
    if not models:
        raise OpenAIError(
            503, f"no live worker serves queue {queue!r}", code="no_live_worker", headers={"Retry-After": "5"}
        )
    for name, info in models.items():
        if model in (name, info.get("path")):
            return name, None
    adapters = await live.adapters()
    if model in adapters:
        return adapters[model]["parent"], model
    listed = ", ".join([*sorted(models), *sorted(adapters)])
    raise OpenAIError(
        404,
        f"model {model!r} is not served here (served: {listed})",
        param="model",
        code="model_not_found",
    )


async def submit(client: AsyncClient, jobs: list[Job], retry_after_s: int) -> list[str]:
    """Every job of a request in one submission: all are queued, or none (429 when they do not all fit)."""
    try:
        return await client.submit_many(jobs)
    except QueueFullError as exc:
        raise OpenAIError(
            429, f"the queue is full: {exc}", code="queue_full", headers={"Retry-After": str(retry_after_s)}
        ) from None
    except JobRejected as exc:
        raise OpenAIError(400, str(exc), code="invalid_request") from None


def wait_timeout(body: SamplingBody, settings: GatewaySettings) -> float:
    """How long a non-streamed request waits for its final record: a little past the job's deadline."""
    return (body.timeout + 5.0) if body.timeout is not None else settings.max_timeout_s

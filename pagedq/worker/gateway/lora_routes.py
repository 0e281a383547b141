"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's names and bodies (issue 36), mounted only with
allow_runtime_lora_updating (off by default, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

They write the queue's registry (protocol/registry.py), not any one worker: every worker of the queue reads it, loads
an adapter from its path on its first job (so the path must be one every worker can read: absolute), and drops one
that leaves it once its running jobs finish. The gateway cannot check the folder (it need not see the workers'
disks): a folder that does not load is the error of each job naming it, which says why.

A registered adapter serves every tenant of the queue and its path is read by every worker, so with API keys only
an admin key (admin_api_keys) may call these; a keyless gateway (bound to this machine by default) is one caller."""

from __future__ import annotations

import hmac
import posixpath
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from pagedq.engine.lora.request import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS
from pagedq.worker.gateway.errors import OpenAIError
from pagedq.worker.gateway.intake import parse_body
from pagedq.worker.gateway.schemas import Strict
from pagedq.worker.gateway.workers import LiveWorkers
from pagedq.worker.protocol import registry


class LoadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)


class UnloadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = Field(default=None, ge=0)  # vLLM's clients may send it; names identify adapters here


def require_admin(admin_keys: list[str]) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: with admin keys set, the request's Bearer key must be one of them (constant time per key,
    every key compared); Intake has already refused requests without a valid key."""
    encoded = [key.encode() for key in admin_keys]

    async def check(request: Request) -> None:
        if not encoded:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any([hmac.compare_digest(given, key) for key in encoded]):
            raise OpenAIError(403, "only an admin API key may load or unload LoRA adapters", code="forbidden")

    return check


def lora_router(r: Any, live: LiveWorkers, admin_keys: list[str], auth: Any) -> APIRouter:
    router = APIRouter(dependencies=[auth, Depends(require_admin(admin_keys))])

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        body = await parse_body(request, LoadLoRAAdapterRequest)
        name, path = body.lora_name, body.lora_path
        try:
            registry.check_lora_name(name)
            registry.check_lora_path(path)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="lora_name" if "name" in str(exc) else "lora_path") from None
        if not posixpath.isabs(path):
            raise OpenAIError(
                400,
                "lora_path must be absolute: every worker of the queue loads it from its own disk",
                param="lora_path",
            )
        served = await live.models()
        if any(name in (model, info.get("path")) for model, info in served.items()):
            raise OpenAIError(400, f"{name!r} is the name of a served model", param="lora_name")
        live.forget_registry()
        if name in await live.adapters():
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            added = await registry.aregister(r, live.keys, name, path)
        except registry.RegistryFull as exc:
            raise OpenAIError(400, str(exc), param="lora_name") from None
        live.forget_registry()
        if not added:  # registered meanwhile, by another gateway
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        name = body.lora_name
        removed = await registry.aunregister(r, live.keys, name)
        live.forget_registry()
        if not removed:
            modules = {n for beat in await live.heartbeats() for n in beat.get("lora_modules") or {}}
            if name in modules:
                raise OpenAIError(
                    400,
                    f"LoRA adapter {name!r} is a worker's --lora-modules: it leaves with that flag",
                    param="lora_name",
                )
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router

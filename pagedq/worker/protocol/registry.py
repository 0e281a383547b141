"""The queue's LoRA adapter registry (protocol/keys.py `loras` and `loras_version`): the names a job's `lora` and the
OpenAI `model` field may name beyond the workers' own --lora-modules, each with the folder workers load it from.

Written by the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter (or any producer, with these functions);
read by every worker (pagedq/worker/service/loras.py). Registering checks the bound on the registry's size and bumps
the version in one script, so a full registry never grows and a worker never misses a change."""

from __future__ import annotations

import json
import time
from typing import Any

from pagedq.engine.lora.request import MAX_LORA_PATH_CHARS, check_lora_name
from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.keys import WORKER_SET_WINDOW_S, QueueKeys
from pagedq.worker.protocol.limits import MAX_REGISTERED_LORAS
from pagedq.worker.protocol.replies import text

__all__ = [
    "LoraModulesError",
    "RegistryFull",
    "adapter_names",
    "aregister",
    "aregistered",
    "aunregister",
    "check_lora_name",
    "check_lora_path",
    "parse_lora_modules",
    "register",
    "unregister",
]


class RegistryFull(Exception):
    """The registry holds MAX_REGISTERED_LORAS adapters already."""


class LoraModulesError(ValueError):
    """A worker's --lora-modules that cannot be served: malformed, or an adapter that does not load (a start-up
    mistake: pagedq/worker/cli/startup_errors.py reports it in one line)."""


def check_lora_path(path: str) -> str:
    """ValueError for an empty path, one over MAX_LORA_PATH_CHARS, or one with control characters."""
    if not isinstance(path, str) or not path or len(path) > MAX_LORA_PATH_CHARS:
        raise ValueError(f"a LoRA adapter's path must be 1 to {MAX_LORA_PATH_CHARS} characters")
    if any(ord(c) < 32 for c in path):
        raise ValueError("a LoRA adapter's path must not hold control characters")
    return path


def parse_lora_modules(specs: list[str] | tuple[str, ...] | str | None) -> dict[str, str]:
    """`name=path` items (vLLM's --lora-modules; a comma list from the environment) as name -> path; ValueError
    naming the item that is not one, a bad name, or a name given twice."""
    items = specs.split(",") if isinstance(specs, str) else list(specs or ())
    modules: dict[str, str] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            raise LoraModulesError(f"--lora-modules: {item!r} is not name=path")
        try:
            name, path = check_lora_name(name.strip()), check_lora_path(path.strip())
        except ValueError as exc:
            raise LoraModulesError(f"--lora-modules: {exc}") from None
        if name in modules:
            raise LoraModulesError(f"--lora-modules: adapter {name!r} is given twice")
        modules[name] = path
    return modules


def _args(keys: QueueKeys, name: str, path: str) -> tuple[list[str], list[Any]]:
    entry = json.dumps({"path": path, "added_at": time.time()})
    return [keys.loras, keys.loras_version], [name, entry, MAX_REGISTERED_LORAS]


def register(r: Any, keys: QueueKeys, name: str, path: str) -> bool:
    """Register adapter `name` at `path`; False (nothing written) when the name is registered already (unregister it
    first to point it elsewhere). RegistryFull past the bound."""
    return _registered(scripts.call(r, "lora_register", *_args(keys, check_lora_name(name), check_lora_path(path))))


async def aregister(r: Any, keys: QueueKeys, name: str, path: str) -> bool:
    args = _args(keys, check_lora_name(name), check_lora_path(path))
    return _registered(await scripts.acall(r, "lora_register", *args))


def unregister(r: Any, keys: QueueKeys, name: str) -> bool:
    """Remove adapter `name` from the registry (every worker drops it); False when it was not there."""
    return bool(scripts.call(r, "lora_unregister", [keys.loras, keys.loras_version], [name]))


async def aunregister(r: Any, keys: QueueKeys, name: str) -> bool:
    return bool(await scripts.acall(r, "lora_unregister", [keys.loras, keys.loras_version], [name]))


async def aregistered(r: Any, keys: QueueKeys) -> dict[str, dict[str, Any]]:
    """Name -> entry ({"path", "added_at"}) of every registered adapter."""
    out = {}
    for name, raw in (await r.hgetall(keys.loras)).items():
        try:
            entry = json.loads(text(raw))
        except ValueError:
            continue
        if isinstance(entry, dict):
            out[text(name)] = entry
    return out


def _registered(reply: Any) -> bool:
    if int(reply) < 0:
        raise RegistryFull(f"the queue's LoRA registry holds {MAX_REGISTERED_LORAS} adapters already")
    return bool(int(reply))


def adapter_names(r: Any, keys: QueueKeys) -> set[str]:
    """Every adapter the queue serves now: the registry's and the live workers' --lora-modules (their heartbeats),
    what `pagedq bulk` maps an OpenAI line's `model` against (the gateway has its own view: gateway/workers.py)."""
    names = {text(name) for name in r.hkeys(keys.loras)}
    workers = [text(w) for w in r.zrangebyscore(keys.workers, time.time() - WORKER_SET_WINDOW_S, "+inf")]
    for raw in r.mget([keys.heartbeat(w) for w in workers]) if workers else []:
        try:
            modules = json.loads(raw).get("lora_modules") if raw else None
        except (ValueError, AttributeError):
            continue
        if isinstance(modules, dict):
            names.update(str(name) for name in modules)
    return names

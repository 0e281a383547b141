"""The LoRA adapters a worker serves (issue 36): its own --lora-modules, loaded at start, and the queue's registry
(protocol/keys.py `loras`, written by the gateway's /v1/load_lora_adapter), read from Redis and loaded into the
engine on an adapter's first use, from a path this worker can read.

A job naming an adapter that is in neither, or one the engine refuses to load (a missing file, a rank over
--max-lora-rank, a target the model lacks, another base model), is rejected with the engine's reason
(RequestRejected): one final record, and the worker goes on. An adapter leaving the registry (or registered again
under another path) is removed from the engine, which lets its in-flight jobs finish first."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pagedq.worker.protocol.registry import LoraModulesError, parse_lora_modules
from pagedq.worker.protocol.replies import text
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.engine_api import LoRARequest, RequestOutput, RequestRejected, WorkerEngine
from pagedq.worker.service.held import HeldJob
from pagedq.worker.service.snapshot import LoraFigures

_UNREAD = object()  # the registry's version before the first look
REFRESH_S = 1.0  # how often the registry's version is looked at: how soon an unload reaches every worker
# an adapter that failed to load is refused without another try for this long (its folder may still be being copied)
RETRY_FAILED_S = 10.0
MAX_SHOWN = 20  # adapters named in the heartbeat and the metrics labels (the rest summed under OTHER)
OTHER = "(other)"  # not a valid adapter name (pagedq/engine/lora/request.py), so it never collides with one
FIGURES = ("waiting", "running", "requests", "tokens")


class WorkerLoras:
    """Name -> path of every adapter this worker may serve, and which of them the engine holds."""

    def __init__(self, ctx: ServiceContext, engine: WorkerEngine) -> None:
        """Loads the worker's --lora-modules into the engine: one that cannot load is a LoraModulesError naming it,
        before the worker takes any job."""
        self.r, self.keys, self.log = ctx.redis, ctx.keys, ctx.log
        self.engine = engine
        self.modules = parse_lora_modules(ctx.settings.lora_modules)  # always served, never dropped
        self.registry: dict[str, str] = {}  # the queue's registry as last read
        self.loaded: dict[str, str] = {}  # what the engine holds: name -> the path it was loaded from
        self._version: object = _UNREAD
        self._next_refresh = 0.0
        self.requests: dict[str, int] = {}  # jobs admitted per adapter (figures: pagedq status, metrics)
        self.tokens: dict[str, int] = {}  # tokens generated per adapter
        self.failed: dict[str, tuple[str, float, str]] = {}  # name -> (path, retry after, reason) of a failed load
        for name, path in self.modules.items():
            self._load(name, path, at_start=True)

    def add_request(self, t: HeldJob, priority: int) -> None:
        """engine.add_request for a prepared job (admission.prepare), under the adapter it names (loaded on its
        first use: RequestRejected naming the problem when it is unknown or cannot load)."""
        if t.engine_input is None or t.sampling_params is None:  # admission prepares every job before it reaches here
            raise RuntimeError(f"job {t.key} reached the engine unprepared")
        if t.job.lora is None:
            self.engine.add_request(t.request_id, t.engine_input, t.sampling_params, priority=priority)
            return
        lora = self.request_for(t.job.lora)
        self.engine.add_request(t.request_id, t.engine_input, t.sampling_params, priority=priority, lora=lora)
        self.counted(t.job.lora, requests=1)

    def generated(self, t: HeldJob | None, out: RequestOutput) -> int:
        """The tokens of one step's output, counted for its job's adapter; returns them."""
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if t is not None and t.job.lora is not None:
            self.counted(t.job.lora, tokens=tokens)
        return tokens

    def request_for(self, name: str) -> LoRARequest:
        """The engine's request for adapter `name`, loading it first when the engine does not hold it; raises
        RequestRejected naming the problem (unknown, or refused by the engine)."""
        path = self.modules.get(name) or self.registry.get(name)
        if path is None:
            path = self._lookup(name)  # registered since the last refresh: its first use need not wait for it
        if path is None:
            raise RequestRejected(
                f"unknown LoRA adapter {name!r}: neither among this worker's --lora-modules nor registered on the "
                "queue (POST /v1/load_lora_adapter)"
            )
        if self.loaded.get(name) != path:
            failed = self.failed.get(name)
            if failed is not None and failed[0] == path and time.monotonic() < failed[1]:
                raise RequestRejected(failed[2])  # a flood of jobs naming a broken adapter reads its folder once
            self._load(name, path)
        return LoRARequest(name, path)

    def counted(self, name: str, requests: int = 0, tokens: int = 0) -> None:
        self.requests[name] = self.requests.get(name, 0) + requests
        self.tokens[name] = self.tokens.get(name, 0) + tokens

    def figures(self, held: Iterable[HeldJob]) -> LoraFigures:
        """What the heartbeat and the metrics carry (WorkerSnapshot.loras)."""
        return LoraFigures(self.rows(held), self.modules, self.max_loras)

    def rows(self, held: Iterable[HeldJob], top: int | None = None) -> dict[str, dict[str, int]]:
        """Per adapter: jobs held waiting, jobs in the engine, jobs admitted and tokens generated since start; the
        `top` (default MAX_SHOWN) busiest by name, the rest summed under OTHER (what the heartbeat and the metrics
        labels carry)."""
        top = MAX_SHOWN if top is None else top
        rows = {
            name: {"waiting": 0, "running": 0, "requests": count, "tokens": self.tokens.get(name, 0)}
            for name, count in self.requests.items()
        }
        for t in held:
            if t.job.lora is not None:
                row = rows.setdefault(t.job.lora, dict.fromkeys(FIGURES, 0))
                row["running" if t.in_engine else "waiting"] += 1
        busiest = sorted(rows, key=lambda x: (-(rows[x]["waiting"] + rows[x]["running"]), -rows[x]["requests"], x))
        shown = {name: rows[name] for name in busiest[:top]}
        rest = [rows[name] for name in busiest[top:]]
        if rest:
            shown[OTHER] = {key: sum(row[key] for row in rest) for key in FIGURES}
        return shown

    @property
    def max_loras(self) -> int:
        """The engine's adapter slots (0 for an engine without adapters)."""
        if getattr(self.engine, "lora", True) is None:  # engine.LLMEngine without enable_lora
            return 0
        for owner in (self.engine, getattr(self.engine, "config", None)):  # the stub's own, the engine's config
            slots = getattr(owner, "max_loras", None)
            if isinstance(slots, int):
                return slots
        return 0

    def refresh(self, now: float) -> None:
        """Reread the registry when its version moved (looked at every REFRESH_S), and drop from the engine the
        adapters that left it."""
        if now < self._next_refresh:
            return
        self._next_refresh = now + REFRESH_S
        version = self.r.get(self.keys.loras_version)
        if version == self._version:
            return
        self._version = version
        self.registry = registry_paths(self.r.hgetall(self.keys.loras))
        for name, path in list(self.loaded.items()):
            if self.modules.get(name, self.registry.get(name)) != path:
                self._unload(name)

    def _lookup(self, name: str) -> str | None:
        raw = self.r.hget(self.keys.loras, name)
        path = entry_path(raw) if raw is not None else None
        if path is not None:
            self.registry[name] = path
        return path

    def _load(self, name: str, path: str, at_start: bool = False) -> None:
        if name in self.loaded:  # registered again under another path
            self._unload(name)
        add = getattr(self.engine, "add_lora", None)
        if add is None:
            raise RequestRejected(f"LoRA adapter {name!r}: this worker's engine does not serve adapters")
        try:
            add(LoRARequest(name, path))
        except Exception as exc:
            # the engine's LoRALoadError names the adapter and its folder already
            reason = str(exc) if repr(name) in str(exc) else f"LoRA adapter {name!r} ({path}) cannot be loaded: {exc}"
            if at_start:
                raise LoraModulesError(f"--lora-modules: {reason}") from exc
            self.log.warning("lora_load_failed", lora=name, path=path, error=reason)
            self.failed[name] = (path, time.monotonic() + RETRY_FAILED_S, reason)
            raise RequestRejected(reason) from None
        self.failed.pop(name, None)
        self.loaded[name] = path
        self.log.info("lora_loaded", lora=name, path=path)

    def _unload(self, name: str) -> None:
        self.loaded.pop(name, None)
        try:
            self.engine.remove_lora(name)  # type: ignore[attr-defined]  # _load checked the engine has add_lora
        except Exception as exc:  # already gone, or never fully loaded: nothing left to drop
            self.log.warning("lora_unload_failed", lora=name, error=str(exc))
        else:
            self.log.info("lora_unloaded", lora=name)


def entry_path(raw: Any) -> str | None:
    """The path of one registry entry (JSON {"path", "added_at"}); None for an entry that is not one."""
    try:
        entry = json.loads(text(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    path = entry.get("path") if isinstance(entry, dict) else None
    return path if isinstance(path, str) and path else None


def registry_paths(raw: Mapping[Any, Any]) -> dict[str, str]:
    """HGETALL of the registry as name -> path (entries that are not valid are left out)."""
    out = {}
    for name, value in raw.items():
        path = entry_path(value)
        if path is not None:
            out[text(name)] = path
    return out

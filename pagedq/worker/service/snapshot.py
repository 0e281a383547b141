"""The loop's figures at one moment, as a frozen value: what the heartbeat publishes and the metrics export, so
neither reads attributes off the loop. The metrics sink is a protocol here; pagedq/worker/ops/metrics.py implements
it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedq.worker.protocol.job import FinalRecord
from pagedq.worker.service.engine_api import WorkerEngine
from pagedq.worker.service.front_door import FrontDoor


@dataclass(frozen=True)
class EngineFigures:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_slot_utilization: float

    @classmethod
    def of(cls, engine: WorkerEngine) -> EngineFigures:
        return cls(
            running=engine.num_running_requests,
            waiting=engine.num_waiting_requests,
            free_blocks=engine.num_free_blocks,
            total_blocks=engine.num_total_blocks,
            kv_slot_utilization=float(getattr(engine, "kv_slot_utilization", 0.0)),  # an optional extra
        )


@dataclass(frozen=True)
class LoraFigures:
    """The LoRA adapters of a worker (service/loras.py)."""

    # per adapter, the busiest by name (the rest summed under "(other)"): waiting, running, requests, tokens
    rows: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    modules: Mapping[str, str] = field(default_factory=dict)  # the worker's --lora-modules, name -> path
    max_loras: int = 0  # the engine's adapter slots (0: it serves none)


@dataclass(frozen=True)
class WorkerSnapshot:
    state: str  # "running" or "draining"
    held_jobs: int
    stats: Mapping[str, int]  # final records written, by status (STATUSES order)
    engine: EngineFigures
    tokens_generated: int
    redis_outages: int
    # The figures that cost a call each (engine.stats(), a broker round trip per door): the metrics timer asks
    # for them, the heartbeat does not.
    preemptions: int = 0
    seat_preemptions: int = 0  # of those, for a sequence seat (pagedq/engine/core/seats.py)
    # Per tenant (service/tenants.py figures, the busiest by name): waiting, in_engine, admitted, admitted_tokens
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Per band: the read-to-admit delay (service/admit_delay.py): count, p50_ms, p99_ms, max_ms
    admit_delays: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    front_door_depths: Mapping[str, int] = field(default_factory=dict)  # door name -> jobs waiting behind it
    loras: LoraFigures = field(default_factory=lambda: LoraFigures())  # LoRA adapters (service/loras.py)


class MetricsSink(Protocol):
    def observe(self, record: FinalRecord, band: str) -> None:
        """Once per final record; band: the priority band the job was served in."""
        ...

    def update(self, snapshot: WorkerSnapshot) -> None:
        """On the metrics timer (settings.metrics_every_s), in the loop's thread."""
        ...

    def close(self) -> None: ...


def costly_figures(engine: WorkerEngine, front_doors: Sequence[FrontDoor], log: Any) -> tuple[int, int, dict[str, int]]:
    """Preemptions, seat preemptions (engine.stats(), an optional extra of the engine) and each door's depth (a
    broker round trip). A figure that fails is left out (its gauge keeps its value) and logged; the other metrics
    still update."""
    preemptions, seats, depths = 0, 0, {}
    try:
        engine_stats = getattr(engine, "stats", None)
        stats = engine_stats() if callable(engine_stats) else {}
        preemptions, seats = int(stats.get("num_preemptions", 0)), int(stats.get("num_seat_preemptions", 0))
        for door in front_doors:
            depths[door.name] = door.depth()
    except Exception as exc:
        log.error("metrics_update_failed", error=repr(exc))
    return preemptions, seats, depths

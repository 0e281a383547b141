"""The metrics of seat preemption, the read-to-admit delay and tenants (pagedq/worker/ops/metrics.py exports them).

Tenant series are labelled by tenant name, at most tenants.MAX_SHOWN of them (the busiest) plus "(other)": a
queue with 100,000 tenants does not become 100,000 series. Series of tenants that left the top are dropped."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedq.worker.service.snapshot import WorkerSnapshot


class BandsAndTenantsMetrics:
    def __init__(self, reg: CollectorRegistry, queue: str) -> None:
        self.queue = queue
        per_tenant = ["queue", "tenant"]

        def tenant_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, per_tenant, registry=reg)

        self.seat_preemptions = Counter(
            "pagedq_seat_preemptions", "Engine sequences that gave their seat to a higher band", ["queue"], registry=reg
        ).labels(queue)
        self.admit_p99 = Gauge(
            "pagedq_read_to_admit_p99_seconds", "p99 of recent read-to-admit delays", ["queue", "band"], registry=reg
        )
        self.waiting = tenant_gauge("pagedq_tenant_waiting_jobs", "Jobs of the tenant held, not in the engine")
        self.in_engine = tenant_gauge("pagedq_tenant_engine_jobs", "Jobs of the tenant in the engine")
        self.admitted = tenant_gauge("pagedq_tenant_admitted_jobs", "Jobs of the tenant admitted since start")
        self.tokens = tenant_gauge("pagedq_tenant_admitted_tokens", "Prompt + max_tokens of its admitted jobs")
        self._seats_seen = 0
        self._shown: set[str] = set()

    def update(self, snapshot: WorkerSnapshot) -> None:
        if snapshot.seat_preemptions > self._seats_seen:
            self.seat_preemptions.inc(snapshot.seat_preemptions - self._seats_seen)
            self._seats_seen = snapshot.seat_preemptions
        for band, delay in snapshot.admit_delays.items():
            self.admit_p99.labels(self.queue, band).set(delay["p99_ms"] / 1e3)
        gauges: tuple[tuple[Any, str], ...] = (
            (self.waiting, "waiting"),
            (self.in_engine, "in_engine"),
            (self.admitted, "admitted"),
            (self.tokens, "admitted_tokens"),
        )
        shown = {name or "(none)": figures for name, figures in snapshot.tenants.items()}
        for gone in self._shown - shown.keys():
            for gauge, _ in gauges:
                gauge.remove(self.queue, gone)
        for name, figures in shown.items():
            for gauge, key in gauges:
                gauge.labels(self.queue, name).set(figures[key])
        self._shown = set(shown)

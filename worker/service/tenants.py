"""Fair shares of a band across tenants: deficit round robin (Shreedhar and Varghese) weighted by tokens.

Within a band, the tenants with jobs waiting take turns. A tenant's turn adds `quantum x weight` tokens to its
deficit; it is served jobs (in its own order: priority, then read order) while the next one's cost (prompt +
max_tokens x samples) fits in the deficit, then the turn passes on. A tenant with nothing left waiting leaves the
round and loses its deficit (no credit is saved up while idle). So one tenant's 100,000-job upload cannot delay
another's 50 jobs by more than one round per job, whatever the arrival order: between two admissions of a tenant
with work waiting, every other tenant gets at most (quantum x weight + largest cost) / smallest cost admissions.
Jobs without a tenant share the band as one tenant, "".

`order` reads the round without changing it (admission may stop part way: no room, no KV blocks); `admitted`
advances the real round by each job that went in, replaying the same rules.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from worker.protocol.limits import MAX_TENANT_WEIGHT, MAX_TENANTS_WEIGHTED, TENANT_PATTERN
from worker.service.held import HeldJob

MAX_TRACKED = 10_000  # tenants counted by name since start; later ones count under OTHER
MAX_SHOWN = 20  # tenants named in the heartbeat and the metrics labels (the rest summed under OTHER)
OTHER = "(other)"  # not a valid tenant name, so it never collides with one
DEFAULT_QUANTUM = 512  # tokens a tenant's turn adds to its deficit (at weight 1): about one job


def tenant_of(t: HeldJob) -> str:
    return t.job.tenant or ""


def parse_weights(text: str) -> dict[str, float]:
    """`a=2,b=0.5` (the --tenant-weights flag) as {tenant: weight}; ValueError naming the bad part."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not re.fullmatch(TENANT_PATTERN, name.strip()):
            raise ValueError(
                f"tenant weight {part!r}: expected NAME=WEIGHT with a tenant name matching {TENANT_PATTERN}"
            )
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"tenant weight {part!r}: {value!r} is not a number") from None
        if not 0 < weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"tenant weight {part!r}: the weight must be in (0, {MAX_TENANT_WEIGHT}]")
        weights[name.strip()] = weight
    if len(weights) > MAX_TENANTS_WEIGHTED:
        raise ValueError(f"{len(weights)} tenant weights, more than the limit of {MAX_TENANTS_WEIGHTED}")
    return weights


@dataclass
class Round:
    """One band's round: the tenants in turn order, their deficits, whether the head has had its quantum."""

    ring: deque[str] = field(default_factory=deque)
    deficit: dict[str, float] = field(default_factory=dict)
    credited: bool = False

    def copy(self) -> Round:
        return Round(deque(self.ring), dict(self.deficit), self.credited)

    def sync(self, waiting: Iterable[str]) -> None:
        """Tenants with nothing waiting leave (losing their deficit); new ones join at the tail, in read order."""
        present = dict.fromkeys(waiting)
        if self.ring and self.ring[0] not in present:
            self.credited = False
        for tenant in [x for x in self.ring if x not in present]:
            self.ring.remove(tenant)
            self.deficit.pop(tenant, None)
        known = set(self.ring)
        self.ring.extend(x for x in present if x not in known)

    def serve(self, tenant: str, cost: float, quantum: Mapping[str, float]) -> None:
        """Take turns until `tenant` is at the head with the deficit for `cost`, then charge it. Every turn adds a
        quantum, so this ends within cost / quantum rounds."""
        if tenant not in self.ring:
            self.ring.append(tenant)
        while True:
            head = self.ring[0]
            if not self.credited:
                self.deficit[head] = self.deficit.get(head, 0.0) + quantum[head]
                self.credited = True
            if head == tenant and cost <= self.deficit[head]:
                self.deficit[head] -= cost
                return
            self.ring.rotate(-1)
            self.credited = False


class TenantShares:
    def __init__(self, weights: Mapping[str, float] | None = None, quantum: int = DEFAULT_QUANTUM) -> None:
        if isinstance(quantum, bool) or not isinstance(quantum, int) or not 1 <= quantum <= 2**31 - 1:
            raise ValueError(f"tenant quantum must be an integer in [1, {2**31 - 1}] tokens, got {quantum!r}")
        self.weights, self.quantum = dict(weights or {}), quantum
        self.rounds: dict[str, Round] = {}
        self.admitted_jobs: dict[str, int] = {}  # since start, per tenant (at most MAX_TRACKED, then OTHER)
        self.admitted_tokens: dict[str, int] = {}

    def _quantum(self, tenants: Iterable[str]) -> dict[str, float]:
        return {x: self.quantum * self.weights.get(x, 1.0) for x in tenants}

    def order(self, band: str, jobs: list[HeldJob]) -> list[HeldJob]:
        """A band's jobs (each tenant's already in its own order) in the order the round admits them."""
        queues: dict[str, deque[HeldJob]] = {}
        for t in jobs:
            queues.setdefault(tenant_of(t), deque()).append(t)
        real = self.rounds.setdefault(band, Round())
        real.sync(queues)
        if len(queues) < 2:
            return jobs
        rnd, quantum = real.copy(), self._quantum(queues)
        out: list[HeldJob] = []
        while len(out) < len(jobs):
            head = rnd.ring[0]
            queue = queues[head]
            if not rnd.credited:
                rnd.deficit[head] = rnd.deficit.get(head, 0.0) + quantum[head]
                rnd.credited = True
            if queue and cost_of(queue[0], self.quantum) <= rnd.deficit[head]:
                t = queue.popleft()
                rnd.deficit[head] -= cost_of(t, self.quantum)
                out.append(t)
                if queue:
                    continue
            rnd.ring.rotate(-1)  # its turn is over (spent, or nothing left: it stays, with nothing to take)
            rnd.credited = False
        return out

    def admitted(self, t: HeldJob) -> None:
        tenant = tenant_of(t)
        real = self.rounds.setdefault(t.band, Round())
        real.serve(tenant, cost_of(t, self.quantum), self._quantum({*real.ring, tenant}))
        name = tenant if tenant in self.admitted_jobs or len(self.admitted_jobs) < MAX_TRACKED else OTHER
        self.admitted_jobs[name] = self.admitted_jobs.get(name, 0) + 1
        self.admitted_tokens[name] = self.admitted_tokens.get(name, 0) + t.admission_tokens

    def figures(self, held: Iterable[HeldJob], top: int = MAX_SHOWN) -> dict[str, dict[str, int]]:
        """Per tenant: jobs waiting in the worker, jobs in the engine, jobs and tokens admitted since start; the
        `top` busiest by name, the rest summed under OTHER (what the heartbeat and the metrics labels carry)."""
        rows: dict[str, dict[str, int]] = {}
        for name, jobs in self.admitted_jobs.items():
            rows[name] = {"waiting": 0, "in_engine": 0, "admitted": jobs, "admitted_tokens": self.admitted_tokens[name]}
        for t in held:
            row = rows.setdefault(tenant_of(t), {"waiting": 0, "in_engine": 0, "admitted": 0, "admitted_tokens": 0})
            row["in_engine" if t.in_engine else "waiting"] += 1
        busiest = sorted(rows, key=lambda x: (-(rows[x]["waiting"] + rows[x]["in_engine"]), -rows[x]["admitted"], x))
        shown = {name: rows[name] for name in busiest[:top] if name != OTHER}
        rest = [rows[name] for name in rows if name not in shown]
        if rest:
            shown[OTHER] = {key: sum(row[key] for row in rest) for key in rest[0]}
        return shown


COST_CAP_QUANTA = 8  # a job costs at most this many quanta: a huge one waits 8 rounds, not max_tokens / quantum


def cost_of(t: HeldJob, quantum: int = DEFAULT_QUANTUM) -> int:
    """What a job takes of its tenant's share: prompt tokens + max_tokens x samples (admission.prepare sets it)."""
    return min(max(t.admission_tokens, 1), COST_CAP_QUANTA * quantum)

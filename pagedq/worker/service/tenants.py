"""Fair shares of a band across tenants: deficit round robin (Shreedhar and Varghese) weighted by tokens, with a
bounded catch-up credit for a tenant that was idle.

Within a band, the tenants with jobs waiting take turns. A tenant's turn adds `quantum x weight` tokens to its
deficit; it is served jobs (in its own order: priority, then read order) while the next one's cost (prompt +
max_tokens x samples) fits in the deficit, then the turn passes on. A tenant with nothing left waiting leaves the
round and loses its deficit. Jobs without a tenant share the band as one tenant, "".

Catch-up: plain DRR shares only the present, so a small tenant that turns up behind another's big backlog gets
half the band and must wait for the other's sequences to end: its 50 jobs take twice as long as alone, and more.
Fair-share schedulers count recent usage instead (Slurm's decayed usage, least attained service, Linux CFS placing
a woken task a little behind the others' virtual time). Here: the band keeps a round clock (one turn of the ring
advances it 1 / the ring's length, so a tenant present all along gets one quantum per round). A tenant that joins
after sitting out k rounds (a new tenant: as if forever) gets the turns it missed, at most `burst` of them: its
deficit starts at min(k, burst) x quantum x weight and, if that is at least one quantum, it takes the next turn at
once, ahead of the ring. So a newly active small tenant is served first, up to `burst` quanta; a tenant that
comes and goes every few jobs gets no more than it would have had by staying (its credit is the rounds it
missed); and weights scale the credit as they scale the quantum.

Bounded: a joiner's turn spends at most burst x quantum x weight (+ one job), and it can cut in again only after
sitting out another round, which needs every tenant in the ring to have had its turn. So between two admissions
of a tenant with work waiting, every other tenant gets at most two turns: (burst + 1) x quantum x weight + twice
the largest cost tokens, whatever the arrival order (tests/worker/test_tenants.py checks it as a property).
burst=0 is plain DRR: at most (quantum x weight + largest cost) / smallest cost admissions per other tenant.

`order` reads the round without changing it (admission may stop part way: no room, no KV blocks); `admitted`
advances the real round by each job that went in, replaying the same rules.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagedq.worker.protocol.limits import (
    DEFAULT_TENANT_BURST,
    MAX_TENANT_BURST,
    MAX_TENANT_WEIGHT,
    MAX_TENANTS_WEIGHTED,
    TENANT_PATTERN,
)
from pagedq.worker.service.held import HeldJob

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
    """One band's round: the tenants in turn order, their deficits, who has had this turn's quantum, the round
    clock and when each tenant last left (for its catch-up credit)."""

    burst: int = DEFAULT_TENANT_BURST
    ring: deque[str] = field(default_factory=deque)
    deficit: dict[str, float] = field(default_factory=dict)
    credited: set[str] = field(default_factory=set)  # the head, and a head a joiner cut in front of
    clock: float = 0.0  # rounds so far
    left_at: dict[str, float] = field(default_factory=dict)  # at most MAX_TRACKED, the oldest dropped

    def copy(self) -> Round:
        return Round(self.burst, deque(self.ring), dict(self.deficit), set(self.credited), self.clock, self.left_at)

    def sync(self, waiting: Iterable[str], quantum: Mapping[str, float]) -> None:
        """Tenants with nothing waiting leave (losing their deficit); new ones join, in read order: at the tail, or
        with the rounds they missed (up to `burst`) as credit, at the head if that is a turn's worth or more."""
        present = dict.fromkeys(waiting)
        for tenant in [x for x in self.ring if x not in present]:
            self.ring.remove(tenant)
            self.deficit.pop(tenant, None)
            self.credited.discard(tenant)
            self.left_at.pop(tenant, None)
            self.left_at[tenant] = self.clock  # re-inserted: the dict stays in leaving order
            if len(self.left_at) > MAX_TRACKED:
                del self.left_at[next(iter(self.left_at))]
        known = set(self.ring)
        cutting_in = []
        for tenant in (x for x in present if x not in known):
            missed = self.clock - self.left_at[tenant] if tenant in self.left_at else float(self.burst)
            credit = min(missed, float(self.burst)) * quantum[tenant]
            if self.burst and credit >= quantum[tenant]:
                self.deficit[tenant] = credit
                self.credited.add(tenant)  # its turn's tokens are the credit
                cutting_in.append(tenant)
            else:
                self.ring.append(tenant)
        self.ring.extendleft(reversed(cutting_in))

    def turn_over(self) -> None:
        self.credited.discard(self.ring[0])
        self.ring.rotate(-1)
        self.clock += 1.0 / len(self.ring)

    def credit_head(self, quantum: Mapping[str, float]) -> str:
        head = self.ring[0]
        if head not in self.credited:
            self.deficit[head] = self.deficit.get(head, 0.0) + quantum[head]
            self.credited.add(head)
        return head

    def serve(self, tenant: str, cost: float, quantum: Mapping[str, float]) -> None:
        """Take turns until `tenant` is at the head with the deficit for `cost`, then charge it. Every turn adds a
        quantum, so this ends within cost / quantum rounds."""
        if tenant not in self.ring:
            self.ring.append(tenant)
        while True:
            head = self.credit_head(quantum)
            if head == tenant and cost <= self.deficit[head]:
                self.deficit[head] -= cost
                return
            self.turn_over()


class TenantShares:
    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        quantum: int = DEFAULT_QUANTUM,
        burst: int = DEFAULT_TENANT_BURST,
    ) -> None:
        if isinstance(quantum, bool) or not isinstance(quantum, int) or not 1 <= quantum <= 2**31 - 1:
            raise ValueError(f"tenant quantum must be an integer in [1, {2**31 - 1}] tokens, got {quantum!r}")
        if isinstance(burst, bool) or not isinstance(burst, int) or not 0 <= burst <= MAX_TENANT_BURST:
            raise ValueError(f"tenant burst must be an integer in [0, {MAX_TENANT_BURST}] rounds, got {burst!r}")
        self.weights, self.quantum, self.burst = dict(weights or {}), quantum, burst
        self.rounds: dict[str, Round] = {}
        self.admitted_jobs: dict[str, int] = {}  # since start, per tenant (at most MAX_TRACKED, then OTHER)
        self.admitted_tokens: dict[str, int] = {}

    def _quantum(self, tenants: Iterable[str]) -> dict[str, float]:
        return {x: self.quantum * self.weights.get(x, 1.0) for x in tenants}

    def order(self, band: str, jobs: list[HeldJob], limit: int | None = None) -> list[HeldJob]:
        """A band's jobs (each tenant's already in its own order) in the order the round admits them; with a limit,
        only the first `limit` are worked out (what admission can take now), the rest follow in tenant order. The
        round is replayed per job, so without a limit this costs the whole backlog every time."""
        queues: dict[str, deque[HeldJob]] = {}
        for t in jobs:
            queues.setdefault(tenant_of(t), deque()).append(t)
        real = self._round(band)
        quantum = self._quantum(queues)
        real.sync(queues, quantum)
        if len(queues) < 2:
            return jobs
        rnd = real.copy()
        out: list[HeldJob] = []
        wanted = len(jobs) if limit is None else min(max(limit, 0), len(jobs))
        while len(out) < wanted:
            head = rnd.credit_head(quantum)
            queue = queues[head]
            if queue and cost_of(queue[0], self.quantum) <= rnd.deficit[head]:
                t = queue.popleft()
                rnd.deficit[head] -= cost_of(t, self.quantum)
                out.append(t)
                if queue:
                    continue
            rnd.turn_over()  # its turn is over (spent, or nothing left: it stays, with nothing to take)
        return out + [t for queue in queues.values() for t in queue]

    def _round(self, band: str) -> Round:
        return self.rounds.setdefault(band, Round(self.burst))

    def admitted(self, t: HeldJob) -> None:
        tenant = tenant_of(t)
        real = self._round(t.band)
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

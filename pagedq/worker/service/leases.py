"""Leases on jobs (a job's idle time in the group's pending list), recovery, claiming, heartbeats.

A job a worker holds stays "leased" while the worker renews it (XCLAIM JUSTID by the owner resets its
idle time), so long generations are never stolen. Jobs of a dead worker go idle; after lease_ms any
worker claims them with XAUTOCLAIM. Jobs recovered so (or re-read by a restarted worker) are suspects: they
run alone, each run alone recorded in Redis first, so a job that kills its worker is the only one charged.
A worker that stops hands back what it still holds (hand_back): jobs it never started go back to the stream
as new entries, the others are made claimable at once.
"""

from __future__ import annotations

from pagedq.worker.protocol import scripts
from pagedq.worker.protocol.keys import BANDS, GROUP, JOB_FIELD
from pagedq.worker.protocol.replies import text
from pagedq.worker.service.context import ServiceContext
from pagedq.worker.service.held import HeldJob, JobState


class Leases:
    def __init__(self, ctx: ServiceContext) -> None:
        self.r, self.keys, self.name, self.lease_ms = ctx.redis, ctx.keys, ctx.settings.name, int(ctx.settings.lease_ms)
        self.held, self.log = ctx.held, ctx.log
        self.cursors = {band: "0-0" for band in BANDS}  # XAUTOCLAIM walks each band's pending list

    def ensure_group(self) -> None:
        for band in BANDS:
            try:
                self.r.xgroup_create(self.keys.jobs_of(band), GROUP, id="0", mkstream=True)
            except Exception as exc:  # BUSYGROUP: it exists already
                if "BUSYGROUP" not in str(exc):
                    raise

    def read_own_pending(self, band: str, count: int = 500) -> list:
        """Entries of a band this consumer had not acknowledged before it stopped (restart recipe: read from 0)."""
        entries: list = []  # (entry id, fields) pairs as redis-py returns them
        last = "0"
        while True:
            reply = self.r.xreadgroup(GROUP, self.name, {self.keys.jobs_of(band): last}, count=count)
            batch = reply[0][1] if reply else []
            if not batch:
                return entries
            entries.extend(batch)
            last = text(batch[-1][0])

    def renew_held(self) -> None:
        """Renew the leases of every entry this worker holds."""
        for band in BANDS:
            ids = self.held.entry_ids(band)
            lost = self.renew(band, ids) if ids else []
            if lost:
                self.log.warning("lease_lost", band=band, entries=lost)  # keep going: the first final wins

    def renew(self, band: str, entry_ids: list[str]) -> list[str]:
        """Renew our leases on entries of a band; return those another worker has claimed meanwhile."""
        lost = []
        for i in range(0, len(entry_ids), 1000):
            chunk = entry_ids[i : i + 1000]
            lost += scripts.call(self.r, "renew", [self.keys.jobs_of(band)], [GROUP, self.name, *chunk])
        return [text(x) for x in lost]

    def claim(self, band: str, count: int) -> list:
        """XAUTOCLAIM up to count entries of a band idle past the lease (walking its pending list with a cursor)."""
        if count <= 0:
            return []
        reply = self.r.xautoclaim(
            self.keys.jobs_of(band), GROUP, self.name, self.lease_ms, self.cursors[band], count=count
        )
        self.cursors[band] = text(reply[0])
        return list(reply[1])

    def hand_back(self, jobs: list[HeldJob]) -> tuple[int, int]:
        """Give up the leases of the stream jobs a stopping worker still holds; returns (re-added, released).

        A job that never ran here or anywhere (read ahead, never in the engine or still in its waiting queue) is
        re-added as a fresh entry, so the next worker runs it as any new job; one that ran, or was recovered, is
        left pending but idle past the lease, so the next claim takes it at once rather than after lease_ms."""
        readded = released = 0
        for band in BANDS:
            pairs: list[str] = []
            for t in jobs:
                if t.origin == band and t.entry_id:
                    pairs += [t.entry_id, t.job.to_json() if never_ran(t) else ""]
            for i in range(0, len(pairs), 1000):
                args = [GROUP, self.name, self.lease_ms, JOB_FIELD, *pairs[i : i + 1000]]
                counts = scripts.call(self.r, "hand_back", [self.keys.jobs_of(band)], args)
                readded, released = readded + int(counts[0]), released + int(counts[1])
        return readded, released


def never_ran(t: HeldJob) -> bool:
    """No engine has produced output for t: read ahead (BACKLOG), or handed to the engine and still waiting there;
    never recovered from another worker and never run alone (a suspect ran, or was charged a run)."""
    waiting = t.state is JobState.BACKLOG or (t.state is JobState.IN_ENGINE and not t.started)
    return waiting and not t.recovered and t.runs_alone == 0

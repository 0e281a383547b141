"""`pagedq bench fleet`'s scenarios with small numbers, on real `pagedq worker` processes and a real Redis: workers
scaled out, scaled in by SIGTERM and killed under a backlog lose no job and run none twice, and a killed worker's
leases are claimed by the others soon after the lease runs out. Oracle: the completions stream (one final
record per job) and the workers' own logs (claims, recoveries, runs whose final record existed)."""

from __future__ import annotations

import pytest

from pagedq.bench.worker.fleet import FleetRun, kill_one, scale_in, scale_out

pytestmark = pytest.mark.slow  # each scenario starts `pagedq worker` processes

RUN = FleetRun(jobs=48, max_tokens=4, step_delay_s=0.02, max_num_seqs=4, lease_ms=1000, timeout_s=60.0)


def test_scale_out_and_scale_in_lose_nothing_and_run_nothing_twice(redis_url, tmp_path):
    out = scale_out(redis_url, RUN, tmp_path)
    assert (out["jobs"], out["lost"], out["duplicated"], out["reprocessed"]) == (48, 0, 0, 0), out
    drained = scale_in(redis_url, RUN, tmp_path)
    assert (drained["lost"], drained["duplicated"], drained["reprocessed"]) == (0, 0, 0), drained
    assert drained["exit_codes"] == [0, 0, 0]  # each stopping worker drained within its timeout


def test_a_killed_workers_leases_are_claimed_within_the_lease(redis_url, tmp_path):
    killed = kill_one(redis_url, RUN, tmp_path)
    assert (killed["lost"], killed["duplicated"]) == (0, 0), killed
    # every job it held was claimed once (started again), no other job
    assert killed["reprocessed"] == killed["leased_at_kill"] > 0, killed
    # claimable once idle past the lease; claimers look every lease / 2 and claim as much as their read-ahead room
    # takes, which a backlog keeps full part of the time (docs/benchmarks.md, "A fleet of workers")
    assert killed["reclaimed_after_s"] <= 2 * RUN.lease_ms / 1000 + 1.0, killed

"""Tenants sharing a band (pagedq/worker/service/tenants.py): deficit round robin over tokens, checked as a property
over random arrival orders with no Redis, then through a worker on a real Redis (the completions stream's order)."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedq.worker import Client, QueueFullError
from pagedq.worker.bulk.lines import parse_line
from pagedq.worker.client.core import make_job
from pagedq.worker.ops.status import queue_status, render
from pagedq.worker.protocol.errors import JobRejected
from pagedq.worker.protocol.job import Job, build_job, parse_job
from pagedq.worker.protocol.limits import DEFAULT_TENANT_BURST
from pagedq.worker.service.held import HeldJob, JobKey
from pagedq.worker.service.tenants import COST_CAP_QUANTA, MAX_SHOWN, OTHER, TenantShares, parse_weights
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, run_burst, scrape, wait_for, worker_thread

_ids = itertools.count()


def _held(tenant: str, cost: int, band: str = "bulk") -> HeldJob:
    job = Job(prompt="x", max_tokens=1, tenant=tenant or None)
    t = HeldJob(JobKey(band, f"j{next(_ids)}"), job, seq=next(_ids))
    t.admission_tokens = cost
    return t


def _admit_randomly(seed: int, shares: TenantShares, tenants: list[str], costs: tuple[int, int]):
    """Jobs of random tenants and costs arrive in random bursts; one is admitted per tick, the round's first.
    Yields (admitted job, the tenants that had work waiting when it was chosen)."""
    rng = random.Random(seed)
    pending: list[HeldJob] = []
    for tick in range(600):
        if tick < 450:
            for _ in range(rng.choice([0, 0, 1, 2, 8])):
                pending.append(_held(rng.choice(tenants), rng.randint(*costs)))
        if not pending:
            continue
        pending.sort(key=lambda t: t.seq)
        chosen = shares.order("bulk", pending, limit=1)[0]
        waiting = {t.job.tenant or "" for t in pending}
        pending.remove(chosen)
        shares.admitted(chosen)
        yield chosen, waiting


@pytest.mark.parametrize("burst", [0, DEFAULT_TENANT_BURST])
@pytest.mark.parametrize("seed", range(8))
def test_no_tenant_with_work_waits_more_than_a_round(seed, burst):
    """Between two admissions of a tenant with work waiting, the others get at most (tenants - 1) turns of at most
    (quantum + largest cost) / smallest cost jobs each in plain DRR (burst 0); with catch-up credit, at most two
    turns each of ((burst + 1) x quantum + 2 x largest cost) / smallest cost in all, whatever the arrival order."""
    quantum, costs = 1000, (100, 900)
    tenants = ["a", "b", "c", "", "e"]
    per_tenant = (quantum + costs[1]) if burst == 0 else ((burst + 1) * quantum + 2 * costs[1])
    bound = (len(tenants) - 1) * (per_tenant // costs[0])
    skipped = dict.fromkeys(tenants, 0)
    worst = 0
    for chosen, waiting in _admit_randomly(seed, TenantShares(quantum=quantum, burst=burst), tenants, costs):
        for tenant in waiting:
            skipped[tenant] = 0 if tenant == (chosen.job.tenant or "") else skipped[tenant] + 1
            worst = max(worst, skipped[tenant])
    assert 0 < worst <= bound, (worst, bound)


def _admit(shares: TenantShares, pending: list[HeldJob], count: int) -> list[str]:
    out = []
    for _ in range(count):
        chosen = shares.order("bulk", pending, limit=1)[0]
        pending.remove(chosen)
        shares.admitted(chosen)
        out.append(chosen.job.tenant or "")
    return out


def test_a_tenant_new_behind_a_backlog_is_served_first_up_to_its_burst():
    """B's 10 jobs (2 quanta) turn up after A has had 40 rounds: all 10 go before A's next; of 30 (6 quanta, past a
    burst of 4), 4 quanta go first (and the turn A had spent already), then they take turns. Weights scale it."""
    cases = ((10, 8, {}, (10, 10)), (30, 4, {}, (20, 25)), (30, 4, {"B": 0.5}, (10, 12)))
    for b_jobs, burst, weights, first_b in cases:
        shares = TenantShares(weights, quantum=100, burst=burst)
        pending = [_held("A", 20) for _ in range(400)]
        _admit(shares, pending, 200)  # 40 rounds of A alone
        pending += [_held("B", 20) for _ in range(b_jobs)]
        order = _admit(shares, pending, b_jobs + 20)
        served_first = order.index("A")
        assert first_b[0] <= served_first <= first_b[1], (b_jobs, burst, weights, order)
        if served_first < b_jobs:  # then A's turn, then B's
            assert order[served_first : served_first + 6] == ["A"] * 5 + ["B"], (b_jobs, burst, weights, order)
    shares = TenantShares(quantum=100, burst=0)  # plain DRR: B joins at the tail, A finishes its turn first
    pending = [_held("A", 20) for _ in range(400)]
    _admit(shares, pending, 202)
    pending += [_held("B", 20) for _ in range(10)]
    assert _admit(shares, pending, 8) == ["A"] * 3 + ["B"] * 5


def test_the_catch_up_credit_is_earned_by_sitting_out_rounds():
    """A tenant back after sitting out k rounds catches up on k turns (5 jobs each here), at most `burst`, before
    the others' next turn; back at once, at most the one turn it missed (coming and going gets it no more than
    staying would)."""
    shares = TenantShares(quantum=100, burst=8)
    pending = [_held("A", 20) for _ in range(600)]
    _admit(shares, pending, 50)
    for sit_out in (0, 3, 12):
        pending += [_held("B", 20) for _ in range(60)]
        _admit(shares, pending, 65)
        pending[:] = [t for t in pending if t.job.tenant == "A"]
        _admit(shares, pending, 1)  # B has left
        left = shares.rounds["bulk"].clock
        _admit(shares, pending, 5 * sit_out)
        missed = shares.rounds["bulk"].clock - left
        assert sit_out <= missed <= sit_out + 1
        pending += [_held("B", 20) for _ in range(60)]
        order = _admit(shares, pending, 65)
        credit = min(int(missed), 8)
        assert 5 * credit <= order.index("A") <= 5 * (credit + 1), (sit_out, missed, order)
        pending[:] = [t for t in pending if t.job.tenant == "A"]
        _admit(shares, pending, 1)


def test_a_backlogged_tenant_and_a_small_one_share_tokens_by_weight():
    """Two tenants always busy: the tokens each is admitted are in the ratio of their weights (within a job)."""
    shares = TenantShares(parse_weights("heavy=3"), quantum=500)
    pending = [_held(tenant, 250) for _ in range(200) for tenant in ("heavy", "light")]
    served = {"heavy": 0, "light": 0}
    for _ in range(160):
        chosen = shares.order("bulk", pending, limit=1)[0]
        pending.remove(chosen)
        shares.admitted(chosen)
        served[chosen.job.tenant or ""] += chosen.admission_tokens
    assert abs(served["heavy"] / served["light"] - 3) < 0.1, served


def test_a_huge_job_waits_a_bounded_number_of_rounds():
    shares = TenantShares(quantum=100)
    huge, small = _held("a", 10**9), [_held("b", 100) for _ in range(50)]
    order = [t.job.tenant for t in shares.order("bulk", [huge, *small])]
    assert order.index("a") <= COST_CAP_QUANTA + 1


@pytest.mark.parametrize(
    "text, problem",
    [("a", "NAME=WEIGHT"), ("a b=1", "NAME=WEIGHT"), ("a=x", "not a number"), ("a=0", "(0, 1000"), ("a=1e9", "(0")],
)
def test_bad_weights_are_named(text, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        parse_weights(text)


def test_the_tenant_field_is_bounded_and_optional_on_the_wire():
    assert build_job(prompt="x", tenant="acme-1.eu").tenant == "acme-1.eu"
    assert "tenant" not in build_job(prompt="x").to_json()  # workers that predate tenants still take it
    for bad in ("", "a" * 65, "has space", "a/b", 7):
        with pytest.raises(JobRejected, match="tenant"):
            build_job(prompt="x", tenant=bad)
    with pytest.raises(JobRejected, match="tenant"):
        parse_job(b'{"prompt": "x", "tenant": "a{b"}')
    _, fields, _ = parse_line('{"custom_id": "c1", "prompt": "x", "tenant": "acme"}')  # pagedq bulk's lines
    assert make_job(**fields).tenant == "acme"


def completion_order(r) -> list[str]:
    return [fields[b"id"].decode() for _, fields in r.xrange(KEYS.completions)]


@pytest.mark.parametrize("read_ahead", [100, 0])
def test_a_second_tenant_is_not_queued_behind_the_first_ones_backlog(redis_url, r, read_ahead):
    """Through a worker: tenant A's 60 bulk jobs are enqueued before tenant B's 8. Read far enough ahead (the
    worker's per-tenant queues), B's take turns with A's; with no read-ahead past max_waiting, B's wait for A's."""
    client = Client(redis_url)
    jobs = dict(max_tokens=4, temperature=0.0, band="bulk")
    first = client.submit_many([dict(prompt=f"a {i}", tenant="A", **jobs) for i in range(60)])
    second = client.submit_many([dict(prompt=f"b {i}", tenant="B", **jobs) for i in range(8)])
    run_burst(StubEngine(max_num_seqs=2), redis_url, max_waiting=8, tenant_read_ahead=read_ahead, tenant_quantum=8)
    order = completion_order(r)
    assert sorted(order) == sorted(first + second)
    last_b = max(order.index(job_id) for job_id in second)
    if read_ahead:
        assert last_b < 24, last_b  # taking turns: about 2 x 8, not after A's 60
    else:
        assert last_b > 50, last_b


def test_each_tenant_has_its_own_queued_limit(redis_url, r):
    client = Client(redis_url, max_tenant_queued=3)
    first = client.submit_many([dict(prompt=f"a {i}", max_tokens=2, tenant="A") for i in range(3)])
    with pytest.raises(QueueFullError, match="tenant 'A' is at its limit: 3 jobs queued, limit 3") as full:
        client.submit(prompt="a 4", max_tokens=2, tenant="A", band="bulk")  # the limit spans the bands
    assert full.value.tenant == "A" and client.queue_depth() == 3  # nothing enqueued
    client.submit_many([dict(prompt=f"b {i}", max_tokens=2, tenant="B") for i in range(2)])
    client.submit(prompt="no tenant", max_tokens=2)
    with pytest.raises(QueueFullError, match="tenant 'A'"):  # all or none
        client.submit_many([dict(prompt="b 4", tenant="B"), dict(prompt="a 5", tenant="A")])
    run_burst(StubEngine(), redis_url)
    assert all(client.result(job_id, timeout=1).ok for job_id in first)
    client.submit_many([dict(prompt=f"a again {i}", max_tokens=2, tenant="A") for i in range(3)])  # finished: pruned
    assert r.scard(KEYS.tenant_queued("A")) == 3
    with pytest.raises(ValueError, match="max_tenant_queued"):
        Client(redis_url, max_tenant_queued=0)


def test_per_tenant_figures_in_status_and_metrics(redis_url, r):
    """The heartbeat (what `pagedq status` shows) and the metrics count each tenant's jobs, and the
    read-to-admit delay of each band."""
    client = Client(redis_url)
    client.submit_many([dict(prompt=f"a {i}", max_tokens=3, tenant="A") for i in range(5)])
    client.submit_many([dict(prompt=f"b {i}", max_tokens=3, tenant="B", band="bulk") for i in range(3)])
    client.submit(prompt="nobody's", max_tokens=3)
    with worker_thread(StubEngine(), redis_url, metrics_port=0, metrics_every_s=0.05, name="tw") as worker:
        wait_for(lambda: r.xlen(KEYS.completions) == 9, what="all done")
        key = (("tenant", "A"),)
        m = wait_for(lambda: (m := scrape(worker.metrics.port)).get(("pagedq_tenant_admitted_jobs", key)) and m)
        status = wait_for(
            lambda: queue_status(r, "default")["tenants"].get("B", {}).get("admitted") and queue_status(r, "default")
        )
    assert m[("pagedq_tenant_admitted_jobs", (("tenant", "B"),))] == 3
    assert m[("pagedq_tenant_admitted_jobs", (("tenant", "(none)"),))] == 1
    assert m[("pagedq_tenant_admitted_tokens", key)] == 5 * (3 + 3)  # prompt "a i" is 3 stub tokens, + max_tokens
    assert ("pagedq_read_to_admit_p99_seconds", (("band", "bulk"),)) in m
    assert {name: row["admitted"] for name, row in status["tenants"].items()} == {"A": 5, "B": 3, "": 1}
    (w,) = status["workers"]
    assert w["admit_delay"]["default"]["count"] == 6 and w["admit_delay"]["bulk"]["count"] == 3
    assert "TENANT" in render([status]) and "bulk=" in render([status])


def test_figures_name_the_busiest_tenants_and_sum_the_rest():
    shares = TenantShares()
    held = [_held(f"t{i}", 10) for i in range(25) for _ in range(i + 1)]  # t24 is the busiest
    shares.admitted(held[0])
    figures = shares.figures(held)
    assert len(figures) == MAX_SHOWN + 1 and "t24" in figures and "t0" not in figures
    assert sum(row["waiting"] for row in figures.values()) == len(held)
    assert figures[OTHER]["admitted"] == 1 and figures[OTHER]["waiting"] == sum(range(1, 6))

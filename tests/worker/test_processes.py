"""Worker processes (stub engine, so no model load): kill -9 recovery, SIGTERM drain, two workers on one
queue, JSON logs. Oracle: the completions stream and each job's result stream hold exactly one final
record per job, with the output the stub computes for that job alone."""

from __future__ import annotations

import json
import signal

import pytest

from pagedq.worker import Client
from pagedq.worker.service.engine_api import RequestOutputKind, SamplingParams
from pagedq.worker.testing.stub_engine import StubEngine

from .helpers import KEYS, assert_clean_queue, finals_by_id, result_stream, start_worker, wait_for

# Every test here runs `pagedq worker` processes.
pytestmark = pytest.mark.slow


def expected_text(prompt: str, max_tokens: int) -> str:
    engine = StubEngine()
    engine.add_request(
        "x", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    while True:
        for out in engine.step():
            return out.outputs[0].text


def submit_jobs(client: Client, n: int, max_tokens: int, tag: str) -> dict[str, str]:
    jobs = [dict(prompt=f"{tag} {i}", max_tokens=max_tokens, temperature=0.0, stream=i % 3 == 0) for i in range(n)]
    return dict(zip(client.submit_many(jobs), (j["prompt"] for j in jobs)))


def check_exactly_once(r, client: Client, jobs: dict[str, str], max_tokens: int) -> dict[str, list[dict]]:
    finals = finals_by_id(r)
    assert set(finals) == set(jobs), "a job was lost or an unknown final appeared"
    assert all(len(records) == 1 for records in finals.values()), "a job got two final records"
    for job_id, prompt in jobs.items():
        record = finals[job_id][0]
        assert record["status"] == "completed", record
        assert record["text"] == expected_text(prompt, max_tokens)
        kinds = [kind for kind, _ in result_stream(r, job_id)]
        assert kinds.count("final") == 1
    assert_clean_queue(r)
    return finals


def test_kill_9_then_restart_and_second_worker(redis_url, r, tmp_path):
    client = Client(redis_url)
    jobs = submit_jobs(client, 60, 20, "crash")
    stub = ["--engine", "stub", "--stub-step-delay", "0.01", "--max-num-seqs", "8", "--max-waiting", "8"]
    first = start_worker(redis_url, *stub, "--name", "a", log=tmp_path / "a.log")
    wait_for(lambda: r.xlen(KEYS.completions) >= 10, timeout=60, what="10 jobs done before the kill")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    pending = r.xpending(KEYS.jobs, "workers")["pending"]
    assert pending > 0, "the killed worker should have held unacknowledged jobs"
    # "a" restarts under its name (re-reads its own pending entries); "b" claims whatever stays idle.
    again = start_worker(redis_url, *stub, "--name", "a", "--burst", log=tmp_path / "a2.log")
    # "b" starts once "a" has re-read its pending list: started together, "b" may claim them all first
    wait_for(lambda: "worker_started" in (tmp_path / "a2.log").read_text(), timeout=60, what="a restarted")
    second = start_worker(redis_url, *stub, "--name", "b", "--burst", log=tmp_path / "b.log")
    assert again.wait(timeout=90) == 0 and second.wait(timeout=90) == 0
    finals = check_exactly_once(r, client, jobs, 20)
    restarted = [json.loads(line) for line in (tmp_path / "a2.log").read_text().splitlines() if line.startswith("{")]
    started = next(e for e in restarted if e["event"] == "worker_started")
    assert started["recovered"] > 0 and started["worker"] == "a"
    assert {rec[0]["worker"] for rec in finals.values()} <= {"a", "b"}


def test_sigterm_drains_in_flight_jobs_and_exits_0(redis_url, r, tmp_path):
    client = Client(redis_url)
    jobs = submit_jobs(client, 20, 40, "drain")
    proc = start_worker(
        redis_url,
        "--engine",
        "stub",
        "--stub-step-delay",
        "0.02",
        "--max-num-seqs",
        "4",
        "--max-waiting",
        "2",
        "--name",
        "d",
        "--drain-timeout",
        "30",
        log=tmp_path / "d.log",
    )
    wait_for(lambda: r.xlen(KEYS.completions) >= 4, timeout=60, what="some jobs done")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    logs = [json.loads(line) for line in (tmp_path / "d.log").read_text().splitlines() if line.startswith("{")]
    stopped = next(e for e in logs if e["event"] == "worker_stopped")
    done = finals_by_id(r)
    assert all(rec[0]["status"] == "completed" for rec in done.values())  # nothing aborted by the drain
    assert len(done) < len(jobs)  # it stopped admitting
    assert stopped["unacknowledged"] == r.xpending(KEYS.jobs, "workers")["pending"]
    assert r.get(KEYS.heartbeat("d")) is None
    # the rest is still queued (unacknowledged or never delivered): a burst worker finishes it
    rest = start_worker(redis_url, "--engine", "stub", "--name", "d", "--burst", log=tmp_path / "d2.log")
    assert rest.wait(timeout=60) == 0
    check_exactly_once(r, client, jobs, 40)


def test_two_workers_share_a_queue(redis_url, r, tmp_path):
    client = Client(redis_url)
    jobs = submit_jobs(client, 120, 10, "shared")
    stub = ["--engine", "stub", "--stub-step-delay", "0.005", "--max-num-seqs", "8", "--max-waiting", "8", "--burst"]
    procs = [start_worker(redis_url, *stub, "--name", name, log=tmp_path / f"{name}.log") for name in ("x", "y")]
    assert [p.wait(timeout=90) for p in procs] == [0, 0]
    finals = check_exactly_once(r, client, jobs, 10)
    per_worker = {name: sum(rec[0]["worker"] == name for rec in finals.values()) for name in ("x", "y")}
    assert per_worker["x"] > 0 and per_worker["y"] > 0, per_worker
    for name in ("x", "y"):  # structlog JSON lines with the worker bound (and job_id on job events)
        events = [json.loads(line) for line in (tmp_path / f"{name}.log").read_text().splitlines()]
        assert all(e["worker"] == name for e in events if e["event"].startswith(("worker_", "job_")))


def test_a_job_that_kills_its_worker_sinks_only_itself(redis_url, r, tmp_path):
    """One job kills its worker process (os._exit, as a segfault) whenever it is stepped; it sits among 20
    good jobs, all read ahead into one batch. The worker is restarted after each crash: only the crasher is
    dead-lettered (after max_attempts runs, the last 2 alone), the 20 complete exactly, each once."""
    client = Client(redis_url)
    good = submit_jobs(client, 10, 12, "before")
    crasher = client.submit(prompt="this one CRASHES the worker", max_tokens=12, temperature=0.0)
    good.update(submit_jobs(client, 10, 12, "after"))
    env = {"PAGEDQ_FAULT_PROMPT": "CRASHES", "PAGEDQ_FAULT_MODE": "exit"}
    stub = [
        "--engine",
        "stub",
        "--stub-step-delay",
        "0.01",
        "--max-num-seqs",
        "32",
        "--max-attempts",
        "3",
        "--name",
        "a",
        "--burst",
    ]
    codes = []
    while not codes or codes[-1] != 0:
        assert len(codes) < 8, f"the worker kept dying: exit codes {codes}"
        proc = start_worker(redis_url, *stub, log=tmp_path / "a.log", faults=env)
        codes.append(proc.wait(timeout=60))
    assert codes == [86, 86, 86, 0]  # in the batch, then alone twice; the 4th start dead-letters it unrun
    res = client.result(crasher, timeout=1)
    assert res.status == "failed" and res.attempts == 3 and "attempts 3, max_attempts 3" in res.error
    letters = r.xrange(KEYS.dead)
    assert [letter[1][b"id"].decode() for letter in letters] == [crasher]
    finals = finals_by_id(r)
    del finals[crasher]
    for job_id, prompt in good.items():
        record = finals[job_id][0]
        assert record["status"] == "completed" and record["text"] == expected_text(prompt, 12)
        assert len(finals[job_id]) == 1
    assert set(finals) == set(good)
    assert r.hlen(KEYS.runs) == 0
    assert_clean_queue(r)


def test_kill_9_with_tenants_and_bands_mixed_loses_and_duplicates_nothing(redis_url, r, tmp_path):
    """Jobs of three tenants (and none) over all three bands; the worker is killed mid-run and a restarted one
    and a second one finish: every job has exactly one final record, with the stub's output."""
    client = Client(redis_url, max_tenant_queued=100)
    bands, tenants = ("interactive", "default", "bulk"), ("A", "B", "C", None)
    specs = [
        dict(prompt=f"mixed {i}", max_tokens=20, temperature=0.0, stream=i % 3 == 0, band=bands[i % 3])
        | ({"tenant": tenants[i % 4]} if tenants[i % 4] else {})
        for i in range(48)
    ]
    jobs = dict(zip(client.submit_many(specs), (s["prompt"] for s in specs)))
    stub = ["--engine", "stub", "--stub-step-delay", "0.01", "--max-num-seqs", "4", "--max-waiting", "6"]
    first = start_worker(redis_url, *stub, "--name", "a", log=tmp_path / "a.log")
    wait_for(lambda: r.xlen(KEYS.completions) >= 8, timeout=60, what="some jobs done before the kill")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert sum(r.xpending(KEYS.jobs_of(band), "workers")["pending"] for band in bands) > 0
    again = start_worker(redis_url, *stub, "--name", "a", "--burst", log=tmp_path / "a2.log")
    wait_for(lambda: "worker_started" in (tmp_path / "a2.log").read_text(), timeout=60, what="a restarted")
    second = start_worker(redis_url, *stub, "--name", "b", "--burst", log=tmp_path / "b.log")
    assert again.wait(timeout=90) == 0 and second.wait(timeout=90) == 0
    check_exactly_once(r, client, jobs, 20)

"""`pagedq bench fleet`: real `pagedq worker` processes on the stub engine, against a private Redis (and, with
--cluster, a private three-master Redis Cluster), while workers come and go under a backlog.

Scenarios, each on a fresh queue: scale out 1 -> 4 workers, scale in 4 -> 1 by SIGTERM, kill -9 one worker of 4,
and the queue's throughput against the worker count (1..4, zero-cost engine steps: the queue layer's own limit,
with the CPU time Redis and the workers used over it). For each fault scenario it counts jobs

- lost: no final record;
- duplicated: two final records, or a run whose final record was already written (the worker's FINALIZE counts it);
- reprocessed: taken from another worker's lease (XAUTOCLAIM, or re-read by a restarted worker), so started again.

Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import psutil

from pagedq.worker.client.sync_client import Client
from pagedq.worker.ops.embedded_redis import EmbeddedRedis
from pagedq.worker.protocol.keys import BANDS, GROUP, QueueKeys


@dataclass(frozen=True)
class FleetRun:
    """The workload and the workers' settings every scenario shares."""

    jobs: int = 600
    throughput_jobs: int = 5000
    max_tokens: int = 4
    step_delay_s: float = 0.02  # each stub step sleeps like a device step: workers wait, not compute
    max_num_seqs: int = 4  # few seats, so each worker holds a backlog of its own (the fault scenarios)
    throughput_seqs: int = 256  # the throughput scenario's: as many jobs per turn as a real batch takes
    lease_ms: int = 2000  # short, so a killed worker's jobs are claimed within the run
    drain_timeout_s: float = 30.0
    timeout_s: float = 120.0  # for any one wait (all jobs done, a worker up or gone)


class Fleet:
    """Worker processes on one queue, named fleet-1, fleet-2, ...; their JSON logs in a folder."""

    def __init__(self, url: str, queue: str, run: FleetRun, folder: Path) -> None:
        self.url, self.queue, self.run, self.folder = url, queue, run, folder
        self.procs: dict[str, subprocess.Popen] = {}
        self.client = Client(url, queue=queue)

    def start(self, count: int) -> list[str]:
        """Start count more workers; return once each has sent its first heartbeat."""
        names = [f"fleet-{len(self.procs) + i + 1}" for i in range(count)]
        for name in names:
            command = [sys.executable, "-m", "pagedq.worker", "worker", "--redis", self.url, "--queue", self.queue]
            command += ["--name", name, "--engine", "stub", "--stub-step-delay", str(self.run.step_delay_s)]
            command += ["--max-num-seqs", str(self.run.max_num_seqs), "--max-waiting", str(self.run.max_num_seqs)]
            command += ["--lease-ms", str(self.run.lease_ms), "--drain-timeout", str(self.run.drain_timeout_s)]
            command += ["--block-ms", "100", "--heartbeat-interval", "0.5"]
            with open(self.folder / f"{self.queue}-{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        keys = self.client.keys
        wait_until(
            lambda: all(self.client.r.exists(keys.heartbeat(n)) for n in names), self.run.timeout_s, "workers up"
        )
        return names

    def signal(self, name: str, signum: int) -> None:
        self.procs[name].send_signal(signum)

    def wait_exit(self, names: list[str]) -> dict[str, int]:
        return {name: self.procs[name].wait(timeout=self.run.timeout_s) for name in names}

    def stop(self) -> None:
        """SIGTERM the workers still running and wait for them (SIGKILL past the timeout)."""
        alive = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        for proc in alive:
            try:
                proc.wait(timeout=self.run.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def events(self, event: str) -> list[dict[str, Any]]:
        """Every log record of that event, from every worker's log."""
        found = []
        for name in self.procs:
            for line in (self.folder / f"{self.queue}-{name}.log").read_text().splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    if record.get("event") == event:
                        found.append(record)
        return found

    def cpu_seconds(self) -> float:
        """User + system CPU time of the workers still running."""
        total = 0.0
        for proc in self.procs.values():
            times = psutil.Process(proc.pid).cpu_times()
            total += times.user + times.system
        return total

    def submit(self, count: int) -> list[str]:
        jobs = [
            {"prompt": f"{self.queue} {i}", "max_tokens": self.run.max_tokens, "temperature": 0.0} for i in range(count)
        ]
        ids: list[str] = []
        for i in range(0, count, 1000):
            ids += self.client.submit_many(jobs[i : i + 1000])
        return ids

    def done(self) -> int:
        return int(self.client.r.xlen(self.client.keys.completions))

    def wait_done(self, count: int) -> None:
        wait_until(lambda: self.done() >= count, self.run.timeout_s, f"{count} final records")

    def now_ms(self) -> int:
        """Redis' clock (the completions stream's entry ids are stamped by it), in ms."""
        seconds, micros = self.client.r.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def rate(self, start_ms: int, end_ms: int) -> float:
        """Final records written per second between two Redis times."""
        finished = self.finals(f"{start_ms}-0", f"{end_ms}-0")
        return round(len(finished) * 1000 / max(end_ms - start_ms, 1), 1)

    def finals(self, first: str = "-", last: str = "+") -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The completions stream's records (XRANGE first..last), as a client without decode_responses reads them."""
        records = self.client.r.xrange(self.client.keys.completions, first, last)
        return cast("list[tuple[bytes, dict[bytes, bytes]]]", records)

    def tally(self, ids: list[str]) -> dict[str, int]:
        """Jobs lost, duplicated and reprocessed (the module's docstring says how each is counted)."""
        finals: dict[str, int] = {}
        for _, fields in self.finals():
            job_id = fields[b"id"].decode()
            finals[job_id] = finals.get(job_id, 0) + 1
        stopped = self.events("worker_stopped")
        return {
            "jobs": len(ids),
            "lost": sum(1 for job_id in ids if job_id not in finals),
            "duplicated": sum(n - 1 for n in finals.values()) + sum(e.get("duplicate_finals", 0) for e in stopped),
            "reprocessed": sum(e["count"] for e in self.events("jobs_claimed"))
            + sum(e["recovered"] for e in self.events("worker_started")),
            "handed_back": sum(e.get("requeued", 0) + e.get("released", 0) for e in stopped),
        }


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"bench fleet: timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def fleet(url: str, queue: str, run: FleetRun, folder: Path) -> Iterator[Fleet]:
    workers = Fleet(url, queue, run, folder)
    try:
        yield workers
    finally:
        workers.stop()


def scale_out(url: str, run: FleetRun, folder: Path) -> dict[str, Any]:
    """A backlog, one worker, then three more once an eighth is done: the rate before and after (from when all four
    are up), nothing run twice."""
    with fleet(url, "fleet-scale-out", run, folder) as workers:
        ids = workers.submit(run.jobs)
        workers.start(1)
        started_ms = workers.now_ms()
        workers.wait_done(run.jobs // 8)
        one_ms = workers.now_ms()
        workers.start(3)
        four_ms = workers.now_ms()
        workers.wait_done(run.jobs)
        end_ms = workers.now_ms()
        workers.stop()
        rates = {"1": workers.rate(started_ms, one_ms), "4": workers.rate(four_ms, end_ms)}
        return {**workers.tally(ids), "jobs_per_s": rates}


def scale_in(url: str, run: FleetRun, folder: Path) -> dict[str, Any]:
    """A backlog, four workers, then SIGTERM to three once a quarter is done: each drains (finishes what runs,
    hands back what it read ahead) and exits 0; the last one finishes the queue."""
    with fleet(url, "fleet-scale-in", run, folder) as workers:
        ids = workers.submit(run.jobs)
        names = workers.start(4)
        workers.wait_done(run.jobs // 4)
        for name in names[1:]:
            workers.signal(name, signal.SIGTERM)
        exits = workers.wait_exit(names[1:])
        workers.wait_done(run.jobs)
        workers.stop()
        return {**workers.tally(ids), "exit_codes": sorted(exits.values())}


def kill_one(url: str, run: FleetRun, folder: Path) -> dict[str, Any]:
    """A backlog, four workers, then kill -9 one once a quarter is done: how long until its leased jobs are claimed
    by the others (claimable once idle past lease_ms; claimers look every lease_ms / 2 and take what their read-ahead
    room holds)."""
    with fleet(url, "fleet-kill", run, folder) as workers:
        ids = workers.submit(run.jobs)
        names = workers.start(4)
        workers.wait_done(run.jobs // 4)
        victim = names[-1]
        keys, r = workers.client.keys, workers.client.r
        workers.signal(victim, signal.SIGKILL)
        killed = time.monotonic()
        workers.wait_exit([victim])
        held = _pending_of(r, keys, victim)
        wait_until(lambda: _pending_of(r, keys, victim) == 0, run.timeout_s, f"{victim}'s leases claimed")
        reclaimed_s = time.monotonic() - killed
        workers.wait_done(run.jobs)
        workers.stop()
        return {
            **workers.tally(ids),
            "leased_at_kill": held,
            "reclaimed_after_s": round(reclaimed_s, 2),
            "lease_s": run.lease_ms / 1000,
        }


def _pending_of(r: Any, keys: QueueKeys, consumer: str) -> int:
    """Entries of every band's stream leased to a consumer (XPENDING's per-consumer summary)."""
    total = 0
    for band in BANDS:
        for entry in r.xpending(keys.jobs_of(band), GROUP)["consumers"]:
            name = entry["name"].decode() if isinstance(entry["name"], bytes) else entry["name"]
            if name == consumer:
                total += int(entry["pending"])
    return total


def throughput(
    url: str, run: FleetRun, folder: Path, redis_pid: int | None, counts: range, repeats: int
) -> list[dict[str, Any]]:
    """Jobs/s through 1..4 workers whose engine steps cost nothing, with the CPU Redis and the workers used (in
    cores: CPU seconds over wall seconds); a cluster's nodes are not measured (redis_pid None). Each count runs
    `repeats` times and keeps its best run (a shared machine's noise only ever slows a run)."""
    rows = []
    for count in counts:
        runs = [_throughput_once(url, run, folder, redis_pid, count, repeat) for repeat in range(repeats)]
        rows.append(
            {**max(runs, key=lambda row: row["jobs_per_s"]), "runs_jobs_per_s": [r["jobs_per_s"] for r in runs]}
        )
    return rows


def _throughput_once(url: str, run: FleetRun, folder: Path, redis_pid: int | None, count: int, repeat: int) -> dict:
    free_steps = replace(run, step_delay_s=0.0, max_num_seqs=run.throughput_seqs)
    with fleet(url, f"fleet-throughput-{count}-{repeat}", free_steps, folder) as workers:
        workers.start(count)
        ids = workers.submit(run.throughput_jobs)  # the client's cost comes before the timed part
        redis = psutil.Process(redis_pid) if redis_pid else None  # a cluster's nodes: not measured
        redis_before, commands_before = _cpu(redis), _commands(workers.client.r) if redis else 0
        workers_before = workers.cpu_seconds()
        start = time.perf_counter()
        workers.wait_done(len(ids))
        seconds = time.perf_counter() - start
        commands = _commands(workers.client.r) - commands_before if redis else 0
        return {
            "workers": count,
            "jobs_per_s": round(len(ids) / seconds, 1),
            "redis_cores": round((_cpu(redis) - redis_before) / seconds, 2) if redis else None,
            "redis_commands_per_s": round(commands / seconds) if redis else None,
            "workers_cores": round((workers.cpu_seconds() - workers_before) / seconds, 2),
        }


def _commands(r: Any) -> int:
    return int(r.info("stats")["total_commands_processed"])


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return times.user + times.system


def scenarios(url: str, run: FleetRun, folder: Path, redis_pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if args.scenarios in ("all", "faults"):
        found["scale_out_1_to_4"] = scale_out(url, run, folder)
        found["scale_in_4_to_1"] = scale_in(url, run, folder)
        found["kill_9_one_of_4"] = kill_one(url, run, folder)
    if args.scenarios in ("all", "throughput"):
        counts = range(1, args.max_workers + 1)
        found["throughput_by_workers"] = throughput(url, run, folder, redis_pid, counts, args.repeats)
    return found


def run_bench(args: argparse.Namespace) -> int:
    run = FleetRun(args.jobs, args.throughput_jobs, lease_ms=args.lease_ms, step_delay_s=args.step_delay)
    result: dict[str, Any] = {
        "bench": "fleet",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
        "jobs": run.jobs,
        "throughput_jobs": run.throughput_jobs,
        "max_tokens": run.max_tokens,
        "step_delay_s": run.step_delay_s,
        "load_average_before": [round(x, 1) for x in os.getloadavg()],  # other work on the machine
    }
    with tempfile.TemporaryDirectory(prefix="pagedq-fleet-") as folder, EmbeddedRedis() as server:
        result["redis_version"] = Client(server.url).r.info("server")["redis_version"]
        pid = server.proc.pid if server.proc else None
        result["redis"] = scenarios(server.url, run, Path(folder), pid, args)
    if args.cluster:
        from pagedq.worker.ops.embedded_cluster import EmbeddedCluster

        with tempfile.TemporaryDirectory(prefix="pagedq-fleet-") as folder, EmbeddedCluster() as cluster:
            result["redis_cluster"] = scenarios(cluster.url, run, Path(folder), None, args)
    result["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)
    faults = [v for k, v in result.items() if k in ("redis", "redis_cluster")]
    bad = [
        s
        for side in faults
        for name, s in side.items()
        if name != "throughput_by_workers" and s["lost"] + s["duplicated"]
    ]
    if bad:
        print("bench fleet: a job was lost or run twice", file=sys.stderr)
        return 1
    return 0

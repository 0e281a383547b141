"""A real 3-master Redis Cluster on 127.0.0.1, started once for the session (issue 12), and queues whose slot
lands on each master, reached through a node that does NOT own the slot (so every command is redirected or
routed by the client, never served by luck)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from redis import Redis
from redis.cluster import RedisCluster, key_slot

from pagedq.worker.ops.embedded_cluster import EmbeddedCluster
from pagedq.worker.protocol.keys import QueueKeys


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


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The cluster `pagedq bench fleet --cluster` starts too (pagedq/worker/ops/embedded_cluster.py)."""
    with EmbeddedCluster() as embedded:
        yield Cluster(embedded.ports, _slot_owners(embedded.ports[0]))


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
